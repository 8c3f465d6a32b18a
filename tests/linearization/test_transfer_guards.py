"""The trainer of `attention_transfer` / `distill_attention` is loud: non-finite steps, divergence, bad data."""

import warnings

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from keras_linattn import distill
from keras_linattn._trainer import DivergenceWarning, NonFiniteLossError
from keras_linattn.layers import LinearAttention
from tests.linearization._models import causal_teacher, data, weights

WINDOW = 3


def _pair():
    keras.utils.set_random_seed(0)
    teacher, _ = causal_teacher()
    return teacher, keras_linattn.linearize(teacher, window_size=WINDOW)


def test_nan_in_the_data_stops_transfer_and_leaves_the_weights_finite():
    teacher, student = _pair()
    x = data(8)
    x[5, 3, 1] = np.nan  # second batch of 4
    before = weights(student)
    with pytest.raises(NonFiniteLossError, match=r"step 2 .*NaN/inf.*learning_rate=0.01"):
        keras_linattn.attention_transfer(student, teacher, x, steps=2, batch_size=4, verbose=0)
    after = weights(student)
    assert all(np.isfinite(v).all() for v in after.values())
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # the first (finite) step was applied


def test_inf_in_the_data_stops_distillation_with_the_weights_unchanged():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 12))
    model = keras.Model(inputs, LinearAttention(2, 4, feature_map="hedgehog")(inputs, inputs, use_causal_mask=True))
    x = np.random.default_rng(0).normal(size=(4, 8, 12)).astype("float32")
    x[0, 0, 0] = np.inf
    before = weights(model)
    with pytest.raises(NonFiniteLossError, match="step 1"):
        distill.distill_attention(model, x, epochs=1, batch_size=4, verbose=0)
    for path, value in weights(model).items():
        np.testing.assert_array_equal(value, before[path])


def test_a_diverging_transfer_warns_with_the_learning_rate():
    teacher, student = _gpt2_pair(max_sequence_length=32)
    ids = np.random.default_rng(0).integers(0, 40, (16, 12)).astype("int32")
    with pytest.warns(DivergenceWarning, match=r"learning_rate=1000"):
        keras_linattn.attention_transfer(
            student, teacher, _batch(ids), steps=4, epochs=2, batch_size=4, learning_rate=1e3, verbose=0
        )


def test_a_converging_transfer_does_not_warn():
    teacher, student = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        keras_linattn.attention_transfer(student, teacher, data(16), steps=4, epochs=2, batch_size=4, verbose=0)


def _gpt2_pair(max_sequence_length=16):
    keras.utils.set_random_seed(0)
    teacher = keras_hub.models.GPT2CausalLM(
        keras_hub.models.GPT2Backbone(
            vocabulary_size=40,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=max_sequence_length,
        ),
        preprocessor=None,
    )
    return teacher, keras_linattn.linearize(teacher, window_size=4)


def _batch(ids):
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


def test_sequences_longer_than_the_teachers_limit_are_refused():
    teacher, student = _gpt2_pair(max_sequence_length=16)
    ids = np.random.default_rng(0).integers(0, 40, (4, 20)).astype("int32")
    with pytest.raises(ValueError, match=r"`data`.*20 tokens.*max_sequence_length=16"):
        keras_linattn.attention_transfer(student, teacher, _batch(ids), steps=1, batch_size=4, verbose=0)


def test_token_ids_outside_the_teachers_vocabulary_are_refused():
    teacher, student = _gpt2_pair()
    ids = np.random.default_rng(0).integers(0, 40, (4, 8)).astype("int32")
    ids[1, 2] = 40
    with pytest.raises(ValueError, match=r"`data`.*vocabulary_size=40.*max=40"):
        keras_linattn.attention_transfer(student, teacher, _batch(ids), steps=1, batch_size=4, verbose=0)
