"""Property-based tests: random shapes, chunk sizes, padding patterns and feature maps.

Every property is checked against a plain reference (the quadratic oracle
`kernel_attention_reference` or the recurrent `linear_attention_step`), or is
an invariance (key permutation, padded junk, future tokens). Hypothesis draws
the sizes and patterns; the tensors come from a NumPy generator seeded by a
drawn integer, which keeps example generation cheap. Examples are bounded so
the file runs in well under a minute.

Shape legend: B batch, T query length, S key length, H heads, C feature dim,
M value dim, L chunk length.
"""

import os

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention
from keras_linattn.ops import kernel_attention_reference, linear_attention, linear_attention_step
from keras_linattn.ops.core import _zero_state as zero_state
from tests.tolerance import assert_close, normalizer_conditioning

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

# Under CI (CI=true) the examples are derandomized: every run checks the same
# inputs, so a CI result can be reproduced. Locally each run explores new ones.
SETTINGS = dict(
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def problems(draw, causal):
    """Sizes, chunk length, seed and a per-row key-padding pattern."""
    b = draw(st.integers(1, 3))
    t = draw(st.integers(1, 40))
    s = t if causal else draw(st.integers(1, 40))
    h = draw(st.integers(1, 3))
    c = draw(st.integers(1, 6))
    m = draw(st.integers(1, 5))
    chunk = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**31 - 1))
    # Padding: None, or one boolean per key and row; rows may be all padded.
    mask = draw(
        st.one_of(
            st.none(),
            st.lists(st.lists(st.booleans(), min_size=s, max_size=s), min_size=b, max_size=b),
        )
    )
    return dict(b=b, t=t, s=s, h=h, c=c, m=m, chunk=chunk, seed=seed, mask=mask)


def _tensors(p, positive=True):
    rng = np.random.default_rng(p["seed"])
    b, t, s, h, c, m = (p[k] for k in "btshcm")
    if positive:
        # Positive features (every map but favor_trig/taylor gives these):
        # the denominators are bounded away from zero, relative errors are meaningful.
        q = rng.uniform(0.05, 2.0, (b, t, h, c)).astype("float32")  # [B, T, H, C]
        k = rng.uniform(0.05, 2.0, (b, s, h, c)).astype("float32")  # [B, S, H, C]
    else:
        q = rng.normal(size=(b, t, h, c)).astype("float32")
        k = rng.normal(size=(b, s, h, c)).astype("float32")
    v = rng.normal(size=(b, s, h, m)).astype("float32")  # [B, S, H, M]
    mask = None if p["mask"] is None else np.asarray(p["mask"], dtype=bool)  # [B, S]
    return q, k, v, mask


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=True))
def test_chunked_causal_equals_oracle_and_recurrent_steps(p):
    q, k, v, mask = _tensors(p)
    out, (s_fin, z_fin) = linear_attention(
        q, k, v, causal=True, key_mask=mask, chunk_size=p["chunk"], return_state=True
    )
    expected = kernel_attention_reference(q, k, v, causal=True, key_mask=mask)  # float64
    n = p["s"] + p["c"]  # S keys + C features
    assert_close(out, expected, n=n, what="oracle")
    # Recurrent form: one linear_attention_step per token.
    state = zero_state(p["b"], p["h"], p["c"], p["m"])
    steps = []
    for i in range(p["t"]):
        mask_t = None if mask is None else mask[:, i]
        o, state = linear_attention_step(q[:, i], k[:, i], v[:, i], state, key_mask_t=mask_t)
        steps.append(np.asarray(o))
    stepped = np.stack(steps, axis=1)  # [B, T, H, M]
    assert_close(out, stepped, n=n, paths=2, what="steps")  # chunked vs recurrent, both float32
    # The final states agree too: sums over the S keys.
    assert_close(s_fin, state[0], n=p["s"], paths=2, what="S")
    assert_close(z_fin, state[1], n=p["s"], paths=2, what="z")


