"""keras_linattn.ops: the chunked / non-causal / recurrent paths against the quadratic oracle."""

import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import ops as lops
from tests.conftest import rel_err

B, H, C, M = 2, 3, 5, 4


def _inputs(rng, t, s=None, positive=True):
    s = t if s is None else s
    q = rng.normal(size=(B, t, H, C)).astype("float32")
    k = rng.normal(size=(B, s, H, C)).astype("float32")
    if positive:
        q, k = np.abs(q) + 0.05, np.abs(k) + 0.05
    v = rng.normal(size=(B, s, H, M)).astype("float32")
    return q, k, v


def _padding(rng, s):
    mask = np.ones((B, s), dtype=bool)
    # Row 0: a few padded keys scattered; row 1: right padding.
    mask[0, rng.choice(s, size=s // 4, replace=False)] = False
    mask[1, max(1, s - s // 3):] = False
    mask[:, 0] = True  # causal rows always see at least one key
    return mask


def _grads(fn, q, k, v, w):
    q, k, v = (tf.constant(x) for x in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        loss = tf.reduce_sum(fn(q, k, v) * w)
    # One flat vector of all gradients: the relative error is taken over the
    # whole gradient (some components, e.g. d/dq at T=1, are exactly zero).
    return np.concatenate([g.numpy().ravel() for g in tape.gradient(loss, [q, k, v])])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 500])
def test_matches_oracle_outputs_and_gradients(rng, t, chunk_size, causal):
    q, k, v = _inputs(rng, t)
    mask = _padding(rng, t)
    w = rng.normal(size=(B, t, H, M)).astype("float32")

    def fast(q_, k_, v_):
        return lops.linear_attention(q_, k_, v_, causal=causal, key_mask=mask, chunk_size=chunk_size)

    def oracle(q_, k_, v_):
        return lops.kernel_attention_reference(q_, k_, v_, causal=causal, key_mask=mask)

    assert rel_err(fast(q, k, v), oracle(q, k, v)) <= 1e-5
    assert rel_err(_grads(fast, q, k, v, w), _grads(oracle, q, k, v, w)) <= 1e-5


@pytest.mark.parametrize("t,s", [(7, 65), (64, 3), (33, 130)])
def test_cross_attention_matches_oracle(rng, t, s):
    q, k, v = _inputs(rng, t, s)
    mask = _padding(rng, s)
    w = rng.normal(size=(B, t, H, M)).astype("float32")

    def fast(q_, k_, v_):
        return lops.linear_attention(q_, k_, v_, key_mask=mask)

    def oracle(q_, k_, v_):
        return lops.kernel_attention_reference(q_, k_, v_, key_mask=mask)

    assert rel_err(fast(q, k, v), oracle(q, k, v)) <= 1e-5
    assert rel_err(_grads(fast, q, k, v, w), _grads(oracle, q, k, v, w)) <= 1e-5


def test_signed_features_match_oracle(rng):
    """Features with mixed signs (e.g. Taylor) still follow the same algebra."""
    q, k, v = _inputs(rng, 40, positive=False)
    # Make kernel values positive overall: a large constant first feature.
    q[..., 0], k[..., 0] = 3.0, 3.0
    for causal in (False, True):
        got = lops.linear_attention(q, k, v, causal=causal, chunk_size=16)
        want = lops.kernel_attention_reference(q, k, v, causal=causal)
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_causal_never_sees_the_future(rng, chunk_size):
    t = 70
    q, k, v = _inputs(rng, t)
    base = np.asarray(lops.linear_attention(q, k, v, causal=True, chunk_size=chunk_size))
    for cut in (0, 15, 16, 40, 69):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        noise = _inputs(np.random.default_rng(cut), t)
        q2[:, cut + 1:], k2[:, cut + 1:], v2[:, cut + 1:] = (x[:, cut + 1:] * 7.0 for x in noise)
        out = np.asarray(lops.linear_attention(q2, k2, v2, causal=True, chunk_size=chunk_size))
        np.testing.assert_array_equal(out[:, : cut + 1], base[:, : cut + 1])
        if cut + 1 < t:
            assert not np.array_equal(out[:, cut + 1:], base[:, cut + 1:])


@pytest.mark.parametrize("causal", [False, True])
def test_all_padded_rows_are_zero_not_nan(rng, causal):
    q, k, v = _inputs(rng, 20)
    mask = np.ones((B, 20), dtype=bool)
    mask[1] = False
    out = np.asarray(lops.linear_attention(q, k, v, causal=causal, key_mask=mask, chunk_size=8))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[1], 0.0)
    # Gradients stay finite too.
    grads = _grads(
        lambda a, b, c: lops.linear_attention(a, b, c, causal=causal, key_mask=mask, chunk_size=8),
        q, k, v, np.ones((B, 20, H, M), "float32"),
    )
    assert np.isfinite(grads).all()


def test_padded_keys_do_not_matter(rng):
    q, k, v = _inputs(rng, 30)
    mask = _padding(rng, 30)
    k2, v2 = k.copy(), v.copy()
    k2[~mask], v2[~mask] = 1e3, -1e3
    for causal in (False, True):
        a = lops.linear_attention(q, k, v, causal=causal, key_mask=mask, chunk_size=8)
        b = lops.linear_attention(q, k2, v2, causal=causal, key_mask=mask, chunk_size=8)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("causal", [False, True])
def test_resume_from_state_equals_one_pass(rng, causal):
    t = 45
    q, k, v = _inputs(rng, t)
    full, (s_full, z_full) = lops.linear_attention(q, k, v, causal=causal, chunk_size=8, return_state=True)
    if causal:
        pieces = []
        state = None
        for lo, hi in ((0, 10), (10, 11), (11, 45)):
            out, state = lops.linear_attention(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], causal=True, chunk_size=8,
                initial_state=state, return_state=True,
            )
            pieces.append(np.asarray(out))
        assert rel_err(np.concatenate(pieces, axis=1), full) <= 1e-5
    else:
        # Non-causal: the state from the first half plus the second half equals all keys.
        _, state = lops.linear_attention(q, k[:, :20], v[:, :20], return_state=True)
        out, state = lops.linear_attention(q, k[:, 20:], v[:, 20:], initial_state=state, return_state=True)
        assert rel_err(out, full) <= 1e-5
    assert rel_err(state[0], s_full) <= 1e-5
    assert rel_err(state[1], z_full) <= 1e-5
    # The state is sum_j phi(k_j) v_j^T and sum_j phi(k_j), computed independently here.
    np.testing.assert_allclose(np.asarray(s_full), np.einsum("bshc,bshm->bhcm", k, v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(z_full), k.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_step_equals_parallel(rng):
    t = 23
    q, k, v = _inputs(rng, t)
    full = np.asarray(lops.linear_attention(q, k, v, causal=True, chunk_size=8))
    state = lops.zero_state(B, H, C, M)
    outs = []
    for i in range(t):
        out, state = lops.linear_attention_step(q[:, i], k[:, i], v[:, i], state)
        outs.append(np.asarray(out))
    assert rel_err(np.stack(outs, axis=1), full) <= 1e-5


def test_softmax_reference_matches_numpy(rng):
    q = rng.normal(size=(B, 6, H, 8)).astype("float32")
    k = rng.normal(size=(B, 9, H, 8)).astype("float32")
    v = rng.normal(size=(B, 9, H, M)).astype("float32")
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(8)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshm->bthm", p, v)
    assert rel_err(lops.softmax_attention(q, k, v), want) <= 1e-5


@pytest.mark.parametrize("policy_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs_accumulate_in_float32(rng, policy_dtype, causal):
    n = 4096
    q = np.abs(rng.normal(size=(1, n, 2, 8))).astype("float32")
    k = np.abs(rng.normal(size=(1, n, 2, 8))).astype("float32")
    v = rng.normal(size=(1, n, 2, 8)).astype("float32")
    ref = np.asarray(lops.linear_attention(q, k, v, causal=causal))
    low = lops.linear_attention(
        tf.cast(q, policy_dtype), tf.cast(k, policy_dtype), tf.cast(v, policy_dtype), causal=causal
    )
    assert low.dtype == policy_dtype
    low = np.asarray(tf.cast(low, "float32"))
    assert np.isfinite(low).all()
    assert rel_err(low, ref) <= 1e-2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q_features=np.zeros((2, 3, 4), "float32")), "q_features"),
        (dict(k_features=np.zeros((2, 5, 3, 6), "float32")), "feature dim"),
        (dict(v=np.zeros((2, 5, 2, 4), "float32")), "heads"),
        (dict(v=np.zeros((2, 6, 3, 4), "float32")), "length S"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=-3), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(key_mask=np.ones((2, 4), bool)), "key_mask"),
        (dict(initial_state=(np.zeros((2, 3, 5)), np.zeros((2, 3, 5)))), "initial_state|state"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(kwargs, match):
    args = dict(
        q_features=np.ones((2, 5, 3, 5), "float32"),
        k_features=np.ones((2, 5, 3, 5), "float32"),
        v=np.ones((2, 5, 3, 4), "float32"),
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        lops.linear_attention(**args)


def test_causal_requires_equal_lengths():
    q = np.ones((1, 4, 2, 3), "float32")
    k = np.ones((1, 6, 2, 3), "float32")
    v = np.ones((1, 6, 2, 2), "float32")
    with pytest.raises(ValueError, match="S == T"):
        lops.linear_attention(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_at_padded_positions_does_not_leak(rng, causal):
    q, k, v = _inputs(rng, 20)
    mask = np.ones((B, 20), dtype=bool)
    mask[:, 12:] = False
    clean = np.asarray(lops.linear_attention(q, k, v, causal=causal, key_mask=mask, chunk_size=8))
    k2, v2 = k.copy(), v.copy()
    k2[:, 12:], v2[:, 12:] = np.nan, np.inf
    dirty = np.asarray(lops.linear_attention(q, k2, v2, causal=causal, key_mask=mask, chunk_size=8))
    rows = slice(None) if not causal else slice(0, 12)
    np.testing.assert_array_equal(dirty[:, rows], clean[:, rows])
