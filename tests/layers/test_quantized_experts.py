"""MixtureOfExperts under `quantize("int8")`: int8 expert kernels with per-channel scales, a float router, both
forms within the quantization error model of the float layer, the int8 product's gradient, the modes it refuses.

Bound (docs/dev/testing.md, "The quantization error model"): a product ``x W`` against its int8 form differs
by at most ``sum_j |x_j| dw_i / 2 + |W_ji| dx / 2 + dx dw_i / 4`` per output i (half a step per weight and per
input element, summed over the reduction; ``dw_i = max_j |W_ji| / 127``, ``dx = max_j |x_j| / 127``). Here it is
carried through the expert: the gate's error through silu (slope at most 1.1), the product ``g * u``
(``|g| du + |u| dg + dg du``), the down projection (the error of its inputs times ``|W_down|``, plus the
rounding of the perturbed inputs), the routing weights (the router is float: the same routing on both sides)
and the shared expert's sigmoid gate (slope at most 1/4). It is a worst case, not a random walk; the float
rounding of the dequantizing ops adds the float model's bound.
"""

import random

import keras
import numpy as np
import pytest

from keras_linattn.layers import MixtureOfExperts, _quantized_experts
from tests.tolerance import bound

pytestmark = pytest.mark.numeric

DIM, EXPERTS, TOP_K, INTER, SHARED, B, T = 16, 4, 2, 24, 20, 3, 7
SILU_SLOPE = 1.1  # max over x of |d/dx x sigmoid(x)| = 1.0998...
SIGMOID_SLOPE = 0.25


def _seed(seed=0):
    keras.utils.set_random_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _step(values, axis):
    """The abs-max int8 step of `values` over `axis` (Keras' `AbsMaxQuantizer`: ``(max|x| + eps) / 127``)."""
    return (np.abs(values).max(axis=axis) + keras.backend.epsilon()) / 127.0


def _product(x, kernel):
    """``(x @ kernel, the int8 product's error bound)`` for one row ``x [K]`` and ``kernel [K, N]`` in float64."""
    dw, dx = _step(kernel, 0), _step(x, 0)  # [N], scalar
    limit = np.abs(x).sum() * dw / 2 + dx * np.abs(kernel).sum(0) / 2 + len(x) * dx * dw / 4
    return x @ kernel, limit


def _down(m, dm, kernel):
    """``(m @ kernel, bound)`` when ``m`` carries an error up to ``dm`` before its int8 product."""
    y, _ = _product(m, kernel)
    _, rounding = _product(np.abs(m) + dm, kernel)  # the rounding of the perturbed inputs
    return y, dm @ np.abs(kernel) + rounding


def _gated(h, w_gate, w_up, w_down):
    """One gated expert ``(silu(h Wg) * (h Wu)) Wd`` on a row and its int8 error bound."""
    a, da = _product(h, w_gate)
    u, du = _product(h, w_up)
    g, dg = _silu(a), SILU_SLOPE * da
    return _down(g * u, np.abs(g) * du + np.abs(u) * dg + dg * du, w_down)


