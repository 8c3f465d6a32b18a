"""keras_linattn.ops recurrences (decay gates, short convolution, sliding window) against float64 oracles.

Each fast path (chunked, blocked) is compared with its per-token or quadratic
float64 oracle, outputs and gradients, at lengths that are not multiples of
the chunk and with padding; each step with the oracle token by token.
"""

import keras
import numpy as np
import pytest

from keras_linattn import ops as lops
from keras_linattn.ops.decay import CHANNEL_CHUNK
from keras_linattn.ops.delta import DELTA_CHUNK
from tests._backend import flat, gradients
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

B, H, C, M, D = 2, 3, 5, 4, 4


def _features(rng, t):
    q = np.abs(rng.normal(size=(B, t, H, C))).astype("float32") + 0.05
    k = np.abs(rng.normal(size=(B, t, H, C))).astype("float32") + 0.05
    v = rng.normal(size=(B, t, H, M)).astype("float32")
    return q, k, v


def _padding(rng, t):
    mask = np.ones((B, t), dtype=bool)
    mask[0, rng.choice(t, size=t // 4, replace=False)] = False  # scattered
    mask[1, : t // 3] = False  # left padding
    mask[0, 0] = True
    return mask


def _log_decay(rng, t, width, strength=0.5):
    return (-np.abs(rng.normal(size=(B, t, H, width))) * strength).astype("float32")


def _decay_conditioning(g, chunk_size, mask=None):
    """1 + the largest |cumulative log decay| inside one chunk of the fast path.

    The chunked path exponentiates differences of float32 cumulative sums of
    the log decay: the absolute error of such an exponent is about
    ``eps * |cumulative sum|``, which multiplies the relative error of the
    weight it gives (docs/testing.md).
    """
    g = np.abs(np.asarray(g, "float64"))
    if mask is not None:
        g = g * mask[:, :, None, None]
    t = g.shape[1]
    chunk = min(chunk_size, CHANNEL_CHUNK if g.shape[-1] > 1 else chunk_size, t)
    pad = (-t) % chunk
    g = np.pad(g, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(g.shape[0], -1, chunk, *g.shape[2:])
    return 1.0 + float(g.sum(axis=2).max())


def _grads(fn, inputs, w):
    _, grads = gradients(lambda *xs: (keras.ops.sum(keras.ops.cast(fn(*xs), "float64") * w), ()), inputs)
    return flat(grads)


# ------------------------------------------------------------------ decay
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
# T=130 repeats T=65's code path (several chunks and a part at every chunk
# size, 65 = 64 + 1 = 4 * 16 + 1) at twice the cost: `make test-slow` runs it;
# its fast twin is the T=65 case with the same chunk size, width and normalize.
@pytest.mark.parametrize("t", [1, 7, 65, pytest.param(130, marks=pytest.mark.slow)])
def test_gated_matches_oracle_outputs_and_gradients(rng, t, chunk_size, width, normalize):
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    state = (
        np.abs(rng.normal(size=(B, H, C, M))).astype("float32"),
        np.abs(rng.normal(size=(B, H, C))).astype("float32"),
    )
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, k_, v_, g_):
        return lops.gated_linear_attention(
            q_, k_, v_, g_, key_mask=mask, chunk_size=chunk_size, initial_state=state, normalize=normalize
        )

    def oracle(q_, k_, v_, g_):
        return lops.gated_linear_attention_reference(
            q_, k_, v_, g_, key_mask=mask, initial_state=state, normalize=normalize
        )[0]

    cond = _decay_conditioning(g, chunk_size, mask)
    assert_close(fast(q, k, v, g), oracle(q, k, v, g), n=t + C, conditioning=cond, what="outputs")  # T keys, C features
    # Backward adds the sums over the T queries and the M values; the decay's
    # gradient sums over the C features and M values of every later token.
    assert_close(
        _grads(fast, (q, k, v, g), w),
        _grads(oracle, (q, k, v, g), w),
        n=2 * t + 2 * C + M,
        conditioning=cond,
        what="gradients",
    )


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_final_state_and_step_match_the_oracle(rng, width):
    t = 37
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    out, state = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=8, return_state=True)
    ref, ref_state = lops.gated_linear_attention_reference(q, k, v, g, key_mask=mask)
    cond = _decay_conditioning(g, 8, mask)
    for part, expected in zip(state, ref_state, strict=True):
        assert_close(part, expected, n=t, conditioning=cond, what="final state")  # a decayed sum over T keys
    step_state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    outs = []
    for i in range(t):
        o, step_state = lops.gated_linear_attention_step(q[:, i], k[:, i], v[:, i], g[:, i], step_state, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), ref, n=t + C, what="step outputs")
    for part, expected in zip(step_state, ref_state, strict=True):
        assert_close(part, expected, n=t, what="step state")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_strong_decay_over_a_long_sequence_stays_finite_and_exact(rng, width):
    """fla issue #77: exp of a bare cumulative log-decay underflows/overflows. Only differences are exponentiated."""
    t = 700
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width, strength=30.0)  # cumulative log decay ~ -2e4: a bare exp overflows
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, k_, v_, g_):
        return lops.gated_linear_attention(q_, k_, v_, g_, chunk_size=64)

    def oracle(q_, k_, v_, g_):
        return lops.gated_linear_attention_reference(q_, k_, v_, g_)[0]

    out = np.asarray(fast(q, k, v, g))
    assert np.isfinite(out).all()
    cond = _decay_conditioning(g, 64)
    assert_close(out, oracle(q, k, v, g), n=t + C, conditioning=cond, what="outputs")
    grads = _grads(fast, (q, k, v, g), w)
    assert np.isfinite(grads).all()
    assert_close(grads, _grads(oracle, (q, k, v, g), w), n=2 * t + 2 * C + M, conditioning=cond, what="gradients")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_a_padded_step_neither_writes_nor_decays_the_state(rng, width):
    """fla issue #1272: padding must not decay the state."""
    q, k, v = _features(rng, 1)
    g = _log_decay(rng, 1, width, strength=3.0)
    k[0, 0] = np.nan  # junk at a padded position must not leak either
    state = (rng.normal(size=(B, H, C, M)).astype("float32"), np.abs(rng.normal(size=(B, H, C))).astype("float32"))
    mask = np.array([False, True])
    _, new = lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state, mask)
    np.testing.assert_array_equal(np.asarray(new[0])[0], state[0][0])
    np.testing.assert_array_equal(np.asarray(new[1])[0], state[1][0])
    assert not np.allclose(np.asarray(new[0])[1], state[0][1])
    # The parallel path: a left-padded sequence gives the unpadded one's outputs and state.
    t = 20
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = np.ones((B, t), bool)
    mask[:, :6] = False
    out, st = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=8, return_state=True)
    out_u, st_u = lops.gated_linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], chunk_size=8, return_state=True)
    assert_close(np.asarray(out)[:, 6:], out_u, n=t + C, paths=2, what="left-padded outputs")
    for a, b in zip(st, st_u, strict=True):
        assert_close(a, b, n=t, paths=2, what="left-padded state")


