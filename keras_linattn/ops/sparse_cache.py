"""Sparse global cache (LoLA): a softmax window, a softmax cache of hard-to-recall pairs, linear attention for the rest.

LoLA (McDermott, Heath and Parhi 2025, arXiv 2505.23666) keeps three
memories per head: the last W key-value pairs (the sliding window), a
sparse global cache of at most N older pairs, both attended with exact
softmax, and the linear state ``(S, z)`` holding every other older pair
through the feature map.

**The rule.** When a pair leaves the window (at query i the pair of token
``i - W``), the candidates are the cached pairs and the leaving one. Each
gets its self-recall error against the linear state as it is at that
moment (before this step's write)::

    e(k, v) = || v - phi(k)^T S / d(k) ||^2,   d(k) = phi(k)^T z

with ``d(k)`` guarded exactly as the readout's denominator (replaced only
where ``|d| <= eps * |phi(k)| . |z|``, by 1 where it is 0: an empty state
predicts 0 and the error is ``||v||^2``). This is LoLA's score with the
package's relative guard instead of LoLA's ``+ eps``; ``phi`` is the key
feature map; the squared norm orders the candidates as the norm does.
While the cache has a free slot the leaving pair takes it and nothing
reaches the linear state. Otherwise the N candidates with the highest
error stay and the lowest goes into the linear state
(``S += phi(k) v^T``, ``z += phi(k)``). Ties go to the older pair: the
cache is kept in the order the pairs left the window (slot 0 the oldest,
the leaving pair after the last slot), and the lowest slot among the
equal lowest errors is the one evicted. A padded key (``valid`` 0) is
never a candidate: it enters neither the cache nor the state.

**The readout** is the window recurrence's (`keras_linattn.ops.window`)
with the cached pairs added to the softmax terms under the same max and
the same shared normalizer::

    s_ij = scale * q_i . k_j,   A_i = win(i) u cache_i,   m_i = max_{j in A_i} s_ij
    out_i = (gamma sum_{j in A_i} exp(s_ij - m_i) v_j + phi(q_i)^T S_i)
            / (gamma sum_{j in A_i} exp(s_ij - m_i)   + phi(q_i)^T z_i)

``S_i`` after the decision of step i. With N = 0 every leaving pair goes
into the state: this is `window_attention`. With ``W + N >= T`` nothing
reaches the state: exact softmax attention (gamma cancels).

The cache may score other queries and keys than the window's (``cache_q``,
``cache_k_all``; the step's ``q_cache_t``, ``k_cache_evicted``): a pair
entering the cache keeps its key from those, e.g. the keys before the
rotary embedding, the queries rotated to a fixed distance
(``SparseCacheRecurrence(cache_distance=d)``).

Shape legend: B batch, T length, W window, N cache slots, H heads, D key
dim, C feature dim, M value dim.

Decode state: ``(S, z)``, the window's ring (as `window_attention_step`)
and the cache: ``keys [B, N, H, D]``, ``values [B, N, H, M]`` and
``valid [B, N, H]`` (one decision per head), with the keys' features
``[B, N, H, C]`` beside them in these functions (the recurrence recomputes
them from the keys). Every entry has a fixed size.

Parallel form: the decisions are sequential, so a ``tf.while_loop`` (an
ONNX Loop; ``keras.ops.scan`` on other backends) runs the selection token
by token and reads the cache for each query there (its softmax terms under
the cache's own max: no per-token copy of the cache is kept). It hands out
per token the pair that entered the state (or zeros) and those cache
terms. The linear part is then ordinary chunked causal linear attention
over the entering pairs, and the window's band is blocked as in
`window_attention`; the cache terms are rescaled to the joint max of the
window and the cache. Cost per token: ``O((W + N)(D + M) + C M)`` for the
readout, ``O((N + 1) C M)`` for the selection (each candidate reads ``S``).
The loop makes the parallel form much slower than the window's
(measured: docs/dev/history/recurrences.md); its results equal the step's up to
float32 rounding.
"""

from keras import ops

