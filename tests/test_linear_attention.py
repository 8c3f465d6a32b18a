"""LinearAttention layer: maths against the oracle, masks, state, precision, training, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention
from tests._helpers import oracle_forward, run_steps
from tests.conftest import rel_err

DIM = 16


def _layer(**kwargs):
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("key_dim", 4)
    return LinearAttention(**kwargs)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_matches_oracle_outputs_and_weight_gradients(rng, feature_map, causal):
    x = rng.normal(size=(2, 37, DIM)).astype("float32")
    mask = np.ones((2, 37), bool)
    mask[1, 30:] = False
    layer = _layer(feature_map=feature_map, chunk_size=16)
    layer(x, x)

    def grads(fn):
        with tf.GradientTape() as tape:
            out = fn()
            loss = tf.reduce_sum(out * tf.sin(tf.range(tf.size(out), dtype="float32")[: out.shape[-1]]))
        g = tape.gradient(loss, layer.trainable_variables)
        return out, np.concatenate([t.numpy().ravel() for t in g])

    out, g = grads(lambda: layer(x, x, key_mask=mask, use_causal_mask=causal))
    ref, g_ref = grads(lambda: oracle_forward(layer, x, x, causal=causal, key_mask=mask))
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(g, g_ref) <= 1e-5


def test_cross_attention_with_separate_key(rng):
    q = rng.normal(size=(2, 5, DIM)).astype("float32")
    v = rng.normal(size=(2, 11, 8)).astype("float32")
    k = rng.normal(size=(2, 11, 12)).astype("float32")
    layer = _layer(value_dim=3)
    out = layer(q, v, key=k)
    assert out.shape == (2, 5, DIM)
    assert rel_err(out, oracle_forward(layer, q, v, k)) <= 1e-5


def test_keras_padding_mask_is_used_for_keys(rng):
    tokens = np.array([[3, 4, 5, 0, 0, 0], [7, 1, 2, 9, 4, 0]])
    emb = keras.layers.Embedding(12, DIM, mask_zero=True)
    layer = _layer()
    x = emb(tokens)
    out = layer(x, x)
    mask = tokens != 0
    assert rel_err(out, oracle_forward(layer, x, x, key_mask=mask)) <= 1e-5
    # Changing the embeddings at padded positions does not change real positions.
    x2 = np.array(x)
    x2[tokens == 0] = 100.0
    out2 = layer(x2, x2, key_mask=mask)
    np.testing.assert_allclose(np.asarray(out)[mask], np.asarray(out2)[mask], rtol=1e-6, atol=1e-6)
    # The query mask propagates to the output.
    inp = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(12, DIM, mask_zero=True)(inp)
    y = _layer()(h, h)
    assert y._keras_mask is not None


def test_attention_mask_is_rejected_with_explanation(rng):
    x = rng.normal(size=(1, 4, DIM)).astype("float32")
    with pytest.raises(ValueError, match="attention_mask.*key_mask"):
        _layer()(x, x, attention_mask=np.ones((1, 4, 4), bool))


def test_causal_layer_never_sees_the_future(rng):
    x = rng.normal(size=(2, 50, DIM)).astype("float32")
    layer = _layer(chunk_size=16)
    base = np.asarray(layer(x, x, use_causal_mask=True))
    x2 = x.copy()
    x2[:, 20:] = rng.normal(size=(2, 30, DIM)) * 5
    out = np.asarray(layer(x2, x2, use_causal_mask=True))
    np.testing.assert_array_equal(out[:, :20], base[:, :20])


def test_split_sequence_with_state_equals_one_pass(rng):
    x = rng.normal(size=(2, 40, DIM)).astype("float32")
    layer = _layer(chunk_size=16)
    full = layer(x, x, use_causal_mask=True)
    a, state = layer(x[:, :17], x[:, :17], use_causal_mask=True, return_state=True)
    b, _ = layer(x[:, 17:], x[:, 17:], use_causal_mask=True, initial_state=state, return_state=True)
    assert rel_err(np.concatenate([a, b], axis=1), full) <= 1e-5


def test_step_equals_parallel(rng):
    x = rng.normal(size=(2, 9, DIM)).astype("float32")
    layer = _layer(feature_map="taylor")
    full = np.asarray(layer(x, x, use_causal_mask=True))
    stepped, _ = run_steps(layer, x, self_attention=True)
    assert rel_err(stepped, full) <= 1e-5


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_precision_at_4096_is_close_to_float32(rng, policy, causal):
    x = rng.normal(size=(1, 4096, 64)).astype("float32")
    ref_layer = LinearAttention(num_heads=4, key_dim=16)
    ref = np.asarray(ref_layer(x, x, use_causal_mask=causal))
    keras.config.set_dtype_policy(policy)
    layer = LinearAttention(num_heads=4, key_dim=16)
    layer(x[:, :2], x[:, :2])
    layer.set_weights(ref_layer.get_weights())
    out = layer(x, x, use_causal_mask=causal)
    assert out.dtype == policy.split("_")[1]
    out = np.asarray(tf.cast(out, "float32"))
    assert np.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2


def _tiny_model(causal, feature_map="elu"):
    inp = keras.Input((24,), dtype="int32")
    h = keras.layers.Embedding(20, DIM, mask_zero=True)(inp)
    h = h + LinearAttention(2, 8, feature_map=feature_map, chunk_size=8)(h, h, use_causal_mask=causal)
    if causal:
        out = keras.layers.Dense(20)(h)
    else:
        out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


@pytest.mark.parametrize("causal", [False, True])
def test_fit_with_xla(rng, causal):
    x = rng.integers(1, 20, size=(64, 24))
    y = x if causal else (x[:, 0] > 10).astype("int32")
    model = _tiny_model(causal)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    hist = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = hist.history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]


def test_keras_save_load_with_non_default_arguments(rng, tmp_path):
    inp = keras.Input((None, DIM))
    layer = LinearAttention(
        num_heads=3, key_dim=5, value_dim=6, feature_map=feature_maps.get("relu", epsilon=1e-3),
        chunk_size=7, dropout=0.1, use_bias=False, output_shape=9, epsilon=1e-5,
        kernel_initializer="he_normal", kernel_regularizer="l2", seed=3,
    )
    model = keras.Model(inp, layer(inp, inp, use_causal_mask=True))
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    x = rng.normal(size=(2, 19, DIM)).astype("float32")
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(loaded(x)))
    lcfg = loaded.layers[-1].get_config()
    for key in ("num_heads", "key_dim", "value_dim", "chunk_size", "dropout", "use_bias", "output_shape", "epsilon", "seed"):
        assert lcfg[key] == layer.get_config()[key]
    assert loaded.layers[-1].feature_map.epsilon == 1e-3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=0), "num_heads"),
        (dict(key_dim=-1), "key_dim"),
        (dict(value_dim=0), "value_dim"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(feature_map="softmaxx"), "softmaxx"),
        (dict(feature_map=3), "feature_map"),
        (dict(dropout=1.5), "dropout"),
        (dict(output_shape=(3, 4)), "output_shape"),
        (dict(epsilon=-1.0), "epsilon"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _layer(**kwargs)


def test_call_rejects_bad_shapes(rng):
    x = rng.normal(size=(2, 5, DIM)).astype("float32")
    with pytest.raises(ValueError, match="query"):
        _layer()(x[0], x)
    with pytest.raises(ValueError, match="key"):
        _layer()(x, x, key=x[:, :3])
    with pytest.raises(ValueError, match="same length"):
        _layer()(x, x[:, :3], use_causal_mask=True)
    layer = _layer()
    layer(x, x)
    with pytest.raises(ValueError, match="initial_state"):
        layer(x, x, initial_state=(np.zeros((2, 2, 5, 4), "float32"), np.zeros((2, 2, 4), "float32")))
    with pytest.raises(ValueError, match="state"):
        layer.step(x[:, 0], x[:, 0], (np.zeros((3, 2, 4, 4), "float32"), np.zeros((3, 2, 4), "float32")))