def test_no_decay_without_normalizer_is_the_numerator(rng):
    t = 29
    q, k, v = _features(rng, t)
    mask = _padding(rng, t)
    for causal in (True, False):
        out = lops.linear_attention(q, k, v, causal=causal, key_mask=mask, chunk_size=8, normalize=False)
        if causal:
            ref = lops.gated_linear_attention_reference(
                q, k, v, np.zeros((B, t, H, 1), "float32"), key_mask=mask, normalize=False
            )[0]
        else:
            km = mask[:, :, None, None]
            s = np.einsum("bshc,bshm->bhcm", np.where(km, k, 0).astype("float64"), np.where(km, v, 0))
            ref = np.einsum("bthc,bhcm->bthm", q.astype("float64"), s)
        assert_close(out, ref, n=t + C, what=f"causal={causal}")


def test_gated_refuses_bad_log_decay(rng):
    q, k, v = _features(rng, 4)
    with pytest.raises(ValueError, match="`log_decay` must have a last dim of 1"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 4, H, 2), "float32"))
    with pytest.raises(ValueError, match="`log_decay` must have the leading dims"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 5, H, 1), "float32"))
    with pytest.raises(ValueError, match="`log_decay` must have rank 4"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 4, H), "float32"))


# ------------------------------------------------------------ short conv
@pytest.mark.parametrize("method", ["depthwise", "shifted"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_conv_matches_oracle_outputs_and_gradients(rng, t, size, method):
    x = rng.normal(size=(B, t, H, D)).astype("float32")
    kernel = rng.normal(size=(size, H, D)).astype("float32")
    buffer = rng.normal(size=(B, size - 1, H, D)).astype("float32")
    mask = _padding(rng, t)
    x[~mask] = np.nan  # junk at padded positions enters as zero
    w = rng.normal(size=(B, t, H, D))

    def fast(x_, k_, b_):
        return lops.causal_conv(x_, k_, b_, mask, method=method)

    def oracle(x_, k_, b_):
        return lops.causal_conv_reference(x_, k_, b_, mask)

    assert_close(fast(x, kernel, buffer), oracle(x, kernel, buffer), n=size, what="outputs")
    g_fast, g_oracle = _grads(fast, (x, kernel, buffer), w), _grads(oracle, (x, kernel, buffer), w)
    finite = np.isfinite(g_oracle)  # d/dx at NaN inputs is NaN in both: compare the rest
    assert (np.isfinite(g_fast) == finite).all()
    assert_close(g_fast[finite], g_oracle[finite], n=size + t, what="gradients")


def test_conv_pieces_and_steps_equal_one_pass(rng):
    t, size = 11, 4
    x = rng.normal(size=(B, t, H, D)).astype("float32")
    kernel = rng.normal(size=(size, H, D)).astype("float32")
    full, buf = lops.causal_conv(x, kernel, return_buffer=True)
    a, buf_a = lops.causal_conv(x[:, :2], kernel, return_buffer=True)  # shorter than the buffer
    b, buf_b = lops.causal_conv(x[:, 2:], kernel, buf_a, return_buffer=True)
    assert_close(np.concatenate([a, b], 1), full, n=size, paths=2, what="pieces")
    np.testing.assert_array_equal(buf_b, buf)
    state = np.zeros((B, size - 1, H, D), "float32")
    outs = []
    for i in range(t):
        y, state = lops.causal_conv_step(x[:, i], kernel, state)
        outs.append(np.asarray(y))
    assert_close(np.stack(outs, 1), full, n=size, paths=2, what="steps")
    np.testing.assert_array_equal(state, buf)


@pytest.mark.tf_only("tf.function(jit_compile=...) decides the method")
def test_conv_takes_the_shifted_sum_under_xla_and_the_depthwise_kernel_elsewhere(rng, monkeypatch):
    import tensorflow as tf

    from keras_linattn.ops import short_conv

    seen = []
    real = short_conv._shifted_sum
    monkeypatch.setattr(short_conv, "_shifted_sum", lambda *a: seen.append("shifted") or real(*a))
    x = rng.normal(size=(B, 9, H, D)).astype("float32")
    kernel = rng.normal(size=(4, H, D)).astype("float32")
    eager = lops.causal_conv(x, kernel)
    graph = tf.function(lambda x_: lops.causal_conv(x_, kernel))(x)
    assert seen == []  # eager and plain graphs (what export traces) use the depthwise kernel
    xla = tf.function(lambda x_: lops.causal_conv(x_, kernel), jit_compile=True)(x)
    nested = tf.function(lambda x_: tf.function(lambda y: lops.causal_conv(y, kernel))(x_), jit_compile=True)(x)
    assert seen == ["shifted", "shifted"]
    for got in (graph, xla, nested):
        assert_close(got, eager, n=4, paths=2, what="auto method")


def test_conv_refuses_bad_kernels(rng):
    x = rng.normal(size=(B, 5, H, D)).astype("float32")
    with pytest.raises(ValueError, match="K >= 2"):
        lops.causal_conv(x, np.ones((1, H, D), "float32"))
    with pytest.raises(ValueError, match="must have shape"):
        lops.causal_conv(x, np.ones((3, H, D + 1), "float32"))
    with pytest.raises(ValueError, match="`method` must be one of"):
        lops.causal_conv(x, np.ones((3, H, D), "float32"), method="fft")
    with pytest.raises(ValueError, match="`buffer` must have shape"):
        lops.causal_conv(x, np.ones((3, H, D), "float32"), np.zeros((B, 3, H, D), "float32"))


# ---------------------------------------------------------------- window
def _window_inputs(rng, t, window):
    q = rng.normal(size=(B, t, H, D)).astype("float32")
    k = rng.normal(size=(B, t, H, D)).astype("float32")
    qf, kf, v = _features(rng, t)
    return q, k, qf, kf, v


def _with_empty_buffer(k, kf, v, mask, window):
    pad = lambda x: np.concatenate([np.zeros((B, window) + x.shape[2:], x.dtype), x], 1)  # noqa: E731
    return pad(k), pad(kf), pad(v), np.concatenate([np.zeros((B, window), bool), mask], 1)


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("window", [1, 4, 9, 40])
@pytest.mark.parametrize("t", [1, 13, 33])
def test_window_matches_oracle_outputs_and_gradients(rng, t, window, chunk_size):
    q, k, qf, kf, v = _window_inputs(rng, t, window)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, qf_, k_, kf_, v_):
        return lops.window_attention(q_, qf_, k_, kf_, v_, window, ok, chunk_size=chunk_size)

    def oracle(q_, qf_, k_, kf_, v_):
        return lops.window_attention_reference(q_, qf_, k_[:, window:], kf_[:, window:], v_[:, window:], window, mask)

    args = (q, qf, k_all, kf_all, v_all)
    # Window logits (D) and linear weights (C) over T keys.
    assert_close(fast(*args), oracle(*args), n=t + C + D, what="outputs")
    assert_close(_grads(fast, args, w), _grads(oracle, args, w), n=2 * t + C + D + M, what="gradients")


def test_window_pieces_and_steps_equal_one_pass(rng):
    t, window = 23, 5
    q, k, qf, kf, v = _window_inputs(rng, t, window)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    ref = lops.window_attention_reference(q, qf, k, kf, v, window, mask)
    out, state = lops.window_attention(q, qf, k_all, kf_all, v_all, window, ok, return_state=True)
    assert_close(out, ref, n=t + C + D, what="one pass")
    cut = 8
    a, st = lops.window_attention(
        q[:, :cut],
        qf[:, :cut],
        k_all[:, : window + cut],
        kf_all[:, : window + cut],
        v_all[:, : window + cut],
        window,
        ok[:, : window + cut],
        return_state=True,
    )
    b = lops.window_attention(
        q[:, cut:],
        qf[:, cut:],
        k_all[:, cut:],
        kf_all[:, cut:],
        v_all[:, cut:],
        window,
        ok[:, cut:],
        initial_state=st,
    )
    assert_close(np.concatenate([a, b], 1), ref, n=t + C + D, what="two pieces")
    s = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    buffer = (
        np.zeros((B, window, H, D), "float32"),
        np.zeros((B, window, H, M), "float32"),
        np.zeros((B, window), "float32"),
    )
    features = np.zeros((B, window, H, C), "float32")  # phi of the buffered keys, kept beside for the test
    outs = []
    for i in range(t):
        o, s, buffer = lops.window_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], buffer, s, key_mask_t=mask[:, i]
        )
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), ref, n=t + C + D, what="steps")
    for part, expected in zip(s, state, strict=True):
        assert_close(part, expected, n=t, paths=2, what="linear state")


