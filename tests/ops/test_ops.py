"""keras_linattn.ops: the chunked / non-causal / recurrent paths against the quadratic oracle."""

import keras
import numpy as np
import pytest

from keras_linattn import ops as lops
from tests._backend import flat, gradients, xla
from tests.tolerance import assert_close, normalizer_conditioning

# numeric: run again with oneDNN off (`make test-onednn-off`); jax: run again on JAX (`make test-jax`)
pytestmark = [pytest.mark.numeric, pytest.mark.jax]

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
    mask[1, max(1, s - s // 3) :] = False
    mask[:, 0] = True  # causal rows always see at least one key
    return mask


def _grads(fn, q, k, v, w):
    # One flat vector of all gradients: the relative error is taken over the
    # whole gradient (some components, e.g. d/dq at T=1, are exactly zero).
    _, grads = gradients(lambda q_, k_, v_: (keras.ops.sum(fn(q_, k_, v_) * w), ()), (q, k, v))
    return flat(grads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 500])
def test_matches_oracle_outputs_and_gradients(rng, t, chunk_size, causal):
    q, k, v = _inputs(rng, t)
    mask = _padding(rng, t)
    w = rng.normal(size=(B, t, H, M)).astype("float32")

    def fast(q_, k_, v_):
        return lops.linear_attention(q_, k_, v_, causal=causal, key_mask=mask, chunk_size=chunk_size)

    def oracle(q_, k_, v_):  # float64 inside
        return lops.kernel_attention_reference(q_, k_, v_, causal=causal, key_mask=mask)

    assert_close(fast(q, k, v), oracle(q, k, v), n=t + C, what="outputs")  # S keys + C features
    # Backward adds the sums over the T queries (into dk, dv) and over the M values (into dq).
    assert_close(
        _grads(fast, q, k, v, w), _grads(oracle, q, k, v, w), n=t + C + t + M, what="gradients"
    )  # S keys + C features + T queries + M values


@pytest.mark.parametrize("t,s", [(7, 65), (64, 3), (33, 130)])
def test_cross_attention_matches_oracle(rng, t, s):
    q, k, v = _inputs(rng, t, s)
    mask = _padding(rng, s)
    w = rng.normal(size=(B, t, H, M)).astype("float32")

    def fast(q_, k_, v_):
        return lops.linear_attention(q_, k_, v_, key_mask=mask)

    def oracle(q_, k_, v_):  # float64 inside
        return lops.kernel_attention_reference(q_, k_, v_, key_mask=mask)

    assert_close(fast(q, k, v), oracle(q, k, v), n=s + C, what="outputs")  # S keys + C features
    assert_close(
        _grads(fast, q, k, v, w), _grads(oracle, q, k, v, w), n=s + C + t + M, what="gradients"
    )  # S keys + C features + T queries + M values


def test_signed_features_match_oracle(rng):
    """Features with mixed signs (e.g. Taylor) still follow the same algebra."""
    t = 40
    q, k, v = _inputs(rng, t, positive=False)
    # Make kernel values positive overall: a large constant first feature.
    q[..., 0], k[..., 0] = 3.0, 3.0
    for causal in (False, True):
        got = lops.linear_attention(q, k, v, causal=causal, chunk_size=16)
        want = lops.kernel_attention_reference(q, k, v, causal=causal)  # float64 inside
        # Signed features: the normalizer's conditioning multiplies the bound.
        cond = normalizer_conditioning(q, k, causal=causal)
        assert_close(got, want, n=t + C, conditioning=cond, what=f"causal={causal}")  # S keys + C features


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_causal_never_sees_the_future(rng, chunk_size):
    t = 70
    q, k, v = _inputs(rng, t)
    base = np.asarray(lops.linear_attention(q, k, v, causal=True, chunk_size=chunk_size))
    for cut in (0, 15, 16, 40, 69):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        noise = _inputs(np.random.default_rng(cut), t)
        q2[:, cut + 1 :], k2[:, cut + 1 :], v2[:, cut + 1 :] = (x[:, cut + 1 :] * 7.0 for x in noise)
        out = np.asarray(lops.linear_attention(q2, k2, v2, causal=True, chunk_size=chunk_size))
        np.testing.assert_array_equal(out[:, : cut + 1], base[:, : cut + 1])
        if cut + 1 < t:
            assert not np.array_equal(out[:, cut + 1 :], base[:, cut + 1 :])


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
        q,
        k,
        v,
        np.ones((B, 20, H, M), "float32"),
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
                q[:, lo:hi],
                k[:, lo:hi],
                v[:, lo:hi],
                causal=True,
                chunk_size=8,
                initial_state=state,
                return_state=True,
            )
            pieces.append(np.asarray(out))
        # Two float32 computations (pieces, one pass): paths=2.
        assert_close(np.concatenate(pieces, axis=1), full, n=t + C, paths=2, what="outputs")  # S keys + C features
    else:
        # Non-causal: the state from the first half plus the second half equals all keys.
        _, state = lops.linear_attention(q, k[:, :20], v[:, :20], return_state=True)
        out, state = lops.linear_attention(q, k[:, 20:], v[:, 20:], initial_state=state, return_state=True)
        assert_close(out, full, n=t + C, paths=2, what="outputs")  # S keys + C features
    assert_close(state[0], s_full, n=t, paths=2, what="S")  # S keys
    assert_close(state[1], z_full, n=t, paths=2, what="z")  # S keys
    # The state is sum_j phi(k_j) v_j^T and sum_j phi(k_j), computed independently here (float64).
    k64, v64 = k.astype("float64"), v.astype("float64")
    assert_close(s_full, np.einsum("bshc,bshm->bhcm", k64, v64), n=t, what="S vs float64")  # S keys
    assert_close(z_full, k64.sum(axis=1), n=t, what="z vs float64")  # S keys