from keras_linattn._validation import check_epsilon, check_non_negative_int, check_positive_int, check_rank
from keras_linattn.ops import _sparse_cache_distance as _distance
from keras_linattn.ops._common import (
    _causal_chunked,
    _check_state,
    _guarded_denominator,
    _has_keys,
    _heads_first,
    _mark_underflow,
    _mask_keys,
    _matmul,
    _normalize,
    _validate_inputs,
)
from keras_linattn.ops._sparse_selection import _admit, _check_cache, _empty_cache
from keras_linattn.ops.core import DEFAULT_EPSILON
from keras_linattn.ops.window import (
    _NEG,
    _check_gamma,
    _check_scale,
    _grouped_readout,
    _grouped_scores,
    _query_heads_per_key_head,
    _repeat_heads,
)

__all__ = ["sparse_cache_attention", "sparse_cache_attention_reference", "sparse_cache_attention_step"]


def _joint_softmax_terms(*parts):
    """``exp(s - m)`` over the allowed keys of several ``(scores, allowed)`` parts, ``m`` their joint max.

    `keras_linattn.ops.window`'s softmax terms over the concatenated parts,
    without concatenating (the parts' lengths need not be static); finite
    for empty rows.
    """
    peak = None
    for scores, allowed in parts:
        masked = ops.where(allowed, scores, ops.full_like(scores, _NEG))
        part_peak = ops.max(masked, axis=-1, keepdims=True, initial=_NEG)
        peak = part_peak if peak is None else ops.maximum(peak, part_peak)
    return [
        ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))
        for scores, allowed in parts
    ]