def test_window_refuses_a_buffer_of_the_wrong_length(rng):
    q, k, qf, kf, v = _window_inputs(rng, 6, 3)
    with pytest.raises(ValueError, match="W=3 buffered keys"):
        lops.window_attention(q, qf, k, kf, v, 3)


# ------------------------------------------------------------ delta rule
def _delta_inputs(rng, t):
    q = rng.normal(size=(B, t, H, C)).astype("float32")
    k = rng.normal(size=(B, t, H, C)).astype("float32")
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, t, H, M)).astype("float32")
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, H))))).astype("float32")
    return q, k, v, beta


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated_delta"])
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
# T=70 repeats T=33's code path (a full chunk of DELTA_CHUNK=32 and a part)
# with one more chunk: `make test-slow` runs it; its fast twin is the T=33 case
# with the same chunk size and gating (test_delta_solvers_* also runs T=70).
@pytest.mark.parametrize("t", [1, 7, 33, pytest.param(70, marks=pytest.mark.slow)])
def test_delta_matches_oracle_outputs_and_gradients(rng, t, chunk_size, gated):
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32") if gated else None
    mask = _padding(rng, t)
    s0 = rng.normal(size=(B, H, C, M)).astype("float32")
    w = rng.normal(size=(B, t, H, M))
    inputs = (q, k, v, beta) + ((g,) if gated else ())

    def fast(q_, k_, v_, b_, g_=None):
        return lops.delta_rule_attention(q_, k_, v_, b_, g_, key_mask=mask, chunk_size=chunk_size, initial_state=s0)

    def oracle(q_, k_, v_, b_, g_=None):
        return lops.delta_rule_reference(q_, k_, v_, b_, g_, key_mask=mask, initial_state=s0)[0]

    # Each step is a contraction (|k| = 1, beta <= 1): errors do not grow with
    # t beyond the sums; the chunk adds its triangular solve (L) and the
    # C + M products per step.
    n = t + DELTA_CHUNK + C + M
    cond = 1.0 if g is None else _decay_conditioning(g[..., None], chunk_size, mask)
    assert_close(fast(*inputs), oracle(*inputs), n=n, conditioning=cond, what="outputs")
    assert_close(_grads(fast, inputs, w), _grads(oracle, inputs, w), n=2 * n, conditioning=cond, what="gradients")