def _oracle_and_bound(moe, weights, x):
    """The float layer in float64 per token, and the int8 layer's error bound against it; both ``[..., dim]``."""
    flat = np.asarray(x, np.float64).reshape(-1, DIM)
    out, limit = np.zeros_like(flat), np.zeros_like(flat)
    for n, h in enumerate(flat):
        logits = h @ weights["router_kernel"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        picked = np.argsort(-p)[: moe.top_k]
        routing = p[picked] / (p[picked].sum() if moe.normalize_top_k else 1.0)
        for e, r in zip(picked, routing, strict=True):
            y, dy = _gated(h, *(weights[f"expert_{k}_kernel"][e] for k in ("gate", "up", "down")))
            out[n] += r * y
            limit[n] += r * dy
        if moe.shared_expert_dim is not None:
            y, dy = _gated(h, *(weights[f"shared_expert_{k}_kernel"] for k in ("gate", "up", "down")))
            s, ds = _product(h, weights["shared_expert_weight_kernel"])
            gate, dgate = 1.0 / (1.0 + np.exp(-s)), SIGMOID_SLOPE * ds
            out[n] += y * gate
            limit[n] += np.abs(y) * dgate + dy * gate + dy * dgate
    return out.reshape(np.shape(x)), limit.reshape(np.shape(x))


def _layer(shared):
    _seed()
    layer = MixtureOfExperts(EXPERTS, TOP_K, INTER, normalize_top_k=shared is None, shared_expert_dim=shared)
    layer.build((None, None, DIM))
    rng = np.random.default_rng(0)
    for v in layer.weights:  # a router with spread logits: the top-k choice differs across tokens
        v.assign(rng.normal(0.0, 1.0 if "router" in v.name else 0.2, tuple(v.shape)).astype("float32"))
    return layer


@pytest.fixture(scope="module", params=[None, SHARED], ids=["mixtral", "qwen_moe"])
def quantized(request):
    """``(float weights in float64 by name, the int8 layer)``."""
    layer = _layer(request.param)
    weights = {v.name: np.asarray(v, np.float64) for v in layer.weights}
    layer.quantize("int8")
    return weights, layer


def test_every_expert_kernel_is_int8_with_a_scale_per_expert_and_channel_and_the_router_stays_float(quantized):
    weights, moe = quantized
    assert moe.quantization_mode == "int8"
    by_name = {v.name: v for v in moe.weights}
    for _, name, axis in _quantized_experts.kernels(moe):
        kernel, scale = by_name[name], by_name[f"{name}_scale"]
        assert str(kernel.dtype) == "int8" and not kernel.trainable
        float_kernel = weights[name]
        assert tuple(scale.shape) == tuple(np.delete(float_kernel.shape, axis))
        # Keras' abs-max scheme: every channel's largest weight at +-127, each weight within half a step.
        dequantized = np.asarray(kernel, np.float64) / np.expand_dims(np.asarray(scale, np.float64), axis)
        assert np.abs(np.asarray(kernel)).max(axis=axis).min() == 127
        assert (np.abs(dequantized - float_kernel) <= 0.5 * np.expand_dims(_step(float_kernel, axis), axis)).all()
    assert str(by_name["router_kernel"].dtype) == "float32" and by_name["router_kernel"].trainable
    np.testing.assert_array_equal(np.asarray(by_name["router_kernel"]), weights["router_kernel"].astype("float32"))


def test_both_forms_are_within_the_quantization_error_model_of_the_float_layer(quantized):
    weights, moe = quantized
    x = np.random.default_rng(1).normal(size=(B, T, DIM)).astype("float32")
    want, limit = _oracle_and_bound(moe, weights, x)
    # The float part: the dequantizing ops of top_k + 1 gated paths of two products each, as the float layer's test.
    float_part = bound("float32", max(DIM, INTER), paths=2 * (TOP_K + 1)) * np.abs(want).max()
    assert limit.max() < 0.5 * np.abs(want).max()  # the bound is a test: far below the outputs' scale
    got = np.asarray(moe(x), np.float64)
    assert (np.abs(got - want) <= limit + float_part).all(), np.abs(got - want).max()
    for t in range(T):  # the one-token form: the picked experts' int8 kernels and scales, gathered
        step = np.asarray(moe(x[:, t], step=True), np.float64)
        assert (np.abs(step - want[:, t]) <= limit[:, t] + float_part).all(), t
    picked = np.argsort(-(x.reshape(-1, DIM) @ weights["router_kernel"]), axis=-1)[:, :TOP_K]
    assert len({tuple(sorted(row)) for row in picked}) > 1  # the routing is exercised, not one expert pair


# The sequence form's broadcast (x [N, K] against every expert's kernel) and the step's (x [B, 1, 1, K] against
# the k gathered kernels): both broadcast over 3.
@pytest.mark.parametrize("x_shape, kernel_shape", [((5, 6), (3, 6, 4)), ((2, 1, 1, 6), (2, 3, 6, 4))])
def test_the_int8_product_gradient_is_that_of_the_dequantized_kernel(x_shape, kernel_shape):
    """Keras' int8 layers' custom gradient, summed over the axes along which `x` is broadcast."""
    import tensorflow as tf

    moe = _layer(None)
    moe.quantize("int8")
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=x_shape).astype("float32"))
    kernel = rng.integers(-127, 128, kernel_shape).astype("int8")
    scale = rng.uniform(50.0, 100.0, kernel_shape[:-2] + kernel_shape[-1:]).astype("float32")
    upstream = rng.normal(size=np.broadcast_shapes(x_shape[:-2], kernel_shape[:-2]) + (x_shape[-2], kernel_shape[-1]))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = _quantized_experts.int8_matmul(moe, x, kernel, scale)
        loss = tf.reduce_sum(y * tf.constant(upstream.astype("float32")))
    grad = np.asarray(tape.gradient(loss, x), np.float64)
    float_kernel = kernel.astype(np.float64) / np.expand_dims(scale.astype(np.float64), -2)
    want = np.matmul(upstream, np.swapaxes(float_kernel, -1, -2))  # broadcast shape
    want = want.sum(axis=tuple(range(want.ndim - len(x_shape)))) if want.ndim > len(x_shape) else want
    axes = tuple(i for i, (w, d) in enumerate(zip(want.shape, x_shape, strict=True)) if d == 1 and w != 1)
    want = want.sum(axis=axes, keepdims=True) if axes else want
    assert grad.shape == x_shape
    n = kernel_shape[-1] + 3  # the product over N, then the sum over the 3 broadcast copies
    np.testing.assert_allclose(grad, want, rtol=0, atol=bound("float32", n) * np.abs(want).max())


def test_modes_other_than_int8_leave_the_experts_float_and_name_the_mode():
    moe = _layer(SHARED)
    with pytest.raises(NotImplementedError, match="'int8' only.*Received: mode='int4'"):
        moe.quantize("int4")
    assert moe.quantization_mode is None
    assert {str(v.dtype) for v in moe.weights} == {"float32"}


def test_a_weight_only_quantization_config_survives_get_config_and_from_config():
    """`Int8QuantizationConfig(activation_quantizer=None)` (float inputs) is kept by the config, as `Dense` keeps it."""
    moe = _layer(SHARED)
    moe.quantize("int8", config=keras.quantizers.Int8QuantizationConfig(activation_quantizer=None))
    assert moe.inputs_quantizer is None
    clone = MixtureOfExperts.from_config(moe.get_config())
    clone.build((None, None, DIM))
    for target, source in zip(clone.weights, moe.weights, strict=True):
        target.assign(source)
    assert clone.quantization_mode == "int8" and clone.inputs_quantizer is None
    x = np.random.default_rng(3).normal(size=(B, T, DIM)).astype("float32")
    np.testing.assert_array_equal(np.asarray(clone(x)), np.asarray(moe(x)))