# ------------------------------------------------------------------ parallel form
def sparse_cache_attention(
    q,
    q_features,
    k_all,
    k_features_all,
    v_all,
    window,
    cache_size,
    valid_all=None,
    initial_state=None,
    initial_cache=None,
    return_state=False,
    scale=None,
    chunk_size=64,
    eps=DEFAULT_EPSILON,
    gamma=None,
    cache_q=None,
    cache_k_all=None,
    cache_max_distance=None,
):
    """Causal window + sparse cache + linear attention over a piece of T tokens, continuing from a state.

    Args:
        q: raw queries ``[B, T, H, D]``; q_features: ``phi(q)`` ``[B, T, H, C]``.
        k_all: raw keys ``[B, W + T, H, D]``: the W buffered keys (zeros,
            invalid, for a fresh sequence), then the piece's own.
        k_features_all: ``phi(k_all)``, ``[B, W + T, H, C]``.
        v_all: values ``[B, W + T, H, M]``.
        window: W, a positive int. cache_size: N, an int >= 0.
        valid_all: optional ``[B, W + T]``, 1 for real keys.
        initial_state: optional ``(S [B, H, C, M], z [B, H, C])``.
        initial_cache: optional ``(keys [B, N, H, D], features [B, N, H, C],
            values [B, N, H, M], valid [B, N, H])`` oldest first; None is an
            empty cache.
        return_state: also return the state and the cache after the piece.
        scale, chunk_size, eps, gamma: as in `keras_linattn.ops.window_attention`
            (`eps` also guards the recall error's denominator).
        cache_q, cache_k_all: optional queries ``[B, T, H, D]`` and keys
            ``[B, W + T, H, D]`` that the cache's softmax scores with
            (default `q` and `k_all`): a pair entering the cache keeps its
            key from `cache_k_all`, and `initial_cache`'s keys must be such
            keys. The window's softmax always scores `q` against `k_all`.
            ``SparseCacheRecurrence(cache_distance=d)`` passes the keys
            before the rotary embedding and the queries rotated to d here.
        cache_max_distance: None (default) or an int L >= 0 (needs
            `cache_q` and `cache_k_all`): a cached pair d tokens before its
            query is scored with `q` . `k_all` while d <= L, with `cache_q` .
            `cache_k_all` beyond (`keras_linattn.ops._sparse_cache_distance`).
            The cache's keys are then ``[k, cache_k, age]`` packed,
            ``[B, N, H, 2D + 1]``, in `initial_cache` and the returned cache.

    Returns:
        ``[B, T, H, M]`` in ``v_all``'s dtype; with `return_state`,
        ``(out, (S, z), (keys, features, values, valid))``, all float32.
        The new window buffer is the last W entries of `k_all`, `v_all`,
        `valid_all`.

    Raises:
        KernelUnderflowError: eagerly, as `window_attention`.
    """
    window, cache_size, scale, gamma, d_cache = _check_arguments(
        q,
        q_features,
        k_all,
        k_features_all,
        v_all,
        window,
        cache_size,
        valid_all,
        initial_state,
        initial_cache,
        scale,
        eps,
        gamma,
        cache_q,
        cache_k_all,
        cache_max_distance,
    )
    h, c, m = q.shape[2], q_features.shape[3], v_all.shape[3]
    out_dtype = v_all.dtype
    batch, length = ops.shape(q)[0], ops.shape(q)[1]
    if valid_all is None:
        valid_all = ops.ones(ops.shape(k_all)[:2], "bool")
    valid_all = ops.cast(valid_all, "bool")  # [B, W + T]
    f32 = lambda x: ops.cast(x, "float32")  # noqa: E731
    if initial_state is None:
        s0 = z0 = None
        state = (ops.zeros((batch, h, c, m), "float32"), ops.zeros((batch, h, c), "float32"))
    else:
        s0, z0 = (f32(x) for x in initial_state)
        state = (s0, z0)
    if initial_cache is None:
        cache = _empty_cache(batch, cache_size, h, d_cache, c, m)
    else:
        keys, feats, values, ok = (f32(x) for x in initial_cache)
        cache = tuple(_mask_keys(x, ok > 0) for x in (keys, feats, values)) + (ok,)
    if q.shape[1] == 0:  # an empty piece: no output, the state and the cache handed on
        out = ops.zeros_like(v_all[:, window:])  # [B, 0, H, M]
        return (out, state, cache) if return_state else out

    kf_all = _mask_keys(f32(k_features_all), valid_all)  # [B, W + T, H, C]
    vv = _mask_keys(f32(v_all), valid_all)  # [B, W + T, H, M]
    kk = f32(k_all)  # [B, W + T, H, D]

    # The selection, token by token: at query i the pair k_all[i] leaves the window. The loop also reads
    # the cache for query i (its softmax terms under the cache's own max), so that no per-token copy of
    # the cache is kept.
    tokens_first = lambda x: ops.moveaxis(x[:, :length], 1, 0)  # noqa: E731  [T, B, ...]
    q_cache = f32(q if cache_q is None else cache_q) * scale  # [B, T, H, D]: the cache's scores read these
    k_cache = kk if cache_k_all is None else f32(cache_k_all)  # [B, W + T, H, D]
    if cache_max_distance is not None:  # both forms of each query and key, and each key's age on leaving
        q_cache, k_cache = _distance.packed_inputs(
            f32(q) * scale, q_cache, kk, k_cache, window, cache_max_distance
        )  # [B, T, H, 2D], [B, W + T, H, 2D + 1]
    xs = [tokens_first(x) for x in (q_cache, k_cache, kf_all, vv, f32(valid_all))]

    selected = _distance.selection(tuple(state + cache), tuple(xs), eps, cache_max_distance)
    carry, (kf_e, v_e, num_c, den_c, peak_c) = selected
    state, cache = carry[:2], carry[2:]

    # Linear part: query i over the pairs that entered the state at or before step i.
    qf = _heads_first(f32(q_features))  # [B, H, T, C]
    num, den, den_abs, _ = _causal_chunked(
        qf, _tokens_to_heads(kf_e), _tokens_to_heads(v_e), chunk_size, s0, z0, with_abs=True
    )  # [B, H, T, M], [B, H, T, 1], [B, H, T, 1]
    num_sm, den_sm = _softmax_terms(
        _heads_first(f32(q)) * scale, kk, vv, valid_all, window, gamma, (num_c, den_c, peak_c)
    )  # [B, H, T, M], [B, H, T, 1]

    den_abs = den_abs + den_sm  # [B, H, T, 1]: the softmax terms are positive
    out = _normalize(qf, num + num_sm, den + den_sm, eps, den_abs)  # [B, H, T, M]
    # As the window: a row with a real key that has left its window and no term left is flagged; a row
    # with a softmax term (window or cache: the largest is 1, or gamma) never is.
    out = _mark_underflow(out, qf, den_abs, _has_keys(valid_all[:, :length], True, z0, qf, length))
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), out_dtype)  # [B, T, H, M]
    if return_state:
        return out, state, cache
    return out