@pytest.mark.parametrize("length", [1, 2, 5, 16, 32])
def test_unit_lower_inverse_by_squaring_matches_float64(rng, length):
    from keras_linattn.ops.delta import _unit_lower_inverse

    # What the delta rule feeds it: |a_ij| <= 1 (beta <= 1, unit keys, decay <= 1).
    a = np.tril(rng.uniform(-1, 1, (3, length, length)), -1).astype("float32")
    expected = np.linalg.inv(np.eye(length) + a.astype("float64"))
    # Each entry is a sum over at most 2^(log2 L) paths through products of L factors.
    assert_close(_unit_lower_inverse(a), expected, n=2 * length, what="inverse")


@pytest.mark.parametrize("solver", ["inverse", "substitution"])
def test_delta_solvers_match_oracle_outputs_and_gradients(rng, solver):
    t = 70  # two full chunks of 32 and a part
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32")
    mask = _padding(rng, t)
    w = rng.normal(size=(B, t, H, M))
    inputs = (q, k, v, beta, g)

    def fast(q_, k_, v_, b_, g_):
        return lops.delta_rule_attention(q_, k_, v_, b_, g_, key_mask=mask, chunk_size=32, solver=solver)

    def oracle(q_, k_, v_, b_, g_):
        return lops.delta_rule_reference(q_, k_, v_, b_, g_, key_mask=mask)[0]

    n = t + DELTA_CHUNK + C + M  # as in test_delta_matches_oracle_outputs_and_gradients
    cond = _decay_conditioning(g[..., None], 32, mask)
    assert_close(fast(*inputs), oracle(*inputs), n=n, conditioning=cond, what="outputs")
    assert_close(_grads(fast, inputs, w), _grads(oracle, inputs, w), n=2 * n, conditioning=cond, what="gradients")