def _causal_gradient_conditioning(q, k, v, w, mask, scale):
    """Conditioning of the gradients of ``sum(w * out)`` for causal attention.

    With ``g_i = w_i / den_i`` and ``out_i = num_i / den_i``, the gradients
    w.r.t. q and k are differences of a numerator and a denominator term,
    ``dq_i = sum_j<=i k_j (g_i.v_j) - sum_j<=i k_j (g_i.out_i)`` (and the same
    for ``dk_j`` summed over ``i >= j``), which cancel (exactly for C = 1,
    where q drops out of the ratio). Their rounding error is relative to the
    terms' size: ``max(|first| + |second|)`` over the gradients' scale (at least 1).
    NumPy float64; ``q, k [B, T, H, C]``, ``v, w [B, T, H, M]``, ``mask [B, T]`` or None.
    """
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    t = q.shape[1]
    keep = np.ones(q.shape[:2]) if mask is None else np.asarray(mask, np.float64)  # [B, S]
    k = k * keep[:, :, None, None]
    v = v * keep[:, :, None, None]
    tril = np.tril(np.ones((t, t)))  # [T, S]
    a = np.einsum("bthc,bshc->bhts", q, k) * tril  # [B, H, T, S]
    den = a.sum(-1)  # [B, H, T]
    safe = np.where(den == 0, 1.0, den)
    out = np.einsum("bhts,bshm->bhtm", a, v) / safe[..., None]  # [B, H, T, M]
    g = np.where(den[..., None] == 0, 0.0, np.transpose(w, (0, 2, 1, 3)) / safe[..., None])  # [B, H, T, M]
    gv = np.einsum("bhtm,bshm->bhts", g, v) * tril  # g_i . v_j, [B, H, T, S]
    gout = (g * out).sum(-1)[..., None] * tril  # g_i . out_i, [B, H, T, S]
    terms = [
        np.abs(np.einsum("bhts,bshc->bhtc", gv, k)) + np.abs(np.einsum("bhts,bshc->bhtc", gout, k)),  # dq
        np.abs(np.einsum("bhts,bthc->bhsc", gv, q)) + np.abs(np.einsum("bhts,bthc->bhsc", gout, q)),  # dk
    ]
    return max(1.0, max(float(x.max()) for x in terms) / scale)


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=True))
def test_chunked_causal_gradients_equal_oracle_gradients(p):
    import tensorflow as tf

    q, k, v, mask = _tensors(p)
    q, k, v = (tf.constant(x) for x in (q, k, v))
    w = np.random.default_rng(p["seed"] + 1).normal(size=(p["b"], p["t"], p["h"], p["m"])).astype("float32")
    w_tf = tf.constant(w)

    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(fn() * w_tf)
        return tape.gradient(loss, [q, k, v])

    fast = grads(lambda: linear_attention(q, k, v, causal=True, key_mask=mask, chunk_size=p["chunk"]))
    slow = grads(lambda: kernel_attention_reference(q, k, v, causal=True, key_mask=mask))
    # One scale for the three gradients (compared as one vector): d out / d q
    # can vanish exactly (C = 1 cancels q in the ratio), where a per-tensor
    # relative error means nothing.
    fast_flat = np.concatenate([np.ravel(a) for a in fast])
    slow_flat = np.concatenate([np.ravel(b) for b in slow])
    scale = float(np.abs(slow_flat).max())
    conditioning = _causal_gradient_conditioning(q, k, v, w, mask, scale) if scale > 0 else 1.0
    # forward S keys + C features, backward T queries (d/dk, d/dv) + M values (d/dq)
    assert_close(fast_flat, slow_flat, n=p["s"] + p["c"] + p["t"] + p["m"], conditioning=conditioning)


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=False))
def test_non_causal_equals_oracle(p):
    q, k, v, mask = _tensors(p)
    out = linear_attention(q, k, v, causal=False, key_mask=mask, chunk_size=p["chunk"])
    expected = kernel_attention_reference(q, k, v, causal=False, key_mask=mask)  # float64
    assert_close(out, expected, n=p["s"] + p["c"])  # S keys + C features
    if mask is not None:
        # A row with every key padded gives exactly 0 (not NaN).
        empty = ~mask.any(axis=1)
        assert np.all(np.asarray(out)[empty] == 0.0)


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=False), perm_seed=st.integers(0, 2**31 - 1))
def test_non_causal_is_invariant_to_key_permutation(p, perm_seed):
    q, k, v, mask = _tensors(p)
    perm = np.random.default_rng(perm_seed).permutation(p["s"])
    out = linear_attention(q, k, v, key_mask=mask)
    permuted = linear_attention(q, k[:, perm], v[:, perm], key_mask=None if mask is None else mask[:, perm])
    # Only the summation order changes: two float32 sums over S keys + C features.
    assert_close(permuted, out, n=p["s"] + p["c"], paths=2)


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=True), causal=st.booleans(), junk_seed=st.integers(0, 2**31 - 1))
def test_outputs_never_depend_on_padded_keys(p, causal, junk_seed):
    q, k, v, mask = _tensors(p, positive=False)
    if mask is None:
        mask = np.ones((p["b"], p["s"]), bool)
        mask[:, -1] = False
    junk = np.random.default_rng(junk_seed)
    k2, v2 = k.copy(), v.copy()
    pad = ~mask
    # Arbitrary finite values, up to 1e4 in size, at every padded key.
    k2[pad] = junk.normal(size=k2[pad].shape) * 10.0 ** junk.uniform(-3, 4)
    v2[pad] = junk.normal(size=v2[pad].shape) * 10.0 ** junk.uniform(-3, 4)
    kwargs = dict(causal=causal, key_mask=mask, chunk_size=p["chunk"], return_state=True)
    out, (s1, z1) = linear_attention(q, k, v, **kwargs)
    out2, (s2, z2) = linear_attention(q, k2, v2, **kwargs)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s1))
    np.testing.assert_array_equal(np.asarray(z2), np.asarray(z1))


