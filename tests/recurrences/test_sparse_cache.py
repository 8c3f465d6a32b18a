"""The sparse global cache (LoLA): window + cache of hard-to-recall pairs + linear state, against float64 oracles.

The parallel form (a loop for the selection, chunked linear part, blocked
softmax) against the per-token float64 reference, outputs and gradients;
pieces and steps against one pass; the limits (N = 0 is the window
recurrence, ``W + N >= T`` is softmax attention); padding; the eviction
rule on hand-made pairs; the shorthand and `linearize`.
"""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn import ops as lops
from keras_linattn import recurrences
from keras_linattn.layers import AttentionSpec, LinearAttention
from keras_linattn.recurrences import SparseCacheRecurrence, WindowRecurrence
from tests.recurrences._common import B, C, D, H, M, _features, _grads, _grouped_inputs, _padding
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def _inputs(rng, t):
    q = rng.normal(size=(B, t, H, D)).astype("float32")
    k = rng.normal(size=(B, t, H, D)).astype("float32")
    qf, kf, v = _features(rng, t)
    return q, k, qf, kf, v


def _with_empty_buffer(k, kf, v, mask, window):
    pad = lambda x: np.concatenate([np.zeros((B, window) + x.shape[2:], x.dtype), x], 1)  # noqa: E731
    return pad(k), pad(kf), pad(v), np.concatenate([np.zeros((B, window), bool), mask], 1)


def _empty_state(window, cache_size):
    state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    buffer = (
        np.zeros((B, window, H, D), "float32"),
        np.zeros((B, window, H, M), "float32"),
        np.zeros((B, window), "float32"),
    )
    cache = tuple(np.zeros((B, cache_size, H) + tail, "float32") for tail in ((D,), (C,), (M,), ()))
    return state, buffer, cache


def _steps(q, k, qf, kf, v, mask, window, cache_size):
    """Token by token from an empty state; returns ``(out [B, T, H, M], state, cache)``."""
    state, buffer, cache = _empty_state(window, cache_size)
    features = np.zeros((B, window, H, C), "float32")  # phi of the buffered keys, kept beside for the test
    outs = []
    for i in range(q.shape[1]):
        o, state, buffer, cache = lops.sparse_cache_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], buffer, cache, state, key_mask_t=mask[:, i]
        )
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        outs.append(np.asarray(o))
    return np.stack(outs, 1), state, cache


# Window and cache logits (D), linear weights (C), over T keys.
def _n(t):
    return t + C + D


@pytest.mark.parametrize(
    ("t", "window", "cache_size", "chunk_size"),
    [(1, 3, 2, 4), (13, 1, 1, 4), (13, 3, 2, 4), (23, 4, 3, 64), (33, 2, 5, 8)],
)
def test_sparse_cache_matches_oracle_outputs_and_gradients(rng, t, window, cache_size, chunk_size):
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, qf_, k_, kf_, v_):
        return lops.sparse_cache_attention(q_, qf_, k_, kf_, v_, window, cache_size, ok, chunk_size=chunk_size)

    def oracle(q_, qf_, k_, kf_, v_):
        return lops.sparse_cache_attention_reference(
            q_, qf_, k_[:, window:], kf_[:, window:], v_[:, window:], window, cache_size, mask
        )

    args = (q, qf, k_all, kf_all, v_all)
    assert_close(fast(*args), oracle(*args), n=_n(t), what="outputs")
    assert_close(_grads(fast, args, w), _grads(oracle, args, w), n=2 * _n(t) + M, what="gradients")


