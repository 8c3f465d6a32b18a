"""`Model.quantize` on the package's models: every kernel outside the feature maps quantized, no warning naming
a layer of the package that holds a kernel, the one-token step on the quantized kernels, bfloat16 weights with a
float32 decode state.

Bounds: a quantized projection against its float one by the quantization error model (half a step per weight
and per input element, summed over the reduction: docs/dev/testing.md); two evaluations of one quantized model
(step against parallel) by the float model plus `_verify_bounds.quantized_term`.
"""

import random
import warnings

import keras
import numpy as np
import pytest

from keras_linattn.export import _verify_bounds
from keras_linattn.layers._attention_base import _ProjectionDense
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.tolerance import C_ROUND, assert_close, bound, eps

pytestmark = pytest.mark.numeric

VOCAB, WIDTH, HEADS, LAYERS, T = 48, 32, 4, 2, 11


def _seed(seed=0):
    keras.utils.set_random_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _lm(dtype=None, feature_map="hedgehog"):
    _seed()
    backbone = LinearBackbone(
        vocabulary_size=VOCAB,
        num_layers=LAYERS,
        hidden_dim=WIDTH,
        num_heads=HEADS,
        intermediate_dim=2 * WIDTH,
        feature_map=feature_map,
        dtype=dtype,
    )
    return LinearCausalLM(backbone=backbone, preprocessor=None)


def _feature_map_paths(lm):
    return [layer.path for layer in lm._flatten_layers() if "FeatureMap" in type(layer).__name__ and layer.weights]


def _projections(lm):
    return [layer for layer in lm._flatten_layers() if isinstance(layer, _ProjectionDense)]


def _map_weights(lm):
    maps = _feature_map_paths(lm)
    weights = {id(w): w for w in lm.weights}.values()
    return [w for w in weights if any(w.path.startswith(p + "/") for p in maps) and len(w.shape) >= 2]


def _package_kernel_layers(lm):
    """Class names of the package's leaf layers that hold a weight of rank >= 2."""
    return {
        type(layer).__name__
        for layer in lm._flatten_layers()
        if type(layer).__module__.startswith("keras_linattn")
        and not list(layer._flatten_layers(include_self=False))
        and any(len(w.shape) >= 2 for w in layer.weights)
    }


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request):
    """``(mode, float LM, quantized LM, warnings of quantize)``: the same weights before and after."""
    reference = _lm()
    lm = _lm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.quantize(request.param)
    return request.param, reference, lm, [str(w.message) for w in caught]


def test_no_warning_names_a_package_layer_with_a_kernel(quantized):
    _, reference, _, messages = quantized
    kernel_layers = _package_kernel_layers(reference)
    # The projections and the hedgehog map hold kernels: the check covers both.
    assert {"_ProjectionDense", "HedgehogFeatureMap"} <= kernel_layers
    named = [m for m in messages for name in kernel_layers if f"Layer {name} " in m]
    assert not named


def test_no_warning_names_a_layer_of_the_package(quantized):
    """The package's weightless layers (the token check, the invalid-token mark) have nothing to quantize: silent."""
    _, reference, _, messages = quantized
    package = {
        type(layer).__name__
        for layer in reference._flatten_layers()
        if type(layer).__module__.startswith("keras_linattn")
    }
    assert {"_TokenCheck", "_MarkInvalid"} <= package
    assert [m for m in messages for name in package if f"Layer {name} " in m] == []