def test_delta_refuses_an_unknown_solver(rng):
    q, k, v, beta = _delta_inputs(rng, 4)
    with pytest.raises(ValueError, match="`solver` must be one of"):
        lops.delta_rule_attention(q, k, v, beta, solver="cholesky")


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated_delta"])
def test_delta_step_and_state_match_the_oracle(rng, gated):
    t = 29
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32") if gated else None
    mask = _padding(rng, t)
    ref, ref_state = lops.delta_rule_reference(q, k, v, beta, g, key_mask=mask)
    out, state = lops.delta_rule_attention(q, k, v, beta, g, key_mask=mask, chunk_size=8, return_state=True)
    n = t + DELTA_CHUNK + C + M
    assert_close(state, ref_state, n=n, what="final state")
    s = np.zeros((B, H, C, M), "float32")
    outs = []
    for i in range(t):
        g_i = None if g is None else g[:, i]
        o, s = lops.delta_rule_step(q[:, i], k[:, i], v[:, i], beta[:, i], s, g_i, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), ref, n=n, what="step outputs")
    assert_close(s, ref_state, n=n, what="step state")


def test_delta_overwrites_what_addition_accumulates():
    """One key written twice with beta = 1: the delta rule returns the second value, addition the sum."""
    k = np.zeros((1, 2, 1, C), "float32")
    k[..., 0] = 1.0
    v = np.array([1.0, 5.0], "float32").reshape(1, 2, 1, 1) * np.ones((1, 2, 1, M), "float32")
    beta = np.ones((1, 2, 1), "float32")
    out = np.asarray(lops.delta_rule_attention(k, k, v, beta))
    np.testing.assert_allclose(out[0, 1, 0], 5.0, rtol=1e-6)
    added = np.asarray(lops.gated_linear_attention(k, k, v, np.zeros((1, 2, 1, 1), "float32"), normalize=False))
    np.testing.assert_allclose(added[0, 1, 0], 6.0, rtol=1e-6)


def test_delta_padded_step_leaves_the_state_unchanged(rng):
    q, k, v, beta = _delta_inputs(rng, 1)
    k[0] = np.nan
    s = rng.normal(size=(B, H, C, M)).astype("float32")
    _, new = lops.delta_rule_step(
        q[:, 0], k[:, 0], v[:, 0], beta[:, 0], s, np.full((B, H), -2.0, "float32"), np.array([False, True])
    )
    np.testing.assert_array_equal(np.asarray(new)[0], s[0])
    assert not np.allclose(np.asarray(new)[1], s[1])


def test_delta_refuses_bad_gates(rng):
    q, k, v, beta = _delta_inputs(rng, 4)
    with pytest.raises(ValueError, match="`beta` must have shape"):
        lops.delta_rule_attention(q, k, v, beta[:, :3])
    with pytest.raises(ValueError, match="`log_decay` must have rank 3"):
        lops.delta_rule_attention(q, k, v, beta, np.zeros((B, 4, H, 1), "float32"))
    with pytest.raises(ValueError, match="`initial_state` must be S"):
        lops.delta_rule_attention(q, k, v, beta, initial_state=np.zeros((B, H, C, M + 1), "float32"))