def _check_arguments(
    q,
    q_features,
    k_all,
    k_features_all,
    v_all,
    window,
    cache_size,
    valid_all,
    initial_state,
    initial_cache,
    scale,
    eps,
    gamma,
    cache_q,
    cache_k_all,
    cache_max_distance,
):
    """Checks `sparse_cache_attention`'s arguments.

    Returns:
        ``(window, cache_size, scale, gamma, d_cache)`` as the readout uses them
        (``d_cache``: the cache's key width, D or the packed 2D + 1).

    Raises:
        ValueError: naming the argument received, for a shape, size or
            value that `sparse_cache_attention` does not take.
    """
    window = check_positive_int("window", window)
    cache_size = check_non_negative_int("cache_size", cache_size)
    check_rank("q", q, 4)
    _validate_inputs(q_features, k_features_all, v_all, valid_all, names=("q_features", "k_features_all", "v_all"))
    _validate_inputs(q, k_all, None, valid_all, names=("q", "k_all", "v_all"))
    t, total = q.shape[1], k_all.shape[1]
    if t is not None and total is not None and total != t + window:
        raise ValueError(
            f"`k_all` must hold the W={window} buffered keys then the T={t} keys of the piece. "
            f"Received: k_all.shape={tuple(k_all.shape)}, q.shape={tuple(q.shape)}"
        )
    h, d, c, m = q.shape[2], q.shape[3], q_features.shape[3], v_all.shape[3]
    d_cache = _distance.cache_key_width(cache_max_distance, cache_q, cache_k_all, d)  # D, or 2D + 1 packed
    for name, x, like, of in (("cache_q", cache_q, q, "q"), ("cache_k_all", cache_k_all, k_all, "k_all")):
        if x is None:
            continue
        if len(x.shape) != 4 or any(
            a is not None and b is not None and a != b for a, b in zip(x.shape, like.shape, strict=True)
        ):
            raise ValueError(
                f"`{name}` must have the shape of `{of}`. Received: {name}.shape={tuple(x.shape)}, "
                f"{of}.shape={tuple(like.shape)}"
            )
    if initial_state is not None:
        _check_state(initial_state, h, c, m, name="initial_state")
    if initial_cache is not None and _check_cache(initial_cache, h, d_cache, c, m, "initial_cache") not in (
        None,
        cache_size,
    ):
        raise ValueError(
            f"`initial_cache` must have N = cache_size = {cache_size} slots. "
            f"Received: keys.shape={tuple(initial_cache[0].shape)}"
        )
    scale = _check_scale(scale, q)
    check_epsilon("eps", eps, allow_zero=True)
    return window, cache_size, scale, _check_gamma(gamma, h), d_cache


def _tokens_to_heads(x):
    """``[T, B, H, X]`` (the token loop's outputs) -> ``[B, H, T, X]``."""
    return ops.transpose(x, (1, 2, 0, 3))