# Feature maps whose kernel phi(q).phi(k) is positive (taylor's is >= 1/2 even
# though single features are signed). favor_trig's estimates can be negative,
# so its denominators come arbitrarily close to 0 and a relative comparison of
# two summation orders means nothing there.
_POSITIVE_KERNEL_MAPS = [m for m in feature_maps.available() if m != "favor_trig"]
_MAPS = {}


def _built_map(name, heads, dim):
    key = (name, heads, dim)
    if key not in _MAPS:
        kwargs = {"num_features": 8, "seed": 0} if name == "favor+" else {}
        fm = feature_maps.get(name, **kwargs)
        fm.build((None, None, heads, dim))
        _MAPS[key] = fm
    return _MAPS[key]


@settings(max_examples=25, **SETTINGS)
@given(p=problems(causal=True), name=st.sampled_from(_POSITIVE_KERNEL_MAPS), causal=st.booleans())
def test_real_feature_maps_chunked_equals_oracle_and_steps(p, name, causal):
    b, t, h, m = p["b"], p["t"], p["h"], p["m"]
    d = 3  # key dim D (taylor: C = 1 + D + D^2 = 13)
    fm = _built_map(name, h, d)
    rng = np.random.default_rng(p["seed"])
    q = rng.normal(size=(b, t, h, d)).astype("float32")  # [B, T, H, D]
    k = rng.normal(size=(b, t, h, d)).astype("float32")  # [B, T, H, D]
    v = rng.normal(size=(b, t, h, m)).astype("float32")  # [B, T, H, M]
    mask = None if p["mask"] is None else np.asarray(p["mask"], dtype=bool)
    qf = fm(q, is_query=True, causal=causal)  # [B, T, H, C]
    kf = fm(k, is_query=False, causal=causal)  # [B, T, H, C]
    out = linear_attention(qf, kf, v, causal=causal, key_mask=mask, chunk_size=p["chunk"])
    n = t + fm.feature_dim(d)  # S keys (S = T) + C features; the features are the same on both sides
    # 1 for these maps' positive kernels, computed rather than assumed
    conditioning = normalizer_conditioning(qf, kf, causal=causal, key_mask=mask)
    expected = kernel_attention_reference(qf, kf, v, causal=causal, key_mask=mask)  # float64
    assert_close(out, expected, n=n, conditioning=conditioning, what="oracle")
    if causal:
        state = zero_state(b, h, fm.feature_dim(d), m)
        steps = []
        for i in range(t):
            o, state = linear_attention_step(
                qf[:, i], kf[:, i], v[:, i], state, key_mask_t=None if mask is None else mask[:, i]
            )
            steps.append(np.asarray(o))
        assert_close(out, np.stack(steps, axis=1), n=n, conditioning=conditioning, paths=2, what="steps")