@pytest.mark.tf_only("traces with an unknown length through tf.function(input_signature=...)")
def test_conv_of_an_empty_piece_is_empty_and_keeps_the_buffer(rng):
    import tensorflow as tf

    kernel = rng.normal(size=(4, H, D)).astype("float32")
    buffer = rng.normal(size=(B, 3, H, D)).astype("float32")
    empty = np.zeros((B, 0, H, D), "float32")
    traced = tf.function(
        lambda x: lops.causal_conv(x, kernel, buffer, return_buffer=True),
        input_signature=[tf.TensorSpec((B, None, H, D), tf.float32)],
    )
    for fn in (lambda x: lops.causal_conv(x, kernel, buffer, return_buffer=True), traced):
        y, new = fn(empty)
        assert tuple(y.shape) == (B, 0, H, D)
        np.testing.assert_array_equal(new, buffer)


# ---------------------------------------------------------------- degenerate-only normalizer guard
def _small_or_negative_keys(rng, t, keys):
    """Features whose denominators fall below the old floor ``eps * sum|phi(q)|`` (~4e-6): keys x1e-7 or negative."""
    q, k, v = _features(rng, t)
    k = k * np.float32(1e-7) if keys == "small" else -k  # a signed map's keys, all of one sign: no cancellation
    return q, k, v


def _gated_oracle(q, k, v, g, mask):
    """Exact decayed kernel attention in float64 numpy, from the features (independent of the library)."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    keep = np.asarray(mask, np.float64)[:, :, None, None]
    k, v, g = k * keep, v * keep, g * keep  # a padded step neither writes nor decays
    cum = np.cumsum(g, axis=1)  # [B, T, H, G]
    t = q.shape[1]
    causal = np.tril(np.ones((t, t)))[None, :, :, None, None]  # [1, T(i), T(j), 1, 1]
    w = np.exp(np.minimum(cum[:, :, None] - cum[:, None, :], 0.0)) * causal  # [B, T(i), T(j), H, G]
    a = np.einsum("bihc,bjhc,bijhc->bhij", q, k, np.broadcast_to(w, w.shape[:-1] + (q.shape[-1],)))
    den = a.sum(-1).transpose(0, 2, 1)[..., None]  # [B, T, H, 1]; 0 for a query before any real key (output 0)
    return np.einsum("bhij,bjhm->bihm", a, v) / np.where(den == 0, 1.0, den)


@pytest.mark.parametrize("keys", ["small", "negative"])
@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_divides_small_and_negative_denominators_exactly(rng, width, keys):
    # The guard replaces the denominator only where it is degenerate (|den| <= eps * |phi(q)|.|z|):
    # a row whose keys are small, or a signed map's negative denominator, is the exact ratio.
    t, chunk = 13, 4
    q, k, v = _small_or_negative_keys(rng, t, keys)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    expected = _gated_oracle(q, k, v, g, mask)
    cond = _decay_conditioning(g, chunk, mask)
    out = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=chunk)
    assert_close(out, expected, n=t + C, conditioning=cond, what="chunked")
    ref, _ = lops.gated_linear_attention_reference(q, k, v, g, key_mask=mask)
    assert_close(ref, expected, n=t + C, what="reference")
    state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    outs = []
    for i in range(t):
        o, state = lops.gated_linear_attention_step(q[:, i], k[:, i], v[:, i], g[:, i], state, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), expected, n=t + C, what="steps")


def _window_oracle(q, qf, k, kf, v, window, mask, scale):
    """Exact hybrid (softmax over the window, kernel over older keys) in float64 numpy."""
    q, qf, k, kf, v = (np.asarray(x, np.float64) for x in (q, qf, k, kf, v))
    t = q.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    real = np.asarray(mask, bool)[:, None, None, :]  # [B, 1, 1, T]
    in_window = (j <= i) & (j > i - window) & real  # [B, 1, T, T]
    older = (j <= i - window) & real
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    peak = np.where(in_window, s, -np.inf).max(-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.where(in_window, np.exp(s - peak), 0.0) + np.where(older, np.einsum("bthc,bshc->bhts", qf, kf), 0.0)
    return np.einsum("bhts,bshm->bthm", weights, v) / weights.sum(-1).transpose(0, 2, 1)[..., None]


@pytest.mark.parametrize("keys", ["small", "negative"])
def test_window_divides_small_and_negative_denominators_exactly(rng, keys):
    # Rows whose whole window is padded divide by the linear part alone: small keys (x1e-7) put it below the
    # old floor eps * sum|phi(q)|, a signed map's all-negative keys make it negative; both are exact ratios.
    t, window = 13, 2
    q, k, _, _, _ = _window_inputs(rng, t, window)
    qf, kf, v = _small_or_negative_keys(rng, t, keys)
    mask = np.ones((B, t), bool)
    mask[0, 5:] = False  # rows 6.. see no key in their window, only the 5 older ones
    mask[1, 3:9] = False
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    expected = _window_oracle(q, qf, k, kf, v, window, mask, D**-0.5)
    out = lops.window_attention(q, qf, k_all, kf_all, v_all, window, ok, chunk_size=4)
    assert_close(out, expected, n=t + C + D, what="parallel")
    ref = lops.window_attention_reference(q, qf, k, kf, v, window, mask)
    assert_close(ref, expected, n=t + C + D, what="reference")
    s = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    buffer = (
        np.zeros((B, window, H, D), "float32"),
        np.zeros((B, window, H, M), "float32"),
        np.zeros((B, window), "float32"),
    )
    features = np.zeros((B, window, H, C), "float32")
    outs = []
    for i in range(t):
        o, s, buffer = lops.window_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], buffer, s, key_mask_t=mask[:, i]
        )
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), expected, n=t + C + D, what="steps")


# ---------------------------------------------------------------- underflow is reported, never a silent 0
def _underflowing(rng, t):
    """Positive features ~1e-25: every product phi(q).phi(k) (~1e-50) is below float32's range."""
    q, k, v = _features(rng, t)
    return q * np.float32(1e-25), k * np.float32(1e-25), v