def test_sparse_cache_pieces_and_steps_equal_one_pass(rng):
    t, window, cache_size = 23, 3, 2
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    ref = lops.sparse_cache_attention_reference(q, qf, k, kf, v, window, cache_size, mask)
    out, state, cache = lops.sparse_cache_attention(
        q, qf, k_all, kf_all, v_all, window, cache_size, ok, return_state=True, chunk_size=4
    )
    assert_close(out, ref, n=_n(t), what="one pass")
    # The cache is in use: some pairs were evicted into the state and the cache is full.
    assert np.asarray(state[1]).any() and np.asarray(cache[3]).all()
    cut = 8
    piece = lambda x, a, b: x[:, a:b]  # noqa: E731
    first, st, ch = lops.sparse_cache_attention(
        *(piece(x, 0, cut) for x in (q, qf)),
        *(piece(x, 0, window + cut) for x in (k_all, kf_all, v_all)),
        window,
        cache_size,
        ok[:, : window + cut],
        return_state=True,
        chunk_size=4,
    )
    second, st2, ch2 = lops.sparse_cache_attention(
        *(piece(x, cut, None) for x in (q, qf)),
        *(piece(x, cut, None) for x in (k_all, kf_all, v_all)),
        window,
        cache_size,
        ok[:, cut:],
        initial_state=st,
        initial_cache=ch,
        return_state=True,
        chunk_size=4,
    )
    assert_close(np.concatenate([first, second], 1), ref, n=_n(t), what="two pieces")
    for name, a, b in zip(("S", "z", "keys", "features", "values", "valid"), st2 + ch2, state + cache, strict=True):
        assert_close(a, b, n=t, paths=2, what=f"pieces: {name}")
    steps, s, c = _steps(q, k, qf, kf, v, mask, window, cache_size)
    assert_close(steps, ref, n=_n(t), what="steps")
    for name, a, b in zip(("S", "z", "keys", "features", "values", "valid"), s + c, state + cache, strict=True):
        assert_close(a, b, n=t, paths=2, what=f"steps: {name}")


@pytest.mark.tf_only("eager execution and tf.function are TensorFlow's")
def test_an_eager_call_runs_the_token_loop_as_one_traced_function(rng):
    # Eagerly, the token loop would dispatch every op of every token from Python (21.5 s against 0.48 s
    # for a 2-layer model at T = 512): an eager call runs it as a function, traced once per shape.
    import tensorflow as tf

    from keras_linattn.ops import _sparse_selection as sc

    t, window, cache_size = 19, 3, 2
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    args = (q, qf, k_all, kf_all, v_all)
    w = rng.normal(size=(B, t, H, M))

    def attend(*xs):
        return lops.sparse_cache_attention(*xs, window, cache_size, ok, chunk_size=4)

    eager = attend(*args)
    compiled = sc._COMPILED_SELECTION[0]
    traces = compiled.experimental_get_tracing_count()
    again = attend(*(x + 0.0 for x in args))  # other values, same shapes: no new trace
    assert compiled.experimental_get_tracing_count() == traces
    assert np.array_equal(np.asarray(again), np.asarray(eager))
    # The same op traced inside a function (the loop inlined there), outputs and gradients.
    traced = tf.function(attend, autograph=False)
    assert_close(eager, traced(*args), n=_n(t), paths=2, what="eager vs traced")
    assert_close(_grads(attend, args, w), _grads(traced, args, w), n=2 * _n(t) + M, paths=2, what="gradients")
    ref = lops.sparse_cache_attention_reference(q, qf, k, kf, v, window, cache_size, mask)
    assert_close(eager, ref, n=_n(t), what="eager vs oracle")


def test_without_a_cache_it_is_the_window(rng):
    t, window = 17, 3
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    out = lops.sparse_cache_attention(q, qf, k_all, kf_all, v_all, window, 0, ok, chunk_size=4)
    expected = lops.window_attention(q, qf, k_all, kf_all, v_all, window, ok, chunk_size=4)
    assert_close(out, expected, n=_n(t), paths=2, what="N=0 vs window")
    ref = lops.sparse_cache_attention_reference(q, qf, k, kf, v, window, 0, mask)
    assert_close(ref, lops.window_attention_reference(q, qf, k, kf, v, window, mask), n=_n(t), what="oracles")
    steps, _, _ = _steps(q, k, qf, kf, v, mask, window, 0)
    assert_close(steps, expected, n=_n(t), paths=2, what="N=0 steps vs window")


@pytest.mark.parametrize(("window", "cache_size"), [(4, 9), (1, 12), (10, 3)])
def test_window_and_cache_covering_the_sequence_is_softmax_attention(rng, window, cache_size):
    t = 13
    q, k, qf, kf, v = _inputs(rng, t)
    mask = np.ones((B, t), bool)
    mask[1, :4] = False  # a left-padded row
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    expected = np.asarray(lops.softmax_attention(q, k, v, causal=True, key_mask=mask))
    out, state, _ = lops.sparse_cache_attention(
        q, qf, k_all, kf_all, v_all, window, cache_size, ok, return_state=True, gamma=np.full((H,), 0.3, "float32")
    )
    rows = np.cumsum(mask, 1) > 0  # rows with a real key (a row before any is 0 in both)
    assert_close(np.asarray(out)[rows], expected[rows], n=t + D, what="W + N >= T vs softmax")
    assert not np.asarray(state[1]).any(), "nothing reaches the linear state"
    steps, _, _ = _steps(q, k, qf, kf, v, mask, window, cache_size)
    assert_close(steps[rows], expected[rows], n=t + D, what="steps vs softmax")


