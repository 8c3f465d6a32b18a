"""LinearAttention layer: maths against the oracle, masks, state, precision, training, saving."""

import os

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention
from tests._backend import flat, gradients
from tests._helpers import oracle_forward, run_steps
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`); jax: run again on JAX (`make test-jax`)
pytestmark = [pytest.mark.numeric, pytest.mark.jax]

DIM = 16
HEADS, KEY_DIM = 2, 4  # _layer's defaults; value dim M = KEY_DIM unless given


def _layer(**kwargs):
    # The oracles here are of the feature map and the additive recurrence alone, not of the default's convolution.
    kwargs.setdefault("feature_map", "elu")
    kwargs.setdefault("conv_size", None)
    kwargs.setdefault("num_heads", HEADS)
    kwargs.setdefault("key_dim", KEY_DIM)
    return LinearAttention(**kwargs)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "taylor"])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_matches_oracle_outputs_and_weight_gradients(rng, feature_map, causal):
    b, t = 2, 37
    x = rng.normal(size=(b, t, DIM)).astype("float32")
    mask = np.ones((b, t), bool)
    mask[1, 30:] = False
    layer = _layer(feature_map=feature_map, chunk_size=16)
    layer(x, x)

    def grads(fn):
        def loss():
            out = fn()
            return keras.ops.sum(out * keras.ops.sin(keras.ops.arange(out.shape[-1], dtype="float32"))), out

        out, g = gradients(loss, [], layer.trainable_variables)
        return out, flat(g)

    out, g = grads(lambda: layer(x, x, key_mask=mask, use_causal_mask=causal))
    ref, g_ref = grads(lambda: oracle_forward(layer, x, x, causal=causal, key_mask=mask))  # float64 attention
    # Both sides share the query/key/value projections; they differ from the attention on.
    c, hm = layer.feature_dim, HEADS * KEY_DIM
    assert_close(out, ref, n=t + c + hm, what="outputs")  # S keys + C features + H*M output projection
    # Backward: the output projection over its DIM outputs, the attention's sums over the
    # T queries and M values, and the weight gradients' sums over the B*T positions.
    n_grad = t + c + hm + DIM + t + KEY_DIM + b * t
    assert_close(g, g_ref, n=n_grad, what="weight gradients")


def test_cross_attention_with_separate_key(rng):
    q = rng.normal(size=(2, 5, DIM)).astype("float32")
    v = rng.normal(size=(2, 11, 8)).astype("float32")
    k = rng.normal(size=(2, 11, 12)).astype("float32")
    layer = _layer(value_dim=3)
    out = layer(q, v, key=k)
    assert out.shape == (2, 5, DIM)
    s, c, hm = 11, layer.feature_dim, HEADS * 3
    # Shared projections; float64 attention.
    assert_close(out, oracle_forward(layer, q, v, k), n=s + c + hm)  # S keys + C features + H*M output projection


def test_keras_padding_mask_is_used_for_keys(rng):
    tokens = np.array([[3, 4, 5, 0, 0, 0], [7, 1, 2, 9, 4, 0]])
    emb = keras.layers.Embedding(12, DIM, mask_zero=True)
    layer = _layer()
    x = emb(tokens)
    out = layer(x, x)
    mask = tokens != 0
    s, c, hm = tokens.shape[1], layer.feature_dim, HEADS * KEY_DIM
    # Shared projections; float64 attention.
    assert_close(out, oracle_forward(layer, x, x, key_mask=mask), n=s + c + hm)  # S keys + C features + H*M
    # Changing the embeddings at padded positions does not change real positions: padded
    # keys and values are replaced (not multiplied) by zeros, so the sums are the same.
    x2 = np.array(x)
    x2[tokens == 0] = 100.0
    out2 = layer(x2, x2, key_mask=mask)
    np.testing.assert_array_equal(np.asarray(out)[mask], np.asarray(out2)[mask])
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
    # Two float32 computations: paths=2.
    n = DIM + 40 + layer.feature_dim + HEADS * KEY_DIM  # D projections + S keys + C features + H*M
    assert_close(np.concatenate([a, b], axis=1), full, n=n, paths=2)


def test_step_equals_parallel(rng):
    x = rng.normal(size=(2, 9, DIM)).astype("float32")
    layer = _layer(feature_map="taylor")
    full = np.asarray(layer(x, x, use_causal_mask=True))
    stepped, _ = run_steps(layer, x, self_attention=True)
    # Two float32 computations (recurrent, chunked): paths=2.
    n = DIM + 9 + layer.feature_dim + HEADS * KEY_DIM  # D projections + S keys + C features + H*M
    assert_close(stepped, full, n=n, paths=2)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_precision_at_4096_is_close_to_float32(rng, policy, causal):
    t, dim, heads, key_dim = 4096, 64, 4, 16
    x = rng.normal(size=(1, t, dim)).astype("float32")
    plain = dict(feature_map="elu", conv_size=None)  # the bound below counts elu's C = 16 features, no convolution
    ref_layer = LinearAttention(num_heads=heads, key_dim=key_dim, **plain)
    ref = np.asarray(ref_layer(x, x, use_causal_mask=causal))
    keras.config.set_dtype_policy(policy)
    layer = LinearAttention(num_heads=heads, key_dim=key_dim, **plain)
    layer(x[:, :2], x[:, :2])
    layer.set_weights(ref_layer.get_weights())
    out = layer(x, x, use_causal_mask=causal)
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
    out = keras.ops.convert_to_numpy(keras.ops.cast(out, "float32"))
    # The reductions that round in the policy's compute dtype are the query/key/value
    # projections (over the D = 64 inputs) and the output projection (over H*M = 64).
    # The attention's sums over the S = 4096 keys and C = 16 features run in float32
    # under any policy (features and state are float32): they add bound(float32, S + C)
    # ~ 3e-5, below 0.1% of this bound, and they are why S is not in n (S = 4096 in
    # the policy dtype would give a bf16 bound of 2.0, no test at all). The float32
    # reference's own error is as small, so paths=1.
    assert_close(out, ref, n=dim + heads * key_dim, dtype=policy)  # D projections + H*M output projection


def _tiny_model(causal, feature_map="elu"):
    inp = keras.Input((24,), dtype="int32")
    h = keras.layers.Embedding(20, DIM, mask_zero=True)(inp)
    # The feature map alone (no convolution): the model's size and speed are those of the XLA test as written.
    attention = LinearAttention(2, 8, feature_map=feature_map, conv_size=None, chunk_size=8)
    h = h + attention(h, h, use_causal_mask=causal)
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
    # Learning criterion (seeded): the last epoch's mean loss is below the first's.
    assert losses[-1] < losses[0]


def test_keras_save_load_with_non_default_arguments(rng, tmp_path):
    inp = keras.Input((None, DIM))
    layer = LinearAttention(
        num_heads=3,
        key_dim=5,
        value_dim=6,
        feature_map=feature_maps.get("relu", epsilon=1e-3),
        chunk_size=7,
        dropout=0.1,
        use_bias=False,
        output_shape=9,
        epsilon=1e-5,
        kernel_initializer="he_normal",
        kernel_regularizer="l2",
        seed=3,
    )
    model = keras.Model(inp, layer(inp, inp, use_causal_mask=True))
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    x = rng.normal(size=(2, 19, DIM)).astype("float32")
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(loaded(x)))
    lcfg = loaded.layers[-1].get_config()
    keys = ("num_heads", "key_dim", "value_dim", "chunk_size", "dropout", "use_bias", "output_shape", "epsilon", "seed")
    for key in keys:
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


@pytest.mark.parametrize("causal", [False, True])
def test_a_symbolic_call_keeps_unknown_dims_unknown(causal):
    # On JAX the spec is traced at two concrete sizes (an unknown length cannot be proven divisible
    # by the chunk); on TensorFlow with the unknown dims. Both give the same spec.
    inp = keras.Input((None, DIM))
    layer = _layer(chunk_size=4, output_shape=7)
    out, state = layer(inp, inp, use_causal_mask=causal, return_state=True)
    assert tuple(out.shape) == (None, None, 7)
    assert [tuple(part.shape) for part in keras.tree.flatten(state)] == [
        (None, HEADS, layer.feature_dim, KEY_DIM),
        (None, HEADS, layer.feature_dim),
    ]
    fixed = keras.Input((5, DIM), batch_size=3)
    assert tuple(layer(fixed, fixed, use_causal_mask=causal).shape) == (3, 5, 7)
