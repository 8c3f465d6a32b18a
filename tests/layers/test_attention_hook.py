"""The shared attention body (`ProjectedAttention`) and its one hook, `_compute_attention`.

Output shapes and specs of both layers, symbolic models, a subclass that
overrides only the hook (softmax attention, checked against
`keras.layers.MultiHeadAttention` with the same weights), the efficient
attention op against its float64 oracle, and no private Keras imports.
"""

import ast
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn import ops as lops
from keras_linattn.layers import EfficientAttention, LinearAttention
from keras_linattn.layers._attention_base import ProjectedAttention
from keras_linattn.ops.core import _mask_keys
from tests.tolerance import assert_close

LAYERS = {
    "linear": lambda **kw: LinearAttention(2, 4, value_dim=3, chunk_size=4, **kw),
    "efficient": lambda **kw: EfficientAttention(2, 4, value_dim=3, **kw),
    "efficient-random": lambda **kw: EfficientAttention(
        2, 4, value_dim=3, projection="random", projection_dim=4, max_length=16, seed=0, **kw
    ),
}


# ------------------------------------------------------------ output shapes
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("output_shape", [None, 7])
def test_compute_output_shape_is_the_output_shape(name, cross, output_shape, rng):
    layer = LAYERS[name](output_shape=output_shape)
    query = rng.normal(size=(2, 5, 12)).astype("float32")
    if cross:
        value = rng.normal(size=(2, 9, 8)).astype("float32")
        key = rng.normal(size=(2, 9, 6)).astype("float32")
    else:
        value, key = query, None
    out = layer(query, value, key=key)
    key_shape = None if key is None else key.shape
    assert layer.compute_output_shape(query.shape, value.shape, key_shape) == tuple(out.shape)
    assert tuple(out.shape) == (2, 5, output_shape or 12)
    # Unknown batch and lengths stay unknown.
    unknown = layer.compute_output_shape((None, None, 12), (None, None, value.shape[-1]))
    assert unknown == (None, None, output_shape or 12)


def test_compute_output_shape_checks_shapes():
    layer = LinearAttention(2, 4)
    with pytest.raises(ValueError, match="query"):
        layer.compute_output_shape((2, 12), (2, 5, 12))
    with pytest.raises(ValueError, match="same length"):
        layer.compute_output_shape((2, 5, 12), (2, 5, 12), (2, 6, 12))


# ---------------------------------------------------------- symbolic models
def test_functional_model_with_both_layers(rng):
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(20, 12, mask_zero=True)(tokens)
    linear = LinearAttention(2, 4, chunk_size=4)
    efficient = EfficientAttention(2, 4, projection="learned", projection_dim=3, max_length=10, seed=0, output_shape=5)
    a = linear(h, h, use_causal_mask=True)  # [B, T, 12]
    out = efficient(a, h)  # [B, T, 5]
    assert tuple(out.shape) == efficient.compute_output_shape(a.shape, h.shape) == (None, None, 5)
    # Both outputs carry the query's Keras mask (padded queries stay padded).
    assert a._keras_mask is not None and out._keras_mask is not None
    model = keras.Model(tokens, out)
    x = rng.integers(1, 20, size=(3, 8))
    x[0, 5:] = 0
    y = model(x)
    assert y.shape == (3, 8, 5) and np.isfinite(np.asarray(y)).all()
    # The padding reaches the efficient layer's keys: the same as an explicit key_mask.
    emb, la = model.layers[1], model.layers[2]
    hx = emb(x)
    direct = efficient(la(hx, hx, use_causal_mask=True), hx, key_mask=x != 0)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(direct))


