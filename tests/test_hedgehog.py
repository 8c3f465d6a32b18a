"""Hedgehog trainable feature map: definition, stability, layer integration, training, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.feature_maps import HedgehogFeatureMap
from keras_linattn.layers import LinearAttention
from tests.conftest import rel_err


def _np_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _np_hedgehog(x, kernel, bias):
    """[softmax(xW + b), softmax(-(xW + b))] in float64 NumPy; x [B,T,H,D], kernel [H,D,F]."""
    logits = np.einsum("bthd,hdf->bthf", x.astype("float64"), kernel.astype("float64"))  # [B, T, H, F]
    if bias is not None:
        logits = logits + bias
    return np.concatenate([_np_softmax(logits), _np_softmax(-logits)], axis=-1)


def test_identity_initialization_and_definition(rng):
    x = rng.normal(size=(2, 5, 3, 8)).astype("float32")
    fm = HedgehogFeatureMap()
    f = np.asarray(fm(x, is_query=False))
    assert fm.feature_dim(8) == 16
    for w in fm.trainable_weights:
        if "kernel" in w.path:
            np.testing.assert_array_equal(w.numpy(), np.broadcast_to(np.eye(8), (3, 8, 8)))
        else:
            np.testing.assert_array_equal(w.numpy(), np.zeros((3, 8)))
    # at init, phi(x) = [softmax(x), softmax(-x)]
    expected = np.concatenate([_np_softmax(x.astype("float64")), _np_softmax(-x.astype("float64"))], -1)
    np.testing.assert_allclose(f, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("share_qk", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_numpy_with_trained_weights(rng, share_qk, use_bias):
    x = rng.normal(size=(2, 4, 3, 8)).astype("float32")
    fm = HedgehogFeatureMap(feature_size=5, share_qk=share_qk, use_bias=use_bias)
    fm.build(x.shape)
    assert fm.feature_dim(8) == 10
    assert len(fm.trainable_weights) == (1 if share_qk else 2) * (2 if use_bias else 1)
    # a rectangular identity per head
    np.testing.assert_array_equal(fm.trainable_weights[0].numpy()[1], np.eye(8, 5))
    for w in fm.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    prefix = "" if share_qk else "query_"
    for is_query in (True, False):
        if not share_qk:
            prefix = "query_" if is_query else "key_"
        kernel = fm._kernels[prefix + "kernel"].numpy()
        bias = fm._biases[prefix + "kernel"].numpy() if use_bias else None
        got = np.asarray(fm(x, is_query=is_query))
        np.testing.assert_allclose(got, _np_hedgehog(x, kernel, bias), rtol=1e-5, atol=1e-7)
    q_features = np.asarray(fm(x, is_query=True))
    k_features = np.asarray(fm(x, is_query=False))
    if share_qk:
        np.testing.assert_array_equal(q_features, k_features)
    else:
        assert not np.allclose(q_features, k_features)


def test_separate_kernels_are_independent(rng):
    x = rng.normal(size=(1, 4, 2, 6)).astype("float32")
    fm = HedgehogFeatureMap()
    before = np.asarray(fm(x, is_query=True))
    fm._kernels["key_kernel"].assign(rng.normal(size=(2, 6, 6)).astype("float32"))
    np.testing.assert_array_equal(np.asarray(fm(x, is_query=True)), before)
    assert not np.allclose(np.asarray(fm(x, is_query=False)), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_positive_finite_and_normalized_for_large_inputs(rng, dtype):
    x = rng.uniform(-10, 10, size=(2, 7, 2, 8))
    x[0, 0] = 1e4
    if dtype == "bfloat16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    fm = HedgehogFeatureMap()
    f = fm(keras.ops.convert_to_tensor(x, dtype=dtype), is_query=False)
    assert f.dtype == "float32"
    f = np.asarray(f)
    assert np.isfinite(f).all()
    assert (f >= 0).all()
    np.testing.assert_allclose(f[..., :8].sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(f[..., 8:].sum(-1), 1.0, rtol=1e-5)


def _oracle_forward(layer, x, causal):
    q, k, v = layer.project(x, x)
    qf = layer.feature_map(q, is_query=True, causal=causal)
    kf = layer.feature_map(k, is_query=False, causal=causal)
    return layer.output_dense(lops.kernel_attention_reference(qf, kf, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("share_qk", [False, True])
def test_layer_matches_oracle_outputs_and_gradients(rng, causal, share_qk):
    x = tf.constant(rng.normal(size=(2, 21, 8)).astype("float32"))
    fm = HedgehogFeatureMap(feature_size=6, share_qk=share_qk)
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=fm, chunk_size=8)
    layer(x, x)
    for w in fm.trainable_weights:  # move away from the identity
        w.assign(w.numpy() + 0.3 * rng.normal(size=w.shape).astype("float32"))
    weights = layer.trainable_variables
    assert len(weights) == 8 + (2 if share_qk else 4)

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = fn()
            loss = tf.reduce_sum(out * tf.cos(tf.range(out.shape[-1], dtype="float32")))
        grads = tape.gradient(loss, [x] + weights)
        return out.numpy(), np.concatenate([g.numpy().ravel() for g in grads])

    out, grads = run(lambda: layer(x, x, use_causal_mask=causal))
    ref, ref_grads = run(lambda: _oracle_forward(layer, x, causal))
    assert rel_err(out, ref) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_causal_outputs_never_see_the_future(rng):
    x = rng.normal(size=(1, 24, 8)).astype("float32")
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map="hedgehog", chunk_size=8)
    base = np.asarray(layer(x, x, use_causal_mask=True))
    for t in (0, 7, 8, 17):
        changed = x.copy()
        changed[:, t + 1 :] = rng.normal(size=changed[:, t + 1 :].shape) * 5.0
        out = np.asarray(layer(changed, changed, use_causal_mask=True))
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
        assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :])


def _tiny_model(feature_map, t=16, dim=8):
    inputs = keras.Input((t, dim))
    h = LinearAttention(num_heads=2, key_dim=4, feature_map=feature_map, chunk_size=8)(
        inputs, inputs, use_causal_mask=True
    )
    return keras.Model(inputs, keras.layers.Dense(dim)(h))


def test_fit_with_xla_trains_the_kernels(rng):
    x = rng.normal(size=(32, 16, 8)).astype("float32")
    y = np.roll(x, 1, axis=1)
    fm = HedgehogFeatureMap(feature_size=6)
    model = _tiny_model(fm)
    initial = [w.numpy().copy() for w in fm.trainable_weights]
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    losses = model.fit(x, y, batch_size=8, epochs=4, verbose=0).history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]
    for before, w in zip(initial, fm.trainable_weights):
        assert not np.allclose(before, w.numpy())


def test_keras_save_load_with_non_default_arguments(tmp_path, rng):
    x = rng.normal(size=(2, 16, 8)).astype("float32")
    fm = HedgehogFeatureMap(feature_size=6, share_qk=True, use_bias=False)
    model = _tiny_model(fm)
    for w in fm.trainable_weights:
        w.assign(w.numpy() + 0.3 * rng.normal(size=w.shape).astype("float32"))
    expected = model.predict(x, verbose=0)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded_fm = loaded.layers[1].feature_map
    assert isinstance(loaded_fm, HedgehogFeatureMap)
    assert (loaded_fm.feature_size, loaded_fm.share_qk, loaded_fm.use_bias) == (6, True, False)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)


def test_get_config_round_trip():
    fm = feature_maps.get("hedgehog", feature_size=5, share_qk=True, use_bias=False)
    clone = feature_maps.deserialize(feature_maps.serialize(fm))
    assert type(clone) is HedgehogFeatureMap
    assert clone.get_config() == fm.get_config()
    assert clone.get_config()["feature_size"] == 5


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(feature_size=0), "feature_size"),
        (dict(feature_size=-4), "feature_size"),
        (dict(feature_size=2.0), "feature_size"),
        (dict(share_qk="yes"), "share_qk"),
        (dict(use_bias=1), "use_bias"),
    ],
)
def test_bad_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        HedgehogFeatureMap(**kwargs)


def test_bad_input_rank_and_shape():
    fm = HedgehogFeatureMap()
    with pytest.raises(ValueError, match="input_shape"):
        fm(np.zeros((2, 3, 4), "float32"))
    fm(np.zeros((1, 3, 2, 4), "float32"))
    with pytest.raises(ValueError, match="inputs.shape"):
        fm(np.zeros((3, 2, 4), "float32"))
    with pytest.raises(ValueError, match="inputs.shape"):
        fm(np.zeros((1, 3, 3, 4), "float32"))
