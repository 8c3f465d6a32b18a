"""The attention projections at one token (`step_call`, `project_step`): the same values as the layer's einsum."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import _compat
from keras_linattn.layers import LinearAttention
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def _layer(**kwargs):
    layer = LinearAttention(num_heads=4, key_dim=6, feature_map="elu", **kwargs)
    layer.build((None, None, 16), (None, None, 16))
    rng = np.random.default_rng(3)
    for w in layer.weights:
        w.assign(rng.normal(size=w.shape).astype(w.dtype))
    return layer


def _through_the_layer(dense, x):
    return tf.squeeze(dense(tf.expand_dims(x, 1)), 1)


def _values_and_gradients(fn, dense, x, up):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(dense, x)
        loss = tf.reduce_sum(tf.cast(y, "float32") * up)
    return [y] + tape.gradient(loss, [x] + dense.trainable_weights)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("which", ["query_dense", "value_dense", "output_dense"])
def test_step_call_matches_the_layer_values_and_gradients(which, use_bias):
    layer = _layer(use_bias=use_bias)
    dense = getattr(layer, which)
    rng = np.random.default_rng(0)
    shape = (3, 4, 6) if which == "output_dense" else (3, 16)
    x = tf.constant(rng.normal(size=shape).astype("float32"))
    out_shape = (3, 16) if which == "output_dense" else (3, 4, 6)
    up = tf.constant(rng.normal(size=out_shape).astype("float32"))
    traced = tf.function(lambda d, a: d.step_call(a))
    fast = _values_and_gradients(traced, dense, x, up)
    plain = _values_and_gradients(_through_the_layer, dense, x, up)
    assert len(fast) == len(plain) == 2 + (2 if use_bias else 1)
    for i, (a, b) in enumerate(zip(fast, plain, strict=True)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert_close(a.numpy(), b.numpy(), n=24, what=f"{which} output/gradient {i}")
    graph = traced.get_concrete_function(dense, tf.TensorSpec((None,) + shape[1:])).graph
    assert not [op for op in graph.get_operations() if op.type in ("Einsum", "ExpandDims", "Squeeze")]


def test_step_call_reads_lora_adapters():
    layer = _layer()
    dense = layer.query_dense
    dense.enable_lora(2)
    dense.lora_kernel_b.assign(np.random.default_rng(1).normal(size=dense.lora_kernel_b.shape).astype("float32"))
    x = tf.constant(np.random.default_rng(2).normal(size=(2, 16)).astype("float32"))
    want = _through_the_layer(dense, x)
    assert_close(dense.step_call(x).numpy(), want.numpy(), n=24)
    without = tf.einsum("bd,dhk->bhk", x, _compat.unmerged_kernel(dense)) + dense.bias
    assert np.abs(want.numpy() - without.numpy()).max() > 1e-3  # the adapters change the output


def test_step_call_under_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer = _layer()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = tf.constant(np.random.default_rng(4).normal(size=(2, 16)).astype("float32"))
    got, want = layer.query_dense.step_call(x), _through_the_layer(layer.query_dense, x)
    assert got.dtype == want.dtype == tf.float16
    assert_close(got.numpy().astype("float32"), want.numpy().astype("float32"), n=24, dtype="float16")


def test_step_call_goes_through_the_layer_with_an_activation():
    layer = _layer()
    dense = layer.value_dense
    x = tf.constant(np.random.default_rng(5).normal(size=(2, 16)).astype("float32"))
    dense.activation = keras.activations.relu
    got = dense.step_call(x).numpy()
    np.testing.assert_array_equal(got, _through_the_layer(dense, x).numpy())
    assert (got >= 0).all() and (got == 0).any()  # the activation was applied


def test_a_projection_without_step_call_is_called_on_one_token():
    from keras_linattn.layers._attention_base import _project_token

    dense = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 4, 6), bias_axes="de")
    x = tf.constant(np.random.default_rng(7).normal(size=(2, 16)).astype("float32"))
    got = _project_token(dense, x)
    assert got.shape == (2, 4, 6)
    np.testing.assert_array_equal(got.numpy(), _through_the_layer(dense, x).numpy())


def test_project_step_matches_project_with_grouped_heads():
    layer = LinearAttention(num_heads=4, key_dim=6, feature_map="elu", num_key_value_heads=2)
    layer.build((None, None, 16), (None, None, 16))
    rng = np.random.default_rng(6)
    q, v, k = (tf.constant(rng.normal(size=(3, 16)).astype("float32")) for _ in range(3))
    fast = layer.project_step(q, v, k)
    plain = layer.project(*(tf.expand_dims(a, 1) for a in (q, v, k)))
    for a, b in zip(fast, plain, strict=True):
        assert a.shape == (3, 4, 6)
        assert_close(a.numpy(), b.numpy()[:, 0], n=16)