def _has_key(mask, window=0):
    """``[B, T]``: query i has a real key at or before i (window > 0: one that has left its window)."""
    real = np.asarray(mask, bool)
    if window:
        real = np.concatenate([np.zeros((B, window), bool), real], 1)[:, : real.shape[1]]
    return np.cumsum(real, 1) > 0


def _modes(fn):
    """The eager call, and the same call in a graph and under XLA (where nothing can raise)."""
    import tensorflow as tf

    graph = tf.function(fn, autograph=False)
    xla = tf.function(fn, autograph=False, jit_compile=True)
    return graph, xla


def _assert_flagged(out, has_key, what):
    """NaN rows exactly where the row has real keys; exact 0 where it has none."""
    out = np.asarray(out)  # [B, T, H, M]
    nan_rows = np.isnan(out).all(-1)  # [B, T, H]
    np.testing.assert_array_equal(nan_rows, np.broadcast_to(has_key[:, :, None], nan_rows.shape), err_msg=what)
    assert not np.isnan(out[~has_key]).any() and (out[~has_key] == 0).all(), what


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_underflow_raises_eagerly_and_is_nan_in_graphs(rng, width):
    from keras_linattn.ops.core import KernelUnderflowError

    t = 9
    q, k, v = _underflowing(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)  # row 1 starts with 3 padded keys: no key yet, output 0, not an underflow
    with pytest.raises(KernelUnderflowError, match="underflow"):
        lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=4)
    for mode, fn in zip(
        ("graph", "xla"), _modes(lambda *x: lops.gated_linear_attention(*x, key_mask=mask, chunk_size=4)), strict=True
    ):
        _assert_flagged(fn(q, k, v, g), _has_key(mask), f"chunked, {mode}")
    # The step: eagerly it raises at the first real key; in a graph its rows are NaN.
    state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    with pytest.raises(KernelUnderflowError, match="underflow"):
        lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state, mask[:, 0])
    step, _ = _modes(lambda *x: lops.gated_linear_attention_step(*x))
    outs = []
    for i in range(t):
        o, state = step(q[:, i], k[:, i], v[:, i], g[:, i], state, mask[:, i])
        outs.append(np.asarray(o))
    _assert_flagged(np.stack(outs, 1), _has_key(mask), "steps, graph")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_tiny_decayed_state_is_not_an_underflow(rng, width):
    # A state decayed far below its keys (log decay -40 per step), or carried in tiny, is still a state: the
    # rows are the exact ratio, and rows whose keys are all padded are 0, with nothing raised.
    t = 9
    q, k, v = _features(rng, t)
    g = np.full((B, t, H, width), -40.0, "float32")
    mask = _padding(rng, t)
    expected = _gated_oracle(q, k, v, g, mask)
    out = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=4)
    assert_close(out, expected, n=t + C, conditioning=_decay_conditioning(g, 4, mask), what="strong decay")
    tiny = (np.full((B, H, C, M), 1e-25, "float32"), np.full((B, H, C), 1e-25, "float32"))
    none = np.zeros((B, t), bool)  # every key padded: only the carried state
    out = np.asarray(lops.gated_linear_attention(q, k, v, g, key_mask=none, chunk_size=4, initial_state=tiny))
    np.testing.assert_allclose(out, 1.0, rtol=1e-5)  # S / z = 1e-25 / 1e-25 in every row
    o, _ = lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], tiny, none[:, 0])
    np.testing.assert_allclose(np.asarray(o), 1.0, rtol=1e-5)


