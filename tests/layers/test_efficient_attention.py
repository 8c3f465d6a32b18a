"""EfficientAttention against a left-to-right float64 reference: outputs and gradients."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import ops as lops
from keras_linattn.layers import EfficientAttention
from tests.conftest import rel_err
from tests.tolerance import assert_close, bound

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def reduction_length(layer, s, input_dim):
    """Reduction length of the layer over ``s`` keys: the key projection over
    ``input_dim``, then without a projection the softmax over the S keys and
    the context over the S keys, with one the E K product over S, the softmax
    and the context over the K projected keys; then the queries' product with
    the context over D and the output projection over H*M."""
    if layer.projection is None:
        attention = 2 * s
    else:
        attention = s + 2 * layer.projection_dim
    return input_dim + attention + layer.key_dim + layer.num_heads * layer.value_dim


def _dense(x, kernel, bias, equation):
    y = tf.einsum(equation, x, tf.cast(kernel, tf.float64))
    return y if bias is None else y + tf.cast(bias, tf.float64)


def reference(layer, query, value, key=None, key_mask=None):
    """The layer in float64: its projections, then `ops.efficient_attention_reference`.

    The reference forms the T x S matrix ``softmax_f(Q) softmax_seq(K)^T`` over
    the unmasked keys (or the T x k matrix ``softmax_f(Q) softmax_k(E K)^T``)
    left to right. Differentiable (tf ops) for the gradient checks.
    """
    key = value if key is None else key
    q = _dense(tf.cast(query, tf.float64), layer.query_dense.kernel, layer.query_dense.bias, "btd,dhk->bthk")
    k = _dense(tf.cast(key, tf.float64), layer.key_dense.kernel, layer.key_dense.bias, "btd,dhk->bthk")
    v = _dense(tf.cast(value, tf.float64), layer.value_dense.kernel, layer.value_dense.bias, "btd,dhk->bthk")
    projections = {}
    if layer.projection is not None:
        projections = dict(projection_key=layer.projection_key, projection_value=layer.projection_value)
    attended = lops.efficient_attention_reference(q, k, v, key_mask=key_mask, **projections)  # [B, T, H, M]
    return _dense(attended, layer.output_dense.kernel, layer.output_dense.bias, "bthk,hkd->btd")


def _make(projection, rng, t=7, s=11, dim=12, use_mask=True, **kwargs):
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("key_dim", 5)
    kwargs.setdefault("value_dim", 3)
    if projection is not None:
        kwargs.setdefault("projection_dim", 4)
        kwargs.setdefault("max_length", 16)
    layer = EfficientAttention(projection=projection, seed=3, bias_initializer="glorot_uniform", **kwargs)
    query = rng.normal(size=(3, t, dim)).astype("float32")
    value = rng.normal(size=(3, s, dim)).astype("float32")
    key = rng.normal(size=(3, s, dim)).astype("float32") * 2.0
    mask = None
    if use_mask:
        mask = np.ones((3, s), "float32")
        mask[0, 6:] = 0.0
        mask[1, ::3] = 0.0
    return layer, query, value, key, mask


@pytest.mark.parametrize("projection", [None, "random", "learned"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_outputs_and_gradients_match_reference(projection, use_mask, rng):
    layer, query, value, key, mask = _make(projection, rng, use_mask=use_mask)
    q, v, k = tf.constant(query), tf.constant(value), tf.constant(key)
    layer(q, v, key=k, key_mask=mask)  # build
    cot = tf.constant(rng.normal(size=(3, 7, 12)))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([q, v, k])
        out = layer(q, v, key=k, key_mask=mask)
        ref = reference(layer, q, v, key=k, key_mask=mask)
        loss = tf.reduce_sum(tf.cast(out, tf.float64) * cot)
        loss_ref = tf.reduce_sum(ref * cot)
    b, t, dim = query.shape
    s = key.shape[1]
    n = reduction_length(layer, s, dim)  # see `reduction_length`; float64 reference
    assert_close(out, ref, n=n, what="outputs")
    sources = [q, v, k] + list(layer.trainable_variables)
    if projection == "learned":
        names = [w.name for w in layer.trainable_variables]
        assert "projection_key" in names and "projection_value" in names
    grads = tape.gradient(loss, sources)
    grads_ref = tape.gradient(loss_ref, sources)
    # A weight's gradient also sums over the B*S key positions that share it (B*T for queries).
    n_grad = n + b * max(s, t)
    flat = np.concatenate([np.ravel(g) for g in grads])
    flat_ref = np.concatenate([np.ravel(gr) for gr in grads_ref])
    assert_close(flat, flat_ref, n=n_grad, what="all gradients")
    # Per source, conditioned by the ratio of the whole gradient's scale to the
    # source's: its absolute error is inherited from the whole backward pass.
    whole = float(np.abs(flat_ref).max())
    for g, gr, src in zip(grads, grads_ref, sources, strict=True):
        name = getattr(src, "name", "input")
        assert g is not None, name
        if projection is None and src is layer.key_dense.bias:
            # Its exact gradient is 0 (softmax over the sequence is
            # shift-invariant): what is left is the rounding of the whole pass.
            assert float(np.abs(np.asarray(g)).max()) <= bound(n=n_grad) * whole, name
            continue
        assert_close(g, gr, n=n_grad, conditioning=whole / float(np.abs(gr).max()), what=name)


@pytest.mark.parametrize("projection", [None, "random"])
def test_right_padding_with_mask_equals_unpadded(projection, rng):
    layer, query, value, _, _ = _make(projection, rng, s=9, use_mask=False)
    padded = np.concatenate([value, rng.normal(size=(3, 4, 12)).astype("float32") * 50], axis=1)
    mask = np.concatenate([np.ones((3, 9)), np.zeros((3, 4))], axis=1)
    short = layer(query, value)
    full = layer(query, padded, key_mask=mask)
    # over the 13 keys of the padded call; two float32 computations
    assert_close(full, short, n=reduction_length(layer, padded.shape[1], 12), paths=2)


def test_keras_mask_from_embedding_is_used(rng):
    tokens = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    emb = keras.layers.Embedding(8, 6, mask_zero=True)
    layer = EfficientAttention(num_heads=2, key_dim=3)
    x = emb(tokens)
    out = layer(x, x)
    explicit = layer(x, x, key_mask=tokens != 0)
    unmasked = layer(x, x, key_mask=np.ones_like(tokens))
    assert_close(out, explicit, n=reduction_length(layer, 5, 6), paths=2)  # 5 keys, 6 input dims
    # Not rounding: attending to 2 more keys changes row 0 by O(1).
    assert rel_err(out[0], unmasked[0]) > 1e-3


@pytest.mark.parametrize("projection", [None, "random"])
def test_all_keys_masked_gives_zero_attention_not_nan(projection, rng):
    layer, query, value, _, _ = _make(projection, rng, use_mask=False, use_bias=False)
    mask = np.ones((3, 11), "float32")
    mask[2] = 0.0
    q, v = tf.constant(query), tf.constant(value)
    with tf.GradientTape() as tape:
        tape.watch(v)
        out = layer(q, v, key_mask=mask)
        total = tf.reduce_sum(out)
    grad = tape.gradient(total, v)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)


def test_random_projection_is_delta_scaled_fixed_gaussian():
    kwargs = dict(num_heads=1, key_dim=4, projection="random", projection_dim=64, max_length=200, delta=0.5, seed=7)
    layer = EfficientAttention(**kwargs)
    layer(np.zeros((1, 5, 8), "float32"), np.zeros((1, 5, 8), "float32"))
    e = np.asarray(layer.projection_key)
    f = np.asarray(layer.projection_value)
    assert e.shape == f.shape == (64, 200)
    r = e / 0.5  # exact: a power of 2
    # one float32 rounding of a float64 product, elementwise: n = 1
    assert_close(f, np.exp(-0.5) * r.astype("float64"), n=1)
    # Statistical: r has N(0, 1/K) entries; 5 standard errors of the sample sd
    # (relative SE 1/sqrt(2N)) and of the sample mean (sd/sqrt(N)) over N = K*max_length draws.
    assert abs(r.std() * np.sqrt(64) - 1.0) < 5 / np.sqrt(2 * r.size)
    assert abs(r.mean()) < 5 / np.sqrt(64) / np.sqrt(r.size)
    assert layer.trainable_variables and all(
        w.name not in ("projection_key", "projection_value") for w in layer.trainable_variables
    )
    assert {w.name for w in layer.non_trainable_variables} == {"projection_key", "projection_value"}
    again = EfficientAttention(**kwargs)
    again(np.zeros((1, 5, 8), "float32"), np.zeros((1, 5, 8), "float32"))
    np.testing.assert_array_equal(np.asarray(again.projection_key), e)
    other = EfficientAttention(**dict(kwargs, seed=8))
    other(np.zeros((1, 5, 8), "float32"), np.zeros((1, 5, 8), "float32"))
    assert not np.allclose(np.asarray(other.projection_key), e)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(projection="linformer", projection_dim=4, max_length=8), "projection"),
        (dict(projection="random", projection_dim=0, max_length=8), "projection_dim"),
        (dict(projection="random", projection_dim=-2, max_length=8), "projection_dim"),
        (dict(projection="learned", projection_dim=4, max_length=0), "max_length"),
        (dict(projection="random", max_length=8), "projection_dim"),
        (dict(projection=None, projection_dim=4), "projection_dim"),
        (dict(num_heads=0), "num_heads"),
        (dict(dropout=1.0), "dropout"),
        (dict(delta=float("nan")), "delta"),
        (dict(output_shape=(3, 4)), "output_shape"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    kwargs = {"num_heads": 2, "key_dim": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        EfficientAttention(**kwargs)


def test_bad_call_arguments():
    layer = EfficientAttention(num_heads=2, key_dim=4, projection="random", projection_dim=3, max_length=6)
    x = np.zeros((2, 5, 8), "float32")
    with pytest.raises(ValueError, match="use_causal_mask"):
        layer(x, x, use_causal_mask=True)
    with pytest.raises(ValueError, match="query"):
        layer(np.zeros((2, 8), "float32"), x)
    with pytest.raises(ValueError, match="value"):
        layer(x, np.zeros((2, 5, 8, 1), "float32"))
    with pytest.raises(ValueError, match="max_length"):
        layer(x, np.zeros((2, 7, 8), "float32"))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, x, attention_mask=np.ones((2, 5, 5)))
    layer(x, x)  # builds
    with pytest.raises(ValueError, match="query"):
        layer(np.zeros((2, 8), "float32"), x)
    with pytest.raises(ValueError, match="key"):
        layer(x, x, key=np.zeros((2, 5), "float32"))
    with pytest.raises(ValueError, match="max_length"):
        layer(x, np.zeros((2, 7, 8), "float32"))


def test_save_load_keras_roundtrip(tmp_path, rng):
    inp = keras.Input((10, 12))
    layer = EfficientAttention(
        num_heads=3,
        key_dim=4,
        value_dim=5,
        projection="learned",
        projection_dim=6,
        max_length=10,
        delta=0.3,
        dropout=0.1,
        use_bias=False,
        output_shape=7,
        kernel_initializer="he_normal",
        seed=11,
    )
    out = layer(inp, inp)
    model = keras.Model(inp, out)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    x = rng.normal(size=(2, 10, 12)).astype("float32")
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(loaded(x)))
    config = loaded.layers[-1].get_config()
    for name, val in dict(
        projection="learned", projection_dim=6, max_length=10, delta=0.3, value_dim=5, use_bias=False, output_shape=7
    ).items():
        assert config[name] == val
    assert not np.allclose(np.asarray(model(x)), 0.0)


def test_fit_with_jit_compile(rng):
    x = rng.normal(size=(32, 8, 6)).astype("float32")
    y = np.cumsum(x, axis=1)[:, -1:, :].repeat(8, axis=1) / 8.0  # needs mixing across time
    inp = keras.Input((8, 6))
    out = EfficientAttention(num_heads=2, key_dim=4, projection="learned", projection_dim=4, max_length=8, seed=0)(
        inp, inp
    )
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    before = model.evaluate(x, y, verbose=0)
    e0 = np.asarray(model.layers[-1].projection_key).copy()
    model.fit(x, y, epochs=15, batch_size=16, verbose=0)
    after = model.evaluate(x, y, verbose=0)
    # Learning criterion (fixed seed): 15 epochs remove at least 20% of the initial loss.
    assert np.isfinite(after) and after < 0.8 * before
    assert not np.allclose(np.asarray(model.layers[-1].projection_key), e0)


def test_mixed_precision_matches_float32(rng):
    layer32, query, value, key, mask = _make("random", rng)
    out32 = layer32(query, value, key=key, key_mask=mask)
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer16 = EfficientAttention.from_config(layer32.get_config() | {"dtype": "mixed_bfloat16"})
    layer16(query, value, key=key, key_mask=mask)
    layer16.set_weights(layer32.get_weights())
    out16 = layer16(query, value, key=key, key_mask=mask)
    assert out16.dtype == "bfloat16"
    # The projections round in bfloat16: the input projection over D_in and the
    # output projection over H*M; the attention runs in float32 (`ops.efficient_attention`),
    # and so does the whole float32 layer, the reference (2^16 times smaller errors).
    n = query.shape[-1] + layer32.num_heads * layer32.value_dim
    assert_close(out16, out32, n=n, dtype="mixed_bfloat16")


@pytest.mark.parametrize("projection", [None, "random"])
def test_saved_model_and_onnx_export_with_dynamic_length(projection, tmp_path, rng):
    import onnxruntime as ort

    kwargs = {} if projection is None else dict(projection=projection, projection_dim=4, max_length=32)
    inp = keras.Input((None, 16))
    out = EfficientAttention(2, 4, seed=0, **kwargs)(inp, inp)
    model = keras.Model(inp, out)
    inputs = [rng.normal(size=(2, 20, 16)).astype("float32"), rng.normal(size=(1, 9, 16)).astype("float32")]
    path = os.path.join(tmp_path, "saved_model")
    model.export(path, format="tf_saved_model", verbose=False)
    restored = tf.saved_model.load(path)
    layer = model.layers[-1]
    # over each input's own S keys; export vs Keras, two float32 computations
    for x in inputs:
        n = reduction_length(layer, x.shape[1], 16)
        assert_close(restored.serve(x), model(x), n=n, paths=2, what="saved model")
    onnx_path = os.path.join(tmp_path, "model.onnx")
    model.export(onnx_path, format="onnx", verbose=False, opset_version=17)
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for x in inputs:
        n = reduction_length(layer, x.shape[1], 16)
        assert_close(session.run(None, {name: x})[0], model(x), n=n, paths=2, what="onnx")