def test_left_padded_rows_equal_unpadded_rows(rng):
    t, pad, window, cache_size = 15, 4, 2, 2
    q, k, qf, kf, v = _inputs(rng, t)
    mask = np.ones((B, t), bool)
    mask[:, :pad] = False
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    padded = lops.sparse_cache_attention(q, qf, k_all, kf_all, v_all, window, cache_size, ok)
    cut = lambda x: x[:, pad:]  # noqa: E731
    k_u, kf_u, v_u, ok_u = _with_empty_buffer(cut(k), cut(kf), cut(v), mask[:, pad:], window)
    unpadded = lops.sparse_cache_attention(cut(q), cut(qf), k_u, kf_u, v_u, window, cache_size, ok_u)
    assert_close(np.asarray(padded)[:, pad:], unpadded, n=_n(t), paths=2, what="left padding")


def test_padded_keys_enter_no_memory(rng):
    # Junk (huge keys, features and values) at padded positions changes nothing: a padded pair is never a
    # candidate, so it reaches neither the cache nor the state, and the window never attends to it.
    t, window, cache_size = 19, 2, 2
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    junk = lambda x: np.where(mask[:, :, None, None], x, np.float32(1e4))  # noqa: E731
    k_c, kf_c, v_c, ok = _with_empty_buffer(k, kf, v, mask, window)
    clean = lops.sparse_cache_attention(q, qf, k_c, kf_c, v_c, window, cache_size, ok, return_state=True)
    k_j, kf_j, v_j, _ = _with_empty_buffer(junk(k), junk(kf), junk(v), mask, window)
    dirty = lops.sparse_cache_attention(q, qf, k_j, kf_j, v_j, window, cache_size, ok, return_state=True)
    np.testing.assert_array_equal(np.asarray(dirty[0]), np.asarray(clean[0]))
    for a, b in zip(dirty[1] + dirty[2], clean[1] + clean[2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- the eviction rule, by hand
def _pairs(features, values, h=1):
    """One sequence, one head per row: keys (random: only the softmax sees them), features and values."""
    kf = np.asarray(features, "float32")[None, :, None, :].repeat(h, 2)  # [1, T, H, C]
    v = np.asarray(values, "float32")[None, :, None, :].repeat(h, 2)  # [1, T, H, M]
    k = np.random.default_rng(0).normal(size=kf.shape[:3] + (2,)).astype("float32")
    return k, kf, v


def _run_one(k, kf, v, window, cache_size, initial_state=None):
    t = k.shape[1]
    pad = lambda x: np.concatenate([np.zeros((1, window) + x.shape[2:], "float32"), x], 1)  # noqa: E731
    ok = np.concatenate([np.zeros((1, window)), np.ones((1, t))], 1) > 0
    return lops.sparse_cache_attention(
        k, kf, pad(k), pad(kf), pad(v), window, cache_size, ok, initial_state=initial_state, return_state=True
    )


# ---------------------------------------------------------------- grouped-query attention in the step
def test_a_step_reads_a_grouped_window_as_the_repeated_one(rng):
    # G = 2 key/value heads serve H = 6 query heads (head h reads h // 3). Steps on the grouped window
    # against the same steps on the window repeated to H heads, over a padded sequence long enough for
    # pairs to leave the window, fill the cache and be evicted: outputs, state, buffers and cache; then the
    # gradients of one step from there (with respect to the grouped inputs).
    heads, kv_heads, window, cache_size, t = 6, 2, 3, 2, 11
    groups = heads // kv_heads
    repeat = lambda x, axis: np.repeat(np.asarray(x), groups, axis=axis)  # noqa: E731
    q, qf, kf, k, v, mask, gamma = _grouped_inputs(rng, heads, kv_heads, t)
    state = (np.zeros((B, heads, C, M), "float32"), np.zeros((B, heads, C), "float32"))
    grouped = (np.zeros((B, window, kv_heads, D), "float32"), np.zeros((B, window, kv_heads, M), "float32"))
    grouped += (np.zeros((B, window), "float32"),)
    cache = tuple(np.zeros((B, cache_size, heads) + tail, "float32") for tail in ((D,), (C,), (M,), ()))
    s_ref, wide, c_ref = state, (repeat(grouped[0], 2), repeat(grouped[1], 2), grouped[2]), cache
    features = np.zeros((B, window, heads, C), "float32")
    for i in range(t):
        o, state, grouped, cache = lops.sparse_cache_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], grouped, cache, state, mask[:, i], gamma=gamma
        )
        o_ref, s_ref, wide, c_ref = lops.sparse_cache_attention_step(
            q[:, i], qf[:, i], repeat(k[:, i], 1), repeat(v[:, i], 1), features[:, 0], wide, c_ref, s_ref,
            mask[:, i], gamma=gamma,
        )  # fmt: skip
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        assert_close(o, o_ref, n=window + cache_size + C, what=f"output {i}")
        for part, ref in zip(state, s_ref, strict=True):
            assert_close(part, ref, n=i + 1, paths=2, what=f"state {i}")
        for part, ref, axis in zip(grouped, wide, (2, 2, None), strict=True):
            np.testing.assert_array_equal(np.asarray(part) if axis is None else repeat(part, axis), ref)
        for part, ref in zip(cache, c_ref, strict=True):
            np.testing.assert_array_equal(np.asarray(part), np.asarray(ref))
    # The run used the cache and the state: pairs were admitted and some evicted into (S, z).
    assert np.asarray(cache[3]).all() and np.asarray(state[1]).any()
    args = (q[:, 0], qf[:, 0], k[:, 0], v[:, 0], grouped[0], grouped[1])
    w = rng.normal(size=(B, heads, M))

    def step(q_, qf_, k_, v_, keys, values, expand):
        buffer = (keys, values, grouped[2])
        if expand:
            rep = lambda x, axis: keras.ops.repeat(x, groups, axis=axis)  # noqa: E731
            k_, v_, buffer = rep(k_, 1), rep(v_, 1), (rep(keys, 2), rep(values, 2), grouped[2])
        return lops.sparse_cache_attention_step(q_, qf_, k_, v_, features[:, 0], buffer, cache, state, gamma=gamma)[0]

    assert_close(
        _grads(lambda *x: step(*x, False), args, w),
        _grads(lambda *x: step(*x, True), args, w),
        n=window + cache_size + C + D,
        paths=2,
        what="gradients",
    )