def test_symbolic_call_with_return_state(rng):
    inp = keras.Input((None, 12))
    layer = LinearAttention(2, 4, value_dim=3, feature_map="taylor", conv_size=None)  # the (S, z) state alone
    out, (s, z) = layer(inp, inp, use_causal_mask=True, return_state=True)
    c = layer.feature_dim
    assert tuple(out.shape) == (None, None, 12)
    assert tuple(s.shape) == (None, 2, c, 3) and tuple(z.shape) == (None, 2, c)
    assert s.dtype == z.dtype == "float32"
    model = keras.Model(inp, [out, s, z])
    x = rng.normal(size=(2, 6, 12)).astype("float32")
    got = model(x)
    want_out, (want_s, want_z) = layer(x, x, use_causal_mask=True, return_state=True)
    for g, w in zip(got, (want_out, want_s, want_z), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_stateless_attention_refuses_state(rng):
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer = EfficientAttention(2, 4)
    with pytest.raises(ValueError, match="return_state"):
        layer(x, x, return_state=True)
    with pytest.raises(ValueError, match="initial_state"):
        layer(x, x, initial_state=(np.zeros((2, 2, 4, 4), "float32"), np.zeros((2, 2, 4), "float32")))
    with pytest.raises(ValueError, match="return_state"):
        inp = keras.Input((5, 8))
        EfficientAttention(2, 4)(inp, inp, return_state=True)


# ------------------------------------------------ a subclass with one override
class SoftmaxAttention(ProjectedAttention):
    """Plain softmax attention through the hook: the whole subclass."""

    def _compute_attention(
        self, query, key, value, key_mask=None, use_causal_mask=False, training=None, initial_state=None
    ):
        # Padded logits are masked by the op; padded values are zeroed here
        # (the hook's contract), so junk there cannot reach the weighted sum.
        value = _mask_keys(value, key_mask)  # [B, S, H, M]
        out = lops.softmax_attention(
            query, key, value, causal=use_causal_mask, key_mask=key_mask, compute_dtype="float32"
        )  # [B, T, H, M]
        return out, None


def _mha_with_weights_of(layer):
    mha = keras.layers.MultiHeadAttention(layer.num_heads, layer.key_dim, layer.value_dim)
    dim = layer._input_dims["query"]
    mha.build((None, None, dim), (None, None, layer._input_dims["value"]), (None, None, layer._input_dims["key"]))
    for ours, theirs in (
        (layer.query_dense, mha._query_dense),
        (layer.key_dense, mha._key_dense),
        (layer.value_dense, mha._value_dense),
        (layer.output_dense, mha._output_dense),
    ):
        theirs.set_weights(ours.get_weights())
    return mha


@pytest.mark.parametrize("causal", [False, True])
def test_subclass_overriding_only_the_hook_is_multi_head_attention(causal, rng):
    tokens = np.array([[3, 4, 5, 0, 0, 0], [7, 1, 2, 9, 4, 0]])
    emb = keras.layers.Embedding(12, 8, mask_zero=True)
    x = emb(tokens)  # [B, S, 8] with a Keras mask
    layer = SoftmaxAttention(2, 4, value_dim=3, bias_initializer="glorot_uniform")
    out = layer(x, x, use_causal_mask=causal)
    assert out._keras_mask is not None  # the query's mask, as for every ProjectedAttention
    real = tokens != 0
    # The Keras mask is the key padding: the same as an explicit key_mask.
    explicit = layer(np.asarray(x), np.asarray(x), key_mask=real, use_causal_mask=causal)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(explicit))
    # NaN junk at padded keys and values changes nothing (masked with `where`).
    junk = np.array(x)
    junk[~real] = np.nan
    with_junk = layer(np.array(x), junk, key=junk, key_mask=real, use_causal_mask=causal)
    np.testing.assert_array_equal(np.asarray(with_junk), np.asarray(explicit))
    # MultiHeadAttention with the same weights and the key padding as its attention mask.
    mha = _mha_with_weights_of(layer)
    allowed = np.broadcast_to(real[:, None, :], (2, 6, 6))  # [B, T, S]
    if causal:
        allowed = allowed & np.tril(np.ones((6, 6), bool))
    want = mha(np.asarray(x), np.asarray(x), attention_mask=allowed)
    # Two float32 computations: the projections over 8 inputs, the logits over
    # D = 4, the softmax and the weighted sum over S = 6, the output over H*M = 6.
    assert_close(out, want, n=8 + 4 + 2 * 6 + 6, paths=2)


# ------------------------------------------------- efficient attention, op level
def _efficient_inputs(rng, b=3, t=7, s=11, h=2, d=5, m=3, k=4, n=16):
    q = rng.normal(size=(b, t, h, d))
    key = rng.normal(size=(b, s, h, d)) * 2.0
    v = rng.normal(size=(b, s, h, m))
    mask = np.ones((b, s), bool)
    mask[0, 6:] = False
    mask[1, ::3] = False
    mask[2] = False  # a row with no real key: zeros, no NaN
    e = rng.normal(size=(k, n)) / np.sqrt(k)
    f = np.exp(-1.0) * rng.normal(size=(k, n)) / np.sqrt(k)
    return q, key, v, mask, e, f


