"""keras_linattn.ops sliding window (softmax inside the window, kernel attention outside) against float64 oracles.

The blocked path against the quadratic float64 reference, outputs and
gradients; pieces and steps against one pass; the degenerate-only normalizer
guard and underflow (reported, never a silent 0).
"""

import keras
import numpy as np
import pytest

from keras_linattn import ops as lops
from tests.recurrences._common import (
    B,
    C,
    D,
    H,
    M,
    _assert_flagged,
    _features,
    _grads,
    _grouped_inputs,
    _has_key,
    _modes,
    _padding,
    _small_or_negative_keys,
    _underflowing,
)
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


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


# ---------------------------------------------------------------- degenerate-only normalizer guard
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


# ---------------------------------------------------------------- grouped-query attention in the step
def test_a_step_reads_a_grouped_buffer_as_the_repeated_one(rng):
    # G = 2 key/value heads serve H = 6 query heads (head h reads h // 3). The step on the grouped buffer
    # against the same step on the buffer repeated to H heads: outputs, state and buffers over a padded
    # sequence, then the gradients of one step from there (with respect to the grouped inputs).
    heads, kv_heads, window, t = 6, 2, 4, 9
    groups = heads // kv_heads
    repeat = lambda x, axis: np.repeat(np.asarray(x), groups, axis=axis)  # noqa: E731
    q, qf, kf, k, v, mask, gamma = _grouped_inputs(rng, heads, kv_heads, t)
    state = (np.zeros((B, heads, C, M), "float32"), np.zeros((B, heads, C), "float32"))
    grouped = (np.zeros((B, window, kv_heads, D), "float32"), np.zeros((B, window, kv_heads, M), "float32"))
    grouped += (np.zeros((B, window), "float32"),)
    s_ref, wide = state, (repeat(grouped[0], 2), repeat(grouped[1], 2), grouped[2])
    features = np.zeros((B, window, heads, C), "float32")
    for i in range(t):
        o, state, grouped = lops.window_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], grouped, state, mask[:, i], gamma=gamma
        )
        o_ref, s_ref, wide = lops.window_attention_step(
            q[:, i], qf[:, i], repeat(k[:, i], 1), repeat(v[:, i], 1), features[:, 0], wide, s_ref, mask[:, i],
            gamma=gamma,
        )  # fmt: skip
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        assert_close(o, o_ref, n=window + C, what=f"output {i}")
        for part, ref in zip(state, s_ref, strict=True):
            assert_close(part, ref, n=i + 1, paths=2, what=f"state {i}")
        for part, ref, axis in zip(grouped, wide, (2, 2, None), strict=True):
            np.testing.assert_array_equal(np.asarray(part) if axis is None else repeat(part, axis), ref)
    args = (q[:, 0], qf[:, 0], k[:, 0], v[:, 0], grouped[0], grouped[1])
    w = rng.normal(size=(B, heads, M))

    def step(q_, qf_, k_, v_, keys, values, expand):
        buffer = (keys, values, grouped[2])
        if expand:
            rep = lambda x, axis: keras.ops.repeat(x, groups, axis=axis)  # noqa: E731
            k_, v_, buffer = rep(k_, 1), rep(v_, 1), (rep(keys, 2), rep(values, 2), grouped[2])
        return lops.window_attention_step(q_, qf_, k_, v_, features[:, 0], buffer, state, gamma=gamma)[0]

    assert_close(
        _grads(lambda *x: step(*x, False), args, w),
        _grads(lambda *x: step(*x, True), args, w),
        n=window + C + D,
        paths=2,
        what="gradients",
    )


def test_a_step_refuses_key_heads_that_do_not_divide_the_query_heads(rng):
    q, qf = rng.normal(size=(B, 6, D)), np.abs(rng.normal(size=(B, 6, C)))
    k, v = rng.normal(size=(B, 4, D)), rng.normal(size=(B, 4, M))
    buffer = (np.zeros((B, 3, 4, D)), np.zeros((B, 3, 4, M)), np.zeros((B, 3)))
    state = (np.zeros((B, 6, C, M)), np.zeros((B, 6, C)))
    with pytest.raises(ValueError, match="divisor of the query heads H = 6"):
        lops.window_attention_step(q, qf, k, v, qf, buffer, state)
    with pytest.raises(ValueError, match="same number of heads"):
        lops.window_attention_step(q, qf, k, v[:, :2], qf, buffer, state)


@pytest.mark.parametrize("with_gamma", [False, True])
def test_a_step_is_a_one_token_piece_outputs_state_and_gradients(rng, with_gamma):
    # The step against the parallel form (itself checked against the float64 oracle above) on a piece of
    # one token whose keys are the buffer then the new key: outputs, the linear state and, from a buffer
    # with padded slots and a state that is not empty, the gradients with respect to every input.
    window = 5
    q = rng.normal(size=(B, H, D)).astype("float32")
    qf = np.abs(rng.normal(size=(B, H, C))).astype("float32") + 0.05
    k = rng.normal(size=(B, H, D)).astype("float32")
    v = rng.normal(size=(B, H, M)).astype("float32")
    kf_old = np.abs(rng.normal(size=(B, H, C))).astype("float32") + 0.05  # phi of the oldest buffered key
    keys = rng.normal(size=(B, window, H, D)).astype("float32")
    values = rng.normal(size=(B, window, H, M)).astype("float32")
    valid = np.ones((B, window), "float32")
    valid[0, 0] = 0.0  # the key that leaves the window is padding in row 0
    valid[1, 2] = 0.0
    new_ok = np.array([True, False] + [True] * (B - 2))[:B]
    state = tuple(np.abs(rng.normal(size=(B, H) + tail)).astype("float32") for tail in ((C, M), (C,)))
    gamma = np.linspace(0.3, 0.8, H).astype("float32") if with_gamma else None
    w = rng.normal(size=(B, H, M))

    def step(q_, qf_, k_, v_, kf_old_, keys_, values_, s_, z_):
        return lops.window_attention_step(
            q_, qf_, k_, v_, kf_old_, (keys_, values_, valid), (s_, z_), key_mask_t=new_ok, gamma=gamma
        )

    def piece(q_, qf_, k_, v_, kf_old_, keys_, values_, s_, z_):
        # Only the oldest slot's features reach the linear part of the one query (slot W of the keys).
        zero = keras.ops.zeros_like(keras.ops.concatenate([keys_[:, :1, :, :1]] * C, -1))  # [B, 1, H, C]
        kf_all = keras.ops.concatenate([kf_old_[:, None]] + [zero] * window, 1)  # [B, W + 1, H, C]
        k_all = keras.ops.concatenate([keys_, k_[:, None]], 1)
        v_all = keras.ops.concatenate([values_, v_[:, None]], 1)
        ok = np.concatenate([valid > 0, new_ok[:, None]], 1)
        out, st = lops.window_attention(
            q_[:, None], qf_[:, None], k_all, kf_all, v_all, window, ok, initial_state=(s_, z_), return_state=True,
            gamma=gamma,
        )  # fmt: skip
        return out[:, 0], st

    args = (q, qf, k, v, kf_old, keys, values) + state
    out, (s, z), _ = step(*args)
    out_ref, (s_ref, z_ref) = piece(*args)
    assert_close(out, out_ref, n=window + C + D, what="output")
    assert_close(s, s_ref, n=2, what="S")
    assert_close(z, z_ref, n=2, what="z")
    assert_close(
        _grads(lambda *x: step(*x)[0], args, w),
        _grads(lambda *x: piece(*x)[0], args, w),
        n=window + C + D + M,
        paths=2,
        what="gradients",
    )