def test_a_step_refuses_window_heads_that_do_not_divide_the_query_heads(rng):
    q, qf = rng.normal(size=(B, 6, D)), np.abs(rng.normal(size=(B, 6, C)))
    k, v = rng.normal(size=(B, 4, D)), rng.normal(size=(B, 4, M))
    buffer = (np.zeros((B, 3, 4, D)), np.zeros((B, 3, 4, M)), np.zeros((B, 3)))
    cache = tuple(np.zeros((B, 2, 6) + tail) for tail in ((D,), (C,), (M,), ()))
    state = (np.zeros((B, 6, C, M)), np.zeros((B, 6, C)))
    with pytest.raises(ValueError, match="divisor of the query heads H = 6"):
        lops.sparse_cache_attention_step(q, qf, k, v, qf, buffer, cache, state)
    with pytest.raises(ValueError, match="same number of heads"):
        lops.sparse_cache_attention_step(q, qf, k, v[:, :2], qf, buffer, cache, state)


def test_the_pair_the_state_recalls_best_is_evicted():
    # W = 1, N = 1. The linear state already holds phi = [1, 0] -> v = [3, 4]. Token 0 (phi [0, 1], v [1, 0])
    # leaves the window at query 1 and takes the free slot. At query 2 token 1 (phi [1, 0], v [3, 4]) leaves:
    # the state recalls it exactly (error 0) while it cannot recall token 0 (error 1), so token 1 goes into
    # the state although it is the newer pair with the larger value; token 0 stays cached.
    k, kf, v = _pairs([[0, 1], [1, 0], [0.5, 0.5]], [[1, 0], [3, 4], [0, 1]])
    s0 = np.array([[[[3, 4], [0, 0]]]], "float32")  # [1, 1, C=2, M=2]
    z0 = np.array([[[1, 0]]], "float32")  # [1, 1, 2]
    _, (s, z), (ck, ckf, cv, cok) = _run_one(k, kf, v, 1, 1, (s0, z0))
    np.testing.assert_array_equal(np.asarray(cv)[0, :, 0], [[1, 0]])
    np.testing.assert_array_equal(np.asarray(ckf)[0, :, 0], [[0, 1]])
    np.testing.assert_array_equal(np.asarray(cok), [[[1.0]]])
    np.testing.assert_array_equal(np.asarray(s)[0, 0], [[6, 8], [0, 0]])
    np.testing.assert_array_equal(np.asarray(z)[0, 0], [2, 0])