# ----------------------------------------------------------------- layers
# One small layer per registered feature map, built once: building dominates
# the cost of an example.
_DIM, _HEADS, _KEY_DIM = 8, 2, 4
_LAYERS = {}


def _layer(name):
    if name not in _LAYERS:
        kwargs = {"seed": 0} if name in ("favor+", "favor_trig") else {}
        if name in ("favor+", "favor_trig"):
            kwargs["num_features"] = 8
        fm = feature_maps.get(name, **kwargs)
        layer = LinearAttention(
            num_heads=_HEADS,
            key_dim=_KEY_DIM,
            feature_map=fm,
            conv_size=None,  # the properties' oracles are the attention without a short convolution
            dtype="float32",
        )
        layer.build((None, None, _DIM), (None, None, _DIM))
        _LAYERS[name] = layer
    return _LAYERS[name]


@pytest.mark.parametrize("name", feature_maps.available())
@settings(max_examples=4, **SETTINGS)
@given(
    t=st.integers(2, 24),
    chunk=st.integers(1, 16),
    cut=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 2),
)
def test_layer_with_every_feature_map_is_causal(name, t, chunk, cut, seed, batch):
    layer = _layer(name)
    layer.chunk_size = chunk
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, t, _DIM)).astype("float32")
    last = min(int(cut * (t - 1)), t - 2)  # outputs 0..last must not change
    x2 = x.copy()
    x2[:, last + 1 :] = rng.normal(size=x2[:, last + 1 :].shape) * 10.0
    call = layer
    if name == "favor_trig" and keras.backend.backend() == "tensorflow":
        # x10 puts later favor_trig keys past its amplitude cap: eager TensorFlow raises
        # KernelUnderflowError; in a graph the rows from there on are NaN, the earlier ones untouched.
        import tensorflow as tf

        call = tf.function(layer, autograph=False)
    y = np.asarray(call(x, x, use_causal_mask=True))
    y2 = np.asarray(call(x2, x2, use_causal_mask=True))
    np.testing.assert_array_equal(y2[:, : last + 1], y[:, : last + 1])
    # And the change is visible afterwards (the test is not vacuous).
    assert not np.array_equal(y2[:, last + 1 :], y[:, last + 1 :])


@pytest.mark.parametrize("name", feature_maps.available())
@pytest.mark.parametrize("junk", ["finite", "nan", "inf"])
@settings(max_examples=4, **SETTINGS)
@given(t=st.integers(2, 20), seed=st.integers(0, 2**31 - 1), causal=st.booleans())
def test_layer_with_every_feature_map_ignores_padded_tokens(name, t, seed, causal, junk):
    layer = _layer(name)
    layer.chunk_size = 8
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, t, _DIM)).astype("float32")
    mask = rng.random((2, t)) < 0.7
    mask[:, 0] = True
    x2 = x.copy()
    # Padded tokens replaced by arbitrary tokens, up to 100x larger, or NaN/Inf.
    if junk == "finite":
        x2[~mask] = rng.normal(size=x2[~mask].shape) * 10.0 ** rng.uniform(-2, 2)
    else:
        x2[~mask] = np.nan if junk == "nan" else -np.inf
    y = np.asarray(layer(x, x, key_mask=mask, use_causal_mask=causal))
    y2 = np.asarray(layer(x2, x2, key_mask=mask, use_causal_mask=causal))
    # Outputs at real query positions (a padded query's own output follows its
    # input) are bit-identical: padded keys enter every map as zeros and are
    # masked again after it, so even the non-causal favor+/favor_trig key
    # stabilizers (a max over keys) never see them.
    np.testing.assert_array_equal(y2[mask], y[mask])
