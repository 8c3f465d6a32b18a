"""Inputs at the edges of their types: ids wider than int32, zero-length sequences, a linear weight near float32's end.

- int64 ids >= 2**31 were cast to int32 first (``2**32 + 3`` became 3, a valid id) in the Keras call,
  `predict` and `OnnxPredictor`, and the Keras error reported the wrapped value;
- a zero-length sequence ran through (Keras) or failed inside onnxruntime ("GlobalAveragePool ...
  moments/mean");
- ``linear_weight=3e38`` passed validation and gave NaN in every row.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import export
from keras_linattn.layers import LinearAttention
from keras_linattn.models import LinearCausalLM

V = 16
WIDE = np.array([[3, 7, 2**32 + 3]], "int64")  # wraps to [3, 7, 3] in int32


@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(0)
    return LinearCausalLM(vocabulary_size=V, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, chunk_size=4)


@pytest.fixture(scope="module")
def predictor(lm, tmp_path_factory):
    paths = export.export_onnx(lm, tmp_path_factory.mktemp("edge_inputs") / "lm.onnx", include_step=False)
    return export.OnnxPredictor(paths["model"], device="cpu")


def test_wide_ids_are_refused_by_the_keras_call_with_the_value_received(lm):
    with pytest.raises(ValueError, match=r"`token_ids` must be in \[0, 16\)\. Received: min=3, max=4294967299"):
        lm(WIDE)
    with pytest.raises(ValueError, match=r"max=4294967356 \(token_ids.dtype=int64\)"):
        lm(np.array([[3, 7, 2**32 + 60]], "int64"))  # was reported as max=60
    with pytest.raises(ValueError, match=r"min=-4294967293"):
        lm(np.array([[3, -(2**32) + 3]], "int64"))
    # int64 ids in range give the int32 ids' logits, exactly (the same graph after the cast).
    np.testing.assert_array_equal(np.asarray(lm(WIDE % 2**32)), np.asarray(lm((WIDE % 2**32).astype("int32"))))


def test_wide_ids_are_refused_by_predict_with_the_value_received(lm):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"`token_ids` must be in \[0, 16\).*\[3\] \[4294967299\]"):
        lm.predict(WIDE, verbose=0)


def test_wide_ids_under_xla_give_nan_not_another_tokens_logits(lm):
    # XLA drops the assertion: the wide id is marked invalid (NaN at its position), never read as id 3.
    lm.compile(jit_compile=True)
    try:
        logits = lm.predict(WIDE, verbose=0)
    finally:
        lm.compile()
    assert np.isnan(logits[0, 2]).all() and np.isfinite(logits[0, :2]).all()


def test_wide_ids_are_refused_by_onnx_predictor_before_the_cast(predictor):
    with pytest.raises(
        ValueError, match=r"Input 'token_ids' holds integers outside the graph's int32 range.*max=4294967299"
    ):
        predictor({"token_ids": WIDE})
    with pytest.raises(ValueError, match=r"min=-2147483649"):
        predictor({"token_ids": np.array([[1, -(2**31) - 1]], "int64")})
    ok = predictor({"token_ids": WIDE % 2**32})["logits"]  # in range: cast and run
    np.testing.assert_array_equal(ok, predictor({"token_ids": (WIDE % 2**32).astype("int32")})["logits"])


def test_zero_length_sequences_get_one_clear_error(lm, predictor):
    empty = np.zeros((2, 0), "int32")
    message = r"`token_ids` must hold at least one token per row\. Received: token_ids\.shape=\(2, 0\)"
    with pytest.raises(ValueError, match=message):
        lm(empty)
    with pytest.raises(ValueError, match=message):
        lm.predict(empty, verbose=0)
    with pytest.raises(ValueError, match=r"prompt_ids\.shape=\(2, 0\)"):
        lm.generate(empty, max_length=4)
    with pytest.raises(
        ValueError, match=r"Input 'token_ids' of the model graph .* Received: token_ids\.shape=\(2, 0\)"
    ):
        predictor({"token_ids": empty})


@pytest.mark.parametrize("weight", [3e38, 1e20, 2.0**63 * 1.01, float("inf"), -1.0])
def test_a_linear_weight_whose_products_overflow_float32_is_refused(weight):
    with pytest.raises(
        ValueError,
        match=r"`linear_weight` .* \(0, 2\*\*63\].*Received: linear_weight=" + re.escape(repr(weight)),
    ):
        LinearAttention(2, 4, window_size=2, linear_weight=weight)


@pytest.mark.parametrize("weight", [2.0**63, 1e-30, 1e-3])
def test_a_linear_weight_inside_the_range_gives_finite_outputs(weight):
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    layer = LinearAttention(2, 4, window_size=2, linear_weight=weight, feature_map="elu")
    assert np.isfinite(np.asarray(layer(x, x, use_causal_mask=True))).all()