def test_step_equals_parallel(rng):
    t = 23
    q, k, v = _inputs(rng, t)
    full = np.asarray(lops.linear_attention(q, k, v, causal=True, chunk_size=8))
    state = lops.core._zero_state(B, H, C, M)
    outs = []
    for i in range(t):
        out, state = lops.linear_attention_step(q[:, i], k[:, i], v[:, i], state)
        outs.append(np.asarray(out))
    # Two float32 computations (recurrent, chunked): paths=2.
    assert_close(np.stack(outs, axis=1), full, n=t + C, paths=2)  # S keys + C features


def _numpy_softmax_attention(q, k, v):
    """Softmax attention in float64 NumPy, ``D ** -0.5`` scaled logits."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshm->bthm", p, v)


def test_softmax_reference_matches_numpy(rng):
    t, s, d = 6, 9, 8
    q = rng.normal(size=(B, t, H, d))
    k = rng.normal(size=(B, s, H, d))
    v = rng.normal(size=(B, s, H, M))
    # float32 inputs: computed in float64 and returned in float32.
    q32, k32, v32 = (x.astype("float32") for x in (q, k, v))
    got = lops.softmax_attention(q32, k32, v32)
    assert got.dtype == "float32"
    assert_close(got, _numpy_softmax_attention(q32, k32, v32), n=d + s, what="float32")  # D logits + S keys
    # float64 inputs: the oracle is a float64 computation.
    got = lops.softmax_attention(q, k, v)
    assert_close(got, _numpy_softmax_attention(q, k, v), n=d + s, dtype="float64", what="float64")  # D + S


@pytest.mark.parametrize("policy_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs_accumulate_in_float32(rng, policy_dtype, causal):
    t, c = 4096, 8
    q = np.abs(rng.normal(size=(1, t, 2, c))).astype("float32")
    k = np.abs(rng.normal(size=(1, t, 2, c))).astype("float32")
    v = rng.normal(size=(1, t, 2, c)).astype("float32")
    # float32 reference: its own error, bound(float32, S + C) ~ 3e-5, is negligible next to
    # the low-precision bound below, so paths=1.
    ref = np.asarray(lops.linear_attention(q, k, v, causal=causal))
    cast = keras.ops.cast
    low = lops.linear_attention(cast(q, policy_dtype), cast(k, policy_dtype), cast(v, policy_dtype), causal=causal)
    assert keras.backend.standardize_dtype(low.dtype) == policy_dtype
    low = keras.ops.convert_to_numpy(cast(low, "float32"))
    # policy_dtype rounds elementwise only (the inputs and the output): no reduction rounds in
    # it, so n=1. Sums over the S = 4096 keys rounded in policy_dtype would need n = S + C
    # (a bf16 bound of 2.0: no test); accumulating (S, z) in float32 is what this checks.
    assert_close(low, ref, n=1, dtype=policy_dtype)


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


# ------------------------------------------------------ pieces of the fast paths
@pytest.mark.parametrize(
    "n,group", [(1, None), (7, None), (15, None), (16, 4), (36, 6), (128, 8), (130, 10), (500, 20), (None, None)]
)
def test_two_level_group_is_the_largest_divisor_up_to_the_square_root(n, group):
    from keras_linattn.ops.core import _two_level_group

    assert _two_level_group(n) == group


@pytest.mark.parametrize("n", [1, 5, 16, 36, 130])
def test_chunk_prefix_is_the_exclusive_cumulative_sum(rng, n):
    # One level below N=16, two levels from N=16 (G=4) up; outputs and
    # gradients (the gradient of an exclusive prefix sum is the reversed one).
    from keras_linattn.ops.core import _chunk_prefix

    x = rng.normal(size=(2, 3, n, 4, 5)).astype("float32")  # [B, H, N, C, M]
    w = rng.normal(size=x.shape).astype("float32")
    expected = np.cumsum(x.astype("float64"), axis=2) - x
    expected_grad = np.flip(np.cumsum(np.flip(w.astype("float64"), 2), axis=2), 2) - w
    out, (grad,) = gradients(lambda x_: (keras.ops.sum(_chunk_prefix(x_) * w), _chunk_prefix(x_)), (x,))
    assert_close(out, expected, n=n, what="prefix")
    assert_close(grad, expected_grad, n=n, what="gradient")


def test_divide_rows_gradient_equals_autodiff_of_the_division(rng):
    from keras_linattn.ops.core import _divide_rows

    num = rng.normal(size=(2, 3, 7, 4)).astype("float32")
    den = (np.abs(rng.normal(size=(2, 3, 7, 1))) + 0.1).astype("float32")
    w = rng.normal(size=num.shape).astype("float32")
    fast, fast_grads = gradients(lambda a, b: (keras.ops.sum(_divide_rows(a, b) * w), _divide_rows(a, b)), (num, den))
    plain, plain_grads = gradients(lambda a, b: (keras.ops.sum(a / b * w), a / b), (num, den))
    # Two float32 computations: each carries its own rounding (paths=2).
    assert_close(fast, plain, n=1, paths=2, what="outputs")
    assert_close(flat(fast_grads), flat(plain_grads), n=4, paths=2, what="gradients")  # a sum over M=4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "xla"])
def test_guard_gradient_reaches_the_queries(rng, compiled):
    # Signed features whose denominators sit below the guard for some
    # queries: there d out / d q goes through eps * sum|q| (the `maximum`
    # and the guard are differentiated as written).
    from keras_linattn.ops.core import _TINY, _normalize

    q = rng.normal(size=(1, 2, 6, 5)).astype("float32")
    num = rng.normal(size=(1, 2, 6, 4)).astype("float32")
    eps = 1e-2
    guard = eps * np.abs(q).sum(-1, keepdims=True)  # [1, 2, 6, 1]
    # Rows alternate: the denominator at twice the guard, at half of it, negative.
    den = (guard * np.array([2.0, 0.5, -1.0, 2.0, 0.5, -1.0])[:, None]).astype("float32")
    w = rng.normal(size=num.shape).astype("float32")

    def plain(q_, num_, den_):
        guard = eps * keras.ops.sum(keras.ops.abs(q_), axis=-1, keepdims=True) + _TINY
        return num_ / keras.ops.maximum(den_, guard)

    # Under XLA `_normalize` divides plainly; eagerly through `_divide_rows`.
    normalize = xla(lambda *a: _normalize(*a, eps)) if compiled else (lambda *a: _normalize(*a, eps))
    _, fast_grads = gradients(lambda *a: (keras.ops.sum(normalize(*a) * w), ()), (q, num, den))
    _, plain_grads = gradients(lambda *a: (keras.ops.sum(plain(*a) * w), ()), (q, num, den))
    assert np.abs(fast_grads[0]).max() > 0
    # Sums over C=5 (the guard) and M=4; two float32 computations (paths=2).
    assert_close(flat(fast_grads), flat(plain_grads), n=5 + 4, paths=2, what="gradients")