def _softmax_terms(qs, kk, vv, valid_all, window, gamma, cache_terms):
    """The softmax part of `sparse_cache_attention`: the window's band and the cache, under one max per query.

    The band runs in blocks of W queries against 2W keys (as
    `window_attention`); the cache's terms, computed in the token loop under
    the cache's own max, are rescaled to the joint max of the band and the
    cache.

    Args:
        qs: scaled queries ``[B, H, T, D]`` float32.
        kk, vv: keys ``[B, W + T, H, D]`` and values ``[B, W + T, H, M]``
            float32 (the values of padded keys zeros).
        valid_all: ``[B, W + T]`` bool.
        window: W. gamma: None or ``[H]``.
        cache_terms: the token loop's ``(num [T, B, H, M], den [T, B, H, 1],
            peak [T, B, H, 1])``.

    Returns:
        ``(num [B, H, T, M], den [B, H, T, 1])``.
    """
    batch, h, length, d = ops.shape(qs)[0], qs.shape[1], ops.shape(qs)[2], qs.shape[3]
    m = vv.shape[3]
    pad = (window - length % window) % window
    blocks = (length + pad) // window  # NB
    ks = ops.pad(_heads_first(kk), [[0, 0], [0, 0], [0, pad], [0, 0]])  # [B, H, (NB+1)W, D]
    vs = ops.pad(_heads_first(vv), [[0, 0], [0, 0], [0, pad], [0, 0]])  # [B, H, (NB+1)W, M]
    okp = ops.pad(valid_all, [[0, 0], [0, pad]])  # [B, (NB+1)W]
    qb = ops.reshape(ops.pad(qs, [[0, 0], [0, 0], [0, pad], [0, 0]]), (batch, h, blocks, window, d))  # [B, H, NB, W, D]
    kb = ops.reshape(ks, (batch, h, -1, window, d))  # [B, H, NB+1, W, D]
    vb = ops.reshape(vs, (batch, h, -1, window, m))  # [B, H, NB+1, W, M]
    okb = ops.reshape(okp, (batch, -1, window))  # [B, NB+1, W]
    kwin = ops.concatenate([kb[:, :, :-1], kb[:, :, 1:]], axis=3)  # [B, H, NB, 2W, D]
    vwin = ops.concatenate([vb[:, :, :-1], vb[:, :, 1:]], axis=3)  # [B, H, NB, 2W, M]
    okwin = ops.concatenate([okb[:, :-1], okb[:, 1:]], axis=2)  # [B, NB, 2W]
    r = ops.arange(window)[:, None]  # [W, 1] query offset in its block
    jj = ops.arange(2 * window)[None, :]  # [1, 2W] key offset
    band = ops.logical_and(jj >= r + 1, jj <= r + window)  # [W, 2W]: keys (i - W, i]
    allowed = ops.logical_and(band, okwin[:, None, :, None, :])  # [B, 1, NB, W, 2W]
    scores = _matmul(qb, kwin, transpose_b=True)  # [B, H, NB, W, 2W]
    num_c, den_c, peak_c = (_tokens_to_heads(x) for x in cache_terms)  # [B, H, T, M|1|1]
    peak_cb = ops.reshape(ops.pad(peak_c, [[0, 0], [0, 0], [0, pad], [0, 0]]), (batch, h, blocks, window, 1))
    peak = ops.max(ops.where(allowed, scores, ops.full_like(scores, _NEG)), axis=-1, keepdims=True, initial=_NEG)
    peak = ops.maximum(peak, peak_cb)  # [B, H, NB, W, 1]: the max over the window and the cache
    e = ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))  # [B, H, NB, W, 2W]
    rescale = ops.exp(ops.minimum(peak_c - ops.reshape(peak, (batch, h, -1, 1))[:, :, :length], 0.0))  # [B, H, T, 1]
    num_c = num_c * rescale  # [B, H, T, M]
    den_c = den_c * rescale  # [B, H, T, 1]
    if gamma is not None:
        e = e * gamma[None, :, None, None, None]  # [B, H, NB, W, 2W]
        num_c = num_c * gamma[None, :, None, None]
        den_c = den_c * gamma[None, :, None, None]
    num_sm = ops.reshape(ops.matmul(e, vwin), (batch, h, -1, m))[:, :, :length] + num_c  # [B, H, T, M]
    den_sm = ops.reshape(ops.sum(e, axis=-1), (batch, h, -1, 1))[:, :, :length] + den_c  # [B, H, T, 1]
    return num_sm, den_sm