def test_a_tie_evicts_the_older_pair_and_the_oracle_agrees():
    # W = 1, N = 1, an empty state: every error is |v|^2. At query 2 tokens 0 and 1 both score 1 (a tie):
    # the older, token 0 (phi [1, 0] -> v [1, 0]), goes into the state. At query 3 the state recalls
    # nothing for phi [0, 1] (phi . z = 0: the prediction is 0), so token 1 scores |v|^2 = 1 and token 2
    # scores 4: token 1 goes into the state and token 2 stays cached.
    k, kf, v = _pairs([[1, 0], [0, 1], [0, 1], [1, 1]], [[1, 0], [0, 1], [2, 0], [0, 0]])
    out, (s, z), (_, _, cv, _) = _run_one(k, kf, v, 1, 1)
    np.testing.assert_array_equal(np.asarray(cv)[0, :, 0], [[2, 0]])
    np.testing.assert_array_equal(np.asarray(s)[0, 0], [[1, 0], [0, 1]])
    np.testing.assert_array_equal(np.asarray(z)[0, 0], [1, 1])
    ref = lops.sparse_cache_attention_reference(k, kf, k, kf, v, 1, 1)
    assert_close(out, ref, n=4 + 2 + 2, what="outputs vs oracle")


def test_decisions_are_per_head():
    # Two heads see the same pairs but different states: head 0 recalls token 1 exactly, head 1 recalls
    # nothing; head 0 evicts token 1, head 1 evicts token 0 (the tie |v|^2 = 1 goes to the older).
    k, kf, v = _pairs([[0, 1], [1, 0], [0.5, 0.5]], [[1, 0], [0, 1], [0, 1]], h=2)
    s0 = np.zeros((1, 2, 2, 2), "float32")
    z0 = np.zeros((1, 2, 2), "float32")
    s0[0, 0] = [[0, 1], [0, 0]]
    z0[0, 0] = [1, 0]
    _, _, (_, ckf, _, _) = _run_one(k, kf, v, 1, 1, (s0, z0))
    np.testing.assert_array_equal(np.asarray(ckf)[0, 0], [[0, 1], [1, 0]])  # [H, C]: head 0 keeps token 0


# ---------------------------------------------------------------- the recurrence in the layer
def _layers(recurrence_a, recurrence_b, **kwargs):
    a = LinearAttention(2, 8, chunk_size=4, recurrence=recurrence_a, **kwargs)
    b = LinearAttention(2, 8, chunk_size=4, recurrence=recurrence_b, **kwargs)
    for layer in (a, b):
        layer.build((None, None, 16), (None, None, 16))
    for w_a, w_b in zip(a.weights, b.weights, strict=True):
        w_b.assign(w_a)
    return a, b


def test_a_layer_without_a_cache_is_the_window_layer(rng):
    window, sparse = _layers(WindowRecurrence(3, gamma=0.25), SparseCacheRecurrence(3, 0, gamma=0.25))
    x = rng.normal(size=(2, 11, 16)).astype("float32")
    mask = np.ones((2, 11), bool)
    mask[1, :3] = False
    n = 11 + 8 + 8 + 2 * 8  # keys, features, key dims, the output projection
    assert_close(
        sparse(x, x, key_mask=mask, use_causal_mask=True),
        window(x, x, key_mask=mask, use_causal_mask=True),
        n=n,
        paths=2,
    )
    s_w, s_s = window.get_initial_state(2), sparse.get_initial_state(2)
    for t in range(4):
        o_w, s_w = window.step(x[:, t], x[:, t], s_w)
        o_s, s_s = sparse.step(x[:, t], x[:, t], s_s)
        assert_close(o_s, o_w, n=n, paths=2, what=f"step {t}")