def _reduction_length(s, d, k, projected):
    """Softmax over S and the context over S (or E K over S, softmax and context over K),
    then the queries' product with the context over D."""
    return (s + 2 * k if projected else 2 * s) + d


@pytest.mark.parametrize("projected", [False, True])
def test_efficient_op_matches_float64_reference_outputs_and_gradients(projected, rng):
    q, k, v, mask, e, f = _efficient_inputs(rng)
    b, t, h, d = q.shape
    s, m = v.shape[1], v.shape[3]
    k[~mask] = 50.0 * rng.normal(size=k[~mask].shape)  # junk at padded keys
    inputs = [tf.Variable(x.astype("float32")) for x in (q, k, v)]
    proj = [tf.Variable(x.astype("float32")) for x in (e, f)] if projected else []
    cot = tf.constant(rng.normal(size=(b, t, h, m)))
    with tf.GradientTape(persistent=True) as tape:
        projections = dict(zip(("projection_key", "projection_value"), proj, strict=False))  # proj may be empty
        out = lops.efficient_attention(*inputs, key_mask=mask, **projections)
        ref = lops.efficient_attention_reference(
            *(tf.cast(x, "float64") for x in inputs),
            key_mask=mask,
            **projections,
        )
        loss = tf.reduce_sum(tf.cast(out, "float64") * cot)
        loss_ref = tf.reduce_sum(ref * cot)
    assert out.dtype == "float32" and ref.dtype == "float64"
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
    n = _reduction_length(s, d, e.shape[0], projected)
    assert_close(out, ref, n=n, what="outputs")
    sources = inputs + proj
    grads = tape.gradient(loss, sources)
    grads_ref = tape.gradient(loss_ref, sources)
    # Backward adds the sums over the T queries and M values; E and F are shared by
    # every batch row, head and feature (B*H*max(D, M) more terms).
    n_grad = n + t + m + b * h * max(d, m)
    flat = np.concatenate([np.ravel(g) for g in grads])
    flat_ref = np.concatenate([np.ravel(g) for g in grads_ref])
    assert np.isfinite(flat).all()
    assert_close(flat, flat_ref, n=n_grad, what="all gradients")
    # Per source, conditioned by the ratio of the whole gradient's scale to the
    # source's: its absolute error is inherited from the whole backward pass.
    whole = float(np.abs(flat_ref).max())
    for name, g, gr in zip(["q", "k", "v", "E", "F"], grads, grads_ref, strict=False):  # E, F when projected
        assert_close(g, gr, n=n_grad, conditioning=whole / float(np.abs(gr).max()), what=name)


@pytest.mark.parametrize("projected", [False, True])
def test_efficient_op_ignores_nan_and_inf_at_padded_keys(projected, rng):
    q, k, v, mask, e, f = _efficient_inputs(rng)
    proj = dict(projection_key=e.astype("float32"), projection_value=f.astype("float32")) if projected else {}
    q, k, v = (x.astype("float32") for x in (q, k, v))
    clean = lops.efficient_attention(q, k, v, key_mask=mask, **proj)
    k2, v2 = k.copy(), v.copy()
    k2[~mask] = np.nan
    v2[~mask] = np.inf
    dirty = lops.efficient_attention(q, k2, v2, key_mask=mask, **proj)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_efficient_op_rejects_bad_projections(rng):
    q, k, v, mask, e, f = (x.astype("float32") for x in _efficient_inputs(rng))
    with pytest.raises(ValueError, match="both or neither"):
        lops.efficient_attention(q, k, v, projection_key=e)
    with pytest.raises(ValueError, match="projection_value"):
        lops.efficient_attention(q, k, v, projection_key=e, projection_value=f[:, :10])
    with pytest.raises(ValueError, match="N=8"):
        lops.efficient_attention(q, k, v, projection_key=e[:, :8], projection_value=f[:, :8])
    with pytest.raises(ValueError, match="key_mask"):
        lops.efficient_attention(q, k, v, key_mask=mask[:, :5])


# ------------------------------------------------------ no private Keras API


def _private_keras_imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [n for n in names if n == "keras.src" or n.startswith("keras.src.")]
    return found


def test_no_module_imports_private_keras():
    root = pathlib.Path(keras_linattn.__file__).parent
    offenders = {str(p.relative_to(root)): _private_keras_imports(p) for p in sorted(root.rglob("*.py"))}
    offenders = {p: names for p, names in offenders.items() if names}
    assert not offenders, offenders