def test_every_kernel_outside_the_feature_maps_is_quantized(quantized):
    mode, reference, lm, _ = quantized
    maps = _feature_map_paths(lm)
    assert maps  # hedgehog's kernels: they stay float
    names = ("kernel", "embeddings")  # biases [H, K] are rank 2 too, and stay float
    weights = list({id(w): w for w in lm.weights}.values())
    kernels = [w for w in weights if len(w.shape) >= 2 and w.path.rsplit("/", 1)[-1].startswith(names)]
    kernels = [w for w in kernels if not w.path.endswith(("_scale", "_zero"))]
    outside = [w for w in kernels if not any(w.path.startswith(p + "/") for p in maps)]
    assert {w.path for w in outside if "int8" not in str(w.dtype)} == set()
    assert len(outside) == 6 * LAYERS + 1  # q, k, v, o, two feed-forwards per block; the tied embedding
    inside = _map_weights(lm)
    assert inside and all(str(w.dtype) == "float32" for w in inside)
    # The feature maps' weights are the float model's, unchanged.
    for w, ref in zip(inside, _map_weights(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(ref))
    assert {p.quantization_mode for p in _projections(lm)} == {mode}


def _step_logits(lm, tokens):
    state = lm.get_initial_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        logit, state = lm.step(tokens[:, t], state)
        logits.append(np.asarray(logit))
    return np.stack(logits, axis=1), state  # [B, T, V]


def test_step_matches_parallel_on_the_quantized_model(quantized):
    _, _, lm, _ = quantized
    tokens = np.random.RandomState(1).randint(0, VOCAB, (2, T)).astype("int32")
    parallel = np.asarray(lm(tokens))
    stepped, _ = _step_logits(lm, tokens)
    n = _verify_bounds._reduction_length(lm, T)
    float_bound = bound("float32", n, paths=2)
    term = _verify_bounds.quantized_term(float_bound, *_verify_bounds.quantized_reduction(lm))
    err = np.abs(stepped - parallel).max() / np.abs(parallel).max()
    assert err <= float_bound + term, (err, float_bound, term)


def _quantization_bound(x, kernel, reduced_axes):
    """|quantized - float| per output of ``einsum(x, kernel)``: half a step per weight and per input, summed.

    ``x [B, T, n]`` flattened over the contracted dims, ``kernel`` the float kernel flattened to ``[n, out]``.
    Weight step: ``max|W[:, i]| / 127`` per output channel i; input step: ``max|x[b, t, :]| / 127`` per token.
    ``|x w - qx qw| <= sum_j |x_j| dw_i / 2 + |w_ji| dx / 2 + dx dw_i / 4``.
    """
    dw = np.abs(kernel).max(axis=0) / 127.0  # [out]
    dx = np.abs(x).max(axis=-1, keepdims=True) / 127.0  # [B, T, 1]
    n = kernel.shape[0]
    return np.abs(x).sum(-1, keepdims=True) * dw / 2 + dx * np.abs(kernel).sum(0) / 2 + n * dx * dw / 4


@pytest.mark.parametrize(
    "equation, input_shape, output_shape, bias_axes",
    [("btd,dhk->bthk", (2, 5, 24), (None, 3, 8), "hk"), ("bthk,hkd->btd", (2, 5, 3, 8), (None, 24), "d")],
)
def test_quantized_projection_within_the_quantization_error_model(equation, input_shape, output_shape, bias_axes):
    _seed(3)
    dense = _ProjectionDense(equation, output_shape=output_shape, bias_axes=bias_axes)
    dense.build(input_shape)
    dense.bias.assign(np.random.randn(*dense.bias.shape).astype("float32"))
    x = np.random.randn(*input_shape).astype("float32")
    kernel = np.asarray(dense.kernel, np.float64)
    want = np.einsum(equation, x.astype(np.float64), kernel) + np.asarray(dense.bias, np.float64)
    dense.quantize("int8")
    assert str(dense._kernel.dtype) == "int8"
    got = np.asarray(dense(x), np.float64)
    n = int(np.prod(input_shape[2:]))
    x_flat = x.reshape(input_shape[0], input_shape[1], n).astype(np.float64)
    limit = _quantization_bound(x_flat, kernel.reshape(n, -1), None).reshape(got.shape)
    float_part = C_ROUND * eps("float32") * np.sqrt(n) * np.abs(x_flat).max() * np.abs(kernel).max() * n
    assert (np.abs(got - want) <= limit + float_part).all()
    # The one-token product uses the same int8 kernel: equal to the call at T = 1 within float rounding.
    step = np.asarray(dense.step_call(x[:, 0]))
    assert_close(step, np.asarray(dense(x[:, :1]))[:, 0], n=n, paths=2, what="step_call")


def test_bfloat16_weights_keep_a_float32_decode_state():
    lm = _lm(dtype="bfloat16", feature_map="elu")
    assert {str(p.kernel.dtype) for p in _projections(lm)} == {"bfloat16"}
    # The spec and the state each step returns: every float piece float32 (S, z), the position int32.
    spec_dtypes = {str(s.dtype) for s in lm.state_spec()}
    assert spec_dtypes == {"float32", "int32"}
    tokens = np.random.RandomState(2).randint(0, VOCAB, (2, T)).astype("int32")
    stepped, state = _step_logits(lm, tokens)
    float_state = [s for s in state if "int" not in keras.backend.standardize_dtype(s.dtype)]
    assert float_state and {keras.backend.standardize_dtype(s.dtype) for s in float_state} == {"float32"}
    # The parallel form's state too (prefill), and both finite.
    _, prefill_state = lm.call_with_state(tokens, lm.get_initial_state(2))
    float_prefill = [s for s in prefill_state if "int" not in keras.backend.standardize_dtype(s.dtype)]
    assert {keras.backend.standardize_dtype(s.dtype) for s in float_prefill} == {"float32"}
    assert np.isfinite(stepped).all() and all(np.isfinite(np.asarray(s)).all() for s in float_prefill)


def test_student_of_a_bfloat16_keras_hub_teacher_keeps_bfloat16_weights_and_a_float32_state():
    import keras_hub

    import keras_linattn

    _seed()
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
        dtype="bfloat16",
    )
    teacher = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    student = keras_linattn.linearize(teacher, window_size=4)
    assert {str(p.kernel.dtype) for p in _projections(student)} == {"bfloat16"}
    # Weights copied as they are: bfloat16 in, bfloat16 out (no float32 round trip that could change a value).
    teacher_kernel = np.asarray(
        keras.ops.cast(teacher.backbone.transformer_layers[0]._self_attention_layer._query_dense.kernel, "float32")
    )
    query = min((p for p in _projections(student) if p.name == "query"), key=lambda p: p.path)  # block 0's
    student_kernel = np.asarray(keras.ops.cast(query.kernel, "float32"))
    np.testing.assert_array_equal(student_kernel, teacher_kernel)
    tokens = np.random.RandomState(4).randint(0, VOCAB, (2, T)).astype("int32")
    _, state = _step_logits(student, tokens)
    floats = {keras.backend.standardize_dtype(s.dtype) for s in state}
    assert floats == {"float32", "int32"}  # S, z, the window ring: float32; the position: int32