def test_state_at_the_edge_of_float32_is_flagged(rng):
    # |phi(q)|.|z| at most 2^-103 (within 1/eps32 of the smallest normal float, where products flush to 0): the
    # row is reported (eagerly: raised; in a graph: NaN), in the plain and gated forms, parallel and step.
    # Just above the floor it is the exact ratio.
    from keras_linattn.ops.core import KERNEL_FLOOR, KernelUnderflowError

    t = 5
    q, k, v = _features(rng, t)
    q = np.abs(q) / np.abs(q).sum(-1, keepdims=True)  # sum |phi(q)| = 1: |phi(q)|.|z| = the state's value
    g = np.full((B, t, H, 1), -1.0, "float32")
    none = np.zeros((B, t), bool)
    for value, flagged in ((KERNEL_FLOOR / 2, True), (KERNEL_FLOOR * 4, False)):
        state = (np.full((B, H, C, M), value, "float32"), np.full((B, H, C), value, "float32"))
        runs = {
            "plain": lambda s=state: lops.linear_attention(q, k, v, causal=True, key_mask=none, initial_state=s),
            "gated": lambda s=state: lops.gated_linear_attention(q, k, v, g, key_mask=none, initial_state=s),
            "plain step": lambda s=state: lops.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], s, none[:, 0])[0],
            "gated step": lambda s=state: lops.gated_linear_attention_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], s, none[:, 0]
            )[0],
        }
        for what, run in runs.items():
            if flagged:
                with pytest.raises(KernelUnderflowError, match="2\\^-103"):
                    run()
                graph, _ = _modes(run)
                assert np.isnan(np.asarray(graph())).all(), what
            else:
                out = np.asarray(run())
                assert_close(out, np.ones_like(out), n=C, what=what)  # S q / z q: C products per row


def test_window_underflow_raises_eagerly_and_is_nan_in_graphs(rng):
    # Rows with a real key in their window have softmax terms (the largest is 1): never underflowed, and
    # exact (the linear part, ~1e-50, is nothing next to them). Rows whose window is all padded but that have
    # older real keys divide by the linear part alone: underflowed. Rows with no key at all: 0.
    from keras_linattn.ops.core import KernelUnderflowError

    t, window = 13, 2
    q, k, _, _, _ = _window_inputs(rng, t, window)
    qf, kf, v = _underflowing(rng, t)
    mask = np.ones((B, t), bool)
    mask[0, 5:] = False  # rows 6.. of sequence 0: an empty window, 5 older keys
    mask[1, :2] = False  # rows 0, 1 of sequence 1: no key at all
    mask[1, 5:10] = False  # rows 6..9 of sequence 1: an empty window, older keys
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    real = np.concatenate([np.zeros((B, window), bool), mask], 1)
    in_window = np.stack([real[:, i + 1 : i + 1 + window].any(1) for i in range(t)], 1)  # [B, T]
    flagged = _has_key(mask, window) & ~in_window
    with pytest.raises(KernelUnderflowError, match="underflow"):
        lops.window_attention(q, qf, k_all, kf_all, v_all, window, ok, chunk_size=4)
    expected = _window_oracle(q, qf, k, kf, v, window, mask, D**-0.5)
    for mode, fn in zip(
        ("graph", "xla"), _modes(lambda *x: lops.window_attention(*x, window, ok, chunk_size=4)), strict=True
    ):
        out = np.asarray(fn(q, qf, k_all, kf_all, v_all))
        _assert_flagged(np.where(in_window[:, :, None, None], 0.0, out), flagged, f"parallel, {mode}")
        assert_close(out[in_window], expected[in_window], n=t + C + D, what=f"rows with a window, {mode}")
    step, _ = _modes(lambda *x: lops.window_attention_step(*x))
    s = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    buffer = (
        np.zeros((B, window, H, D), "float32"),
        np.zeros((B, window, H, M), "float32"),
        np.zeros((B, window), "float32"),
    )
    features = np.zeros((B, window, H, C), "float32")
    outs = []
    raised = False
    for i in range(t):
        args = (q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], buffer, s, mask[:, i])
        if flagged[:, i].any() and not raised:
            with pytest.raises(KernelUnderflowError, match="underflow"):
                lops.window_attention_step(*args[:-1], key_mask_t=mask[:, i])
            raised = True
        o, s, buffer = step(*args)
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        outs.append(np.asarray(o))
    assert raised
    out = np.stack(outs, 1)
    _assert_flagged(np.where(in_window[:, :, None, None], 0.0, out), flagged, "steps, graph")