# ------------------------------------------------------------------ step
def sparse_cache_attention_step(
    q_t,
    q_features_t,
    k_t,
    v_t,
    k_features_evicted,
    buffer,
    cache,
    state,
    key_mask_t=None,
    scale=None,
    eps=DEFAULT_EPSILON,
    gamma=None,
    q_cache_t=None,
    k_cache_evicted=None,
    cache_max_distance=None,
):
    """One decoding step: the oldest window pair goes through the selection, the new one enters the window.

    Grouped-query attention: as in `window_attention_step`, the window's
    keys and values may have ``G`` heads, a divisor of ``H`` (query head
    ``h`` reads key/value head ``h // (H / G)``): ``k_t``, ``v_t`` and the
    buffer then have ``G`` heads and the buffer is read in place, never
    repeated to ``H``. The cache keeps ``H`` heads (each query head selects
    its own pairs): the leaving pair enters it repeated to each query head.

    Args:
        q_t: raw query ``[B, H, D]``; q_features_t: ``phi(q_t)`` ``[B, H, C]``.
        k_t: raw key ``[B, G, D]``; v_t: value ``[B, G, M]``.
        k_features_evicted: ``phi`` of the oldest buffered key ``[B, H, C]``
            (it leaves the window now; its head repeated to each query head
            that reads it).
        buffer: ``(keys [B, W, G, D], values [B, W, G, M], valid [B, W])``, oldest first.
        cache: ``(keys [B, N, H, D], features [B, N, H, C], values [B, N, H, M],
            valid [B, N, H])``, oldest first (``features = phi(keys)``).
        state: ``(S [B, H, C, M], z [B, H, C])``.
        key_mask_t: optional ``[B]``: a padded token takes its place in the
            window but is never attended nor kept.
        scale, eps, gamma: as in `sparse_cache_attention`.
        q_cache_t, k_cache_evicted: optional ``[B, H, D]``, as
            `sparse_cache_attention`'s `cache_q` and `cache_k_all`: the query
            the cache is scored with (default `q_t`) and the leaving pair's
            key as the cache keeps it (default the buffer's oldest key).
        cache_max_distance: as in `sparse_cache_attention` (needs
            `q_cache_t` and `k_cache_evicted`; the cache's keys packed,
            ``[B, N, H, 2D + 1]``).

    Returns:
        ``(out_t [B, H, M], (S, z), buffer, cache)``, all state float32.
    """
    check_rank("q_t", q_t, 3)
    check_rank("k_t", k_t, 3)
    h, d, c, m = q_t.shape[1], q_t.shape[2], q_features_t.shape[2], v_t.shape[2]
    _check_state(state, h, c, m)
    if not isinstance(buffer, (tuple, list)) or len(buffer) != 3:
        raise ValueError(f"`buffer` must be (keys, values, valid). Received: buffer={buffer!r}")
    _check_cache(cache, h, _distance.cache_key_width(cache_max_distance, q_cache_t, k_cache_evicted, d), c, m, "cache")
    groups = _query_heads_per_key_head(q_t, k_t, v_t, buffer)
    scale = _check_scale(scale, q_t)
    gamma = _check_gamma(gamma, h)
    out_dtype = v_t.dtype
    f32 = lambda x: ops.cast(x, "float32")  # noqa: E731
    keys, values, valid = (f32(x) for x in buffer)  # [B, W, G, D], [B, W, G, M], [B, W]
    ck, ckf, cv, cok = (f32(x) for x in cache)
    cache = tuple(_mask_keys(x, cok > 0) for x in (ck, ckf, cv)) + (cok,)
    leaving_key = _repeat_heads(keys[:, 0], groups) if k_cache_evicted is None else f32(k_cache_evicted)  # [B, H, D]
    if cache_max_distance is not None:  # the cached pairs age by one; the leaving one is W tokens back
        cache = _distance.age_cache(cache, cache_max_distance)
        leaving_age = ops.minimum(ops.cast(ops.shape(keys)[1], "float32"), float(cache_max_distance) + 1.0)
        real_key = _repeat_heads(keys[:, 0], groups)  # [B, H, D]
        leaving_key = _distance.pack_keys(real_key, leaving_key, ops.ones_like(real_key[..., 0]) * leaving_age)
    leaving = (leaving_key, f32(k_features_evicted), _repeat_heads(values[:, 0], groups), valid[:, 0])
    (s, z), cache, _ = _admit(tuple(f32(x) for x in state), cache, leaving, eps)
    ck, _, cv, cok = cache

    if key_mask_t is None:
        new_ok = ops.ones_like(valid[:, :1])  # [B, 1]
    else:
        new_ok = f32(ops.cast(key_mask_t, "bool"))[:, None]  # [B, 1]
    v_new = _mask_keys(f32(v_t), new_ok[:, 0] > 0)  # [B, G, M]
    keys = ops.concatenate([keys[:, 1:], f32(k_t)[:, None]], axis=1)  # [B, W, G, D]
    values = ops.concatenate([values[:, 1:], v_new[:, None]], axis=1)  # [B, W, G, M]
    valid = ops.concatenate([valid[:, 1:], new_ok], axis=1)  # [B, W]

    q = f32(q_t) * scale  # [B, H, D]
    q_c = q if q_cache_t is None else f32(q_cache_t) * scale  # [B, H, D]
    qf = f32(q_features_t)  # [B, H, C]
    if groups == 1:
        window_scores = ops.einsum("bhd,bwhd->bhw", q, keys)  # [B, H, W]
    else:
        window_scores = _grouped_scores(q, keys, groups)  # [B, H, W]: each group of heads against its keys
    e_w, e_c = _joint_softmax_terms(
        (window_scores, (valid > 0)[:, None, :]),  # [B, H, W], [B, 1, W]
        (_distance.step_scores(q, q_c, ck, cache_max_distance), ops.transpose(cok, (0, 2, 1)) > 0),  # [B, H, N] x2
    )
    if gamma is not None:
        e_w, e_c = e_w * gamma[None, :, None], e_c * gamma[None, :, None]
    if groups == 1:
        window_read = ops.einsum("bhw,bwhm->bhm", e_w, values)  # [B, H, M]
    else:
        window_read = _grouped_readout(e_w, values, groups)  # [B, H, M]
    num = window_read + ops.einsum("bhn,bnhm->bhm", e_c, cv) + ops.einsum("bhc,bhcm->bhm", qf, s)  # [B, H, M]
    den_sm = ops.sum(e_w, axis=-1, keepdims=True) + ops.sum(e_c, axis=-1, keepdims=True)  # [B, H, 1]
    den = den_sm + ops.sum(qf * z, axis=-1, keepdims=True)  # [B, H, 1]
    den_abs = den_sm + ops.sum(ops.abs(qf) * ops.abs(z), axis=-1, keepdims=True)  # [B, H, 1]
    out = _normalize(qf, num, den, eps, den_abs)  # [B, H, M]
    out = _mark_underflow(out, qf, den_abs, ops.any(ops.not_equal(z, 0.0), axis=-1, keepdims=True))
    return ops.cast(out, out_dtype), (s, z), (keys, values, valid), cache