def test_quantized_model_saves_and_loads_bit_for_bit(tmp_path):
    lm = _lm()
    lm.quantize("int8")
    tokens = np.random.RandomState(5).randint(0, VOCAB, (2, T)).astype("int32")
    path = str(tmp_path / "int8.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    assert {p.quantization_mode for p in _projections(loaded)} == {"int8"}
    np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(lm(tokens)))


def test_lora_adapters_stay_float_beside_int8_kernels():
    from keras_linattn.linearization import enable_lora

    lm = _lm()
    enable_lora(lm, rank=2, alpha=4)
    for projection in _projections(lm):  # B = 0 at init: give the adapters a term of their own
        shape = projection.lora_kernel_b.shape
        projection.lora_kernel_b.assign(0.05 * np.random.RandomState(6).standard_normal(shape).astype("float32"))
    lm.quantize("int8")
    projection = _projections(lm)[0]
    assert str(projection._kernel.dtype) == "int8" and str(projection.lora_kernel_a.dtype) == "float32"
    tokens = np.random.RandomState(7).randint(0, VOCAB, (2, T)).astype("int32")
    parallel = np.asarray(lm(tokens))
    stepped, _ = _step_logits(lm, tokens)
    float_bound = bound("float32", _verify_bounds._reduction_length(lm, T), paths=2)
    term = _verify_bounds.quantized_term(float_bound, *_verify_bounds.quantized_reduction(lm))
    assert np.abs(stepped - parallel).max() / np.abs(parallel).max() <= float_bound + term