def test_state_size_does_not_grow_with_the_length(rng):
    layer = LinearAttention(2, 8, chunk_size=4, conv_size=None, recurrence=SparseCacheRecurrence(3, 2))  # no buffers
    shapes = []
    for t in (5, 40):
        x = rng.normal(size=(1, t, 16)).astype("float32")
        _, state = layer(x, x, use_causal_mask=True, return_state=True)
        shapes.append([tuple(s.shape) for s in state])
    assert shapes[0] == shapes[1]
    names = [e.name for e in layer.state_spec()]
    assert names == ["S", "z", "window_k", "window_v", "window_valid", "cache_k", "cache_v", "cache_valid"]
    assert dict(zip(names, shapes[0], strict=True))["cache_valid"] == (1, 2, 2)


def test_mixed_bfloat16_covering_the_sequence_is_close_to_float32(rng):
    # With W + N >= T no decision is made (the cache never fills), so bfloat16 rounding cannot flip one.
    x = rng.normal(size=(2, 9, 16)).astype("float32")
    ref = LinearAttention(2, 8, chunk_size=4, recurrence=SparseCacheRecurrence(4, 5))
    expected = ref(x, x, use_causal_mask=True)
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = LinearAttention(2, 8, chunk_size=4, recurrence=SparseCacheRecurrence(4, 5))
    layer.build((None, None, 16), (None, None, 16))
    for w_ref, w in zip(ref.weights, layer.weights, strict=True):
        w.assign(w_ref)
    out, state = layer(x, x, use_causal_mask=True, return_state=True)
    assert all(part.dtype == "float32" for part in state)
    assert_close(out, expected, n=16 + 9 + 8 + 16, dtype="bfloat16", what="bf16 vs float32")


# ---------------------------------------------------------------- the shorthand and linearize
def test_the_shorthand_builds_the_sparse_cache():
    spec = AttentionSpec.create("elu", window_size=4, cache_size=2, window_gamma=0.2)
    recurrence = spec.make_recurrence()
    assert isinstance(recurrence, SparseCacheRecurrence)
    assert recurrence.get_config() == {"window_size": 4, "cache_size": 2, "gamma": 0.2}
    assert isinstance(AttentionSpec.create("elu", window_size=4, cache_size=None).make_recurrence(), WindowRecurrence)
    assert recurrences.get("sparse_cache", window_size=4, cache_size=0).get_config() == {
        "window_size": 4,
        "cache_size": 0,
    }
    with pytest.raises(ValueError, match="`cache_size` is the sparse cache beside a softmax window"):
        AttentionSpec.create("elu", cache_size=2)
    with pytest.raises(ValueError, match="`cache_size` must be"):
        AttentionSpec.create("elu", window_size=4, cache_size=-1)
    with pytest.raises(ValueError, match="`window_size` cannot be combined with `decay`"):
        AttentionSpec.create("elu", window_size=4, cache_size=2, decay="scalar")
    with pytest.raises(ValueError, match="not both"):
        AttentionSpec.create("elu", recurrence="sparse_cache", cache_size=2)


def test_linearize_with_a_cache_covering_the_sequence_is_the_teacher():
    from tests.linearization._models import DIM, FEATURES, HEADS, KEY_DIM, T, causal_teacher, data

    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=4, cache_size=T - 4)
    attention = student.get_layer("att1")
    assert isinstance(attention.recurrence, SparseCacheRecurrence)
    # linearize's defaults with a cache: its gamma (0.9) and LoLA's small linear weight.
    assert attention.recurrence.get_config() == {
        "window_size": 4,
        "cache_size": T - 4,
        "gamma": 0.9,
        "linear_weight": 0.001,
    }
    x = data(4)
    # As tests/linearization/test_linearize.py: embed, two attention layers, the head.
    n = FEATURES + 2 * (DIM + KEY_DIM + 2 * T + HEADS * KEY_DIM) + DIM
    assert_close(student(x), teacher(x), n=n, paths=2, what="W + N = T vs the teacher")
    shorter = keras_linattn.linearize(teacher, window_size=3, cache_size=2)
    err = np.abs(np.asarray(shorter(x)) - np.asarray(teacher(x))).max() / np.abs(np.asarray(teacher(x))).max()
    assert err > 1e-2  # the criterion: W + N < T uses the linear state