# ------------------------------------------------------------------ oracle
def sparse_cache_attention_reference(
    q,
    q_features,
    k,
    k_features,
    v,
    window,
    cache_size,
    key_mask=None,
    scale=None,
    eps=DEFAULT_EPSILON,
    compute_dtype="float64",
    gamma=None,
    mean=False,
    cache_q=None,
    cache_k=None,
    cache_max_distance=None,
):
    """The oracle: one token at a time, every memory a set of positions, every weight written out.

    Self-attention over one sequence from an empty state (``q, k [B, T, H, D]``,
    features ``[B, T, H, C]``, ``v [B, T, H, M]``, ``key_mask [B, T]``), in
    ``compute_dtype``. The cache and the state are boolean masks over the
    positions; at query i the pair of position ``i - W`` leaves the window,
    ``S`` and ``z`` are summed afresh from the state's mask, every candidate's
    error is computed from them, and the oldest of the lowest is evicted.
    Differentiable (the decisions are constants for autodiff). ``mean=True``:
    the linear terms of query i are divided by the number of pairs in the
    state then (at least 1), counted from the state's mask
    (`keras_linattn.recurrences.SparseCacheRecurrence`'s ``linear_mean``).
    ``cache_q``, ``cache_k`` ``[B, T, H, D]``: the cached positions' logits
    are ``scale * cache_q_i . cache_k_j`` (default `q`, `k`), the window's
    ``scale * q_i . k_j``, under one max. ``cache_max_distance`` L: a
    cached position j is scored with ``q_i . k_j`` while ``i - j <= L``,
    with ``cache_q_i . cache_k_j`` beyond.
    """
    window = check_positive_int("window", window)
    cache_size = check_non_negative_int("cache_size", cache_size)
    _validate_inputs(q, k, v, key_mask, causal=True, names=("q", "k", "v"))
    scale = _check_scale(scale, q)
    cast = lambda x: ops.cast(x, compute_dtype)  # noqa: E731
    t = q.shape[1]
    real = ops.ones(ops.shape(k)[:2], "bool") if key_mask is None else ops.cast(key_mask, "bool")  # [B, T]
    kf = _mask_keys(cast(k_features), real)  # [B, T, H, C]
    vv = _mask_keys(cast(v), real)  # [B, T, H, M]
    scores = ops.einsum("bthd,bshd->bhts", cast(q), cast(k)) * scale  # [B, H, T, T]
    if cache_q is None and cache_k is None:
        cache_scores = scores
    else:
        q_c, k_c = (q if cache_q is None else cache_q), (k if cache_k is None else cache_k)
        cache_scores = ops.einsum("bthd,bshd->bhts", cast(q_c), cast(k_c)) * scale  # [B, H, T, T]
    lin = ops.einsum("bthc,bshc->bhts", cast(q_features), kf)  # [B, H, T, T]
    pos = ops.arange(t)[None, None, :]  # [1, 1, T]
    real_bh = ops.broadcast_to(real[:, None, :], ops.shape(scores[:, :, 0]))  # [B, H, T]
    in_cache = ops.zeros_like(real_bh)  # [B, H, T] bool
    in_state = ops.zeros_like(real_bh)
    g = None if gamma is None else cast(gamma)[None, :, None]  # [1, H, 1]
    v_heads = ops.transpose(vv, (0, 2, 1, 3))  # [B, H, T, M]
    rows = []
    for i in range(t):
        if i - window >= 0:
            cand = ops.logical_or(in_cache, ops.logical_and(pos == i - window, real_bh))  # [B, H, T]
            full = ops.sum(ops.cast(cand, "int32"), axis=-1, keepdims=True) > cache_size  # [B, H, 1]
            weight = ops.cast(in_state, compute_dtype)  # [B, H, T]
            s = ops.einsum("bhj,bjhc,bjhm->bhcm", weight, kf, vv)  # [B, H, C, M]
            z = ops.einsum("bhj,bjhc->bhc", weight, kf)  # [B, H, C]
            read = ops.einsum("bjhc,bhcm->bhjm", kf, s)  # [B, H, T, M]
            den = ops.einsum("bjhc,bhc->bhj", kf, z)[..., None]  # [B, H, T, 1]
            den_abs = ops.einsum("bjhc,bhc->bhj", ops.abs(kf), ops.abs(z))[..., None]  # [B, H, T, 1]
            err = ops.sum(ops.square(v_heads - read / _guarded_denominator(den, den_abs, eps)), axis=-1)  # [B, H, T]
            err = ops.stop_gradient(ops.where(cand, err, ops.full_like(err, float("inf"))))
            lowest = ops.min(err, axis=-1, keepdims=True)  # [B, H, 1]
            oldest = ops.min(ops.where(ops.logical_and(cand, err <= lowest), pos, t), axis=-1, keepdims=True)
            evicted = ops.logical_and(pos == oldest, full)  # [B, H, T]
            in_cache = ops.logical_and(cand, ops.logical_not(evicted))
            in_state = ops.logical_or(in_state, evicted)
        in_window = ops.logical_and(ops.logical_and(pos <= i, pos > i - window), real_bh)  # [B, H, T]
        soft = ops.logical_or(in_window, in_cache)  # [B, H, T]
        cached_i = cache_scores[:, :, i]  # [B, H, T]
        if cache_max_distance is not None:
            cached_i = ops.where(i - pos <= cache_max_distance, scores[:, :, i], cached_i)
        s_i = ops.where(in_cache, cached_i, scores[:, :, i])  # [B, H, T]: window and cache are apart
        peak = ops.max(ops.where(soft, s_i, ops.full_like(s_i, _NEG)), axis=-1, keepdims=True)
        weights = ops.where(soft, ops.exp(ops.minimum(s_i - peak, 0.0)), ops.zeros_like(s_i))  # [B, H, T]
        if g is not None:
            weights = weights * g
        lin_i = lin[:, :, i]  # [B, H, T]
        if mean:
            count = ops.sum(ops.cast(in_state, compute_dtype), axis=-1, keepdims=True)  # [B, H, 1]
            lin_i = lin_i / ops.maximum(count, ops.cast(1.0, compute_dtype))
        weights = weights + ops.where(in_state, lin_i, ops.zeros_like(s_i))  # [B, H, T]
        num = ops.einsum("bhs,bshm->bhm", weights, vv)  # [B, H, M]
        den = ops.sum(weights, axis=-1, keepdims=True)  # [B, H, 1]
        den_abs = ops.sum(ops.abs(weights), axis=-1, keepdims=True)  # [B, H, 1]
        rows.append(num / _guarded_denominator(den, den_abs, eps))
    out = ops.stack(rows, axis=1) if rows else ops.zeros(ops.shape(vv), compute_dtype)  # [B, T, H, M]
    return ops.cast(out, v.dtype)
