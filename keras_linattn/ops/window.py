"""Sliding-window hybrid: exact softmax over the last W tokens, linear attention over the rest.

For query i (causal, shared normalizer, as in LoLCATs/Based)::

    s_ij = scale * q_i . k_j,   m_i = max_{j in win(i)} s_ij,   win(i) = (i - W, i]
    out_i = (sum_{j in win(i)} exp(s_ij - m_i) v_j + phi(q_i)^T S_{i-W})
            / (sum_{j in win(i)} exp(s_ij - m_i)   + phi(q_i)^T z_{i-W})

where ``S_{i-W} = sum_{j <= i-W} phi(k_j) v_j^T`` (and ``z``) holds every key
that has left the window. With a per-head weight ``gamma`` (LoLCATs' learned
``sigmoid(g)``) the softmax terms are ``gamma * exp(s_ij - m_i)`` in both the
numerator and the denominator and the linear terms keep weight 1; when every
key is in the window gamma cancels (exact softmax attention).

With a logit soft cap ``c`` (Gemma 2) each window score is ``c * tanh(s_ij / c)``
before the max and the exponential, as the teacher caps its scores. The
linear terms ``phi(q_i) . phi(k_j)`` are a kernel of the uncapped query and
key, not of a score, so they cannot be capped: with every key in the window
the output is the capped softmax exactly, beyond it the linear part stands
in for the capped scores of the keys that left.

The window is positional: padded keys inside it
count for nothing but still take their place. Since ``exp(s_ii - m_i) <= 1``
and the largest window term is 1, the normalizer of a query whose own key is
real is at least 1 (at least gamma with a gamma).

Shape legend: B batch, T length, W window, H heads, D key dim, C feature
dim, M value dim, N number of blocks.

Decode state: ``(S, z)`` of the linear part plus a fixed buffer of the last W
keys, values and their validity; a step evicts the oldest buffered key into
``(S, z)`` and appends the new one, so decoding costs the same at any length.

Parallel form: the keys and values are passed with the W buffered ones in
front (``k_all [B, W + T, H, D]``): the linear part is then ordinary causal
linear attention of query i over ``k_all[:i + 1]`` (the keys ``<= i - W`` of
the piece), and the softmax part a band of W keys per query, computed in
blocks of W queries against 2W keys.
"""

from keras import ops

from keras_linattn._validation import check_epsilon, check_positive_int, check_rank
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
from keras_linattn.ops.core import DEFAULT_EPSILON

__all__ = ["window_attention", "window_attention_reference", "window_attention_step"]

_NEG = -1e30


def _check_scale(scale, q):
    if scale is None:
        return float(q.shape[-1]) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"`scale` must be a positive number or None. Received: scale={scale!r}")
    return float(scale)


def _check_gamma(gamma, heads):
    if gamma is None:
        return None
    check_rank("gamma", gamma, 1)
    if gamma.shape[0] is not None and heads is not None and gamma.shape[0] != heads:
        raise ValueError(f"`gamma` must have shape [H] = [{heads}]. Received: gamma.shape={tuple(gamma.shape)}")
    return ops.cast(gamma, "float32")


def _check_soft_cap(soft_cap):
    if soft_cap is None:
        return None
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float)) or not 0 < soft_cap < float("inf"):
        raise ValueError(f"`soft_cap` must be None or a positive finite number. Received: soft_cap={soft_cap!r}")
    return float(soft_cap)


def _cap(scores, soft_cap):
    """``c * tanh(s / c)`` of the (scaled) scores, or the scores themselves without a cap."""
    if soft_cap is None:
        return scores
    cap = ops.cast(soft_cap, scores.dtype)
    return ops.tanh(scores / cap) * cap


def _softmax_terms(scores, allowed, axis=-1):
    """``exp(s - m)`` over allowed keys (``m`` their max along `axis`) and 0 elsewhere; finite for empty rows."""
    # `initial`: no error for an empty batch or piece (the masked scores are >= _NEG anyway).
    # Scalars in the `where`s: nothing the size of the scores (nor, in ONNX, a read of their shape).
    neg, zero = ops.full((), _NEG, scores.dtype), ops.zeros((), scores.dtype)
    peak = ops.max(ops.where(allowed, scores, neg), axis=axis, keepdims=True, initial=_NEG)
    return ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), zero)


def window_attention(
    q,
    q_features,
    k_all,
    k_features_all,
    v_all,
    window,
    valid_all=None,
    initial_state=None,
    return_state=False,
    scale=None,
    chunk_size=64,
    eps=DEFAULT_EPSILON,
    gamma=None,
    soft_cap=None,
):
    """Causal sliding-window softmax + linear attention, in parallel over a piece of T tokens.

    Args:
        q: raw queries ``[B, T, H, D]`` (for the softmax part).
        q_features: ``phi(q)``, ``[B, T, H, C]``.
        k_all: raw keys ``[B, W + T, H, D]``: the W keys buffered before
            this piece (zeros, marked invalid, for a fresh sequence), then the
            piece's own.
        k_features_all: ``phi(k_all)``, ``[B, W + T, H, C]``.
        v_all: values ``[B, W + T, H, M]``.
        window: W, the number of most recent tokens (the query's own
            included) attended with exact softmax.
        valid_all: optional ``[B, W + T]``, 1 for real keys (the buffer's
            validity, then the piece's key mask).
        initial_state: optional ``(S [B, H, C, M], z [B, H, C])`` of the keys
            older than the buffer.
        return_state: also return the linear part's final state (every key
            but the last W).
        scale: softmax logit scale; None means ``D ** -0.5``.
        chunk_size: chunk length of the linear part's causal algorithm.
        eps: relative guard of the shared denominator: replaced only where
            ``|den| <= eps * (softmax terms + |phi(q)| . |z|)`` (a row with no
            real key gets 0), as in `keras_linattn.ops.linear_attention`.
        gamma: optional ``[H]`` positive weights of the softmax terms (the
            linear terms have weight 1); None is weight 1.
        soft_cap: None, or ``c > 0``: each window score ``s`` (scaled) is
            replaced by ``c * tanh(s / c)`` (Gemma 2's attention logit soft
            cap). The linear terms are not capped (see the module docstring).

    Returns:
        ``[B, T, H, M]`` in ``v_all``'s dtype (and ``(S, z)`` if `return_state`).
        The new buffer is the last W entries of `k_all`, `v_all`, `valid_all`.

    Raises:
        KernelUnderflowError: eagerly, for a row with a real key (or a
            carried state) whose every term underflowed float32 (in a graph
            such rows are NaN), as `keras_linattn.ops.linear_attention`.
    """
    window = check_positive_int("window", window)
    check_rank("q", q, 4)
    _validate_inputs(q_features, k_features_all, v_all, valid_all, names=("q_features", "k_features_all", "v_all"))
    _validate_inputs(q, k_all, None, valid_all, names=("q", "k_all", "v_all"))
    t, total = q.shape[1], k_all.shape[1]
    if t is not None and total is not None and total != t + window:
        raise ValueError(
            f"`k_all` must hold the W={window} buffered keys then the T={t} keys of the piece. "
            f"Received: k_all.shape={tuple(k_all.shape)}, q.shape={tuple(q.shape)}"
        )
    if initial_state is not None:
        _check_state(initial_state, q_features.shape[2], q_features.shape[3], v_all.shape[3], name="initial_state")
    scale = _check_scale(scale, q)
    soft_cap = _check_soft_cap(soft_cap)
    check_epsilon("eps", eps, allow_zero=True)
    out_dtype = v_all.dtype
    batch, length = ops.shape(q)[0], ops.shape(q)[1]
    h, d, m = q.shape[2], q.shape[3], v_all.shape[3]
    if valid_all is None:
        valid_all = ops.ones(ops.shape(k_all)[:2], "bool")
    valid_all = ops.cast(valid_all, "bool")  # [B, W + T]

    # Linear part: query i against the keys that have left its window, k_all[: i + 1].
    qf = _heads_first(ops.cast(q_features, "float32"))  # [B, H, T, C]
    kf = _heads_first(_mask_keys(ops.cast(k_features_all, "float32"), valid_all)[:, :length])  # [B, H, T, C]
    vv = _mask_keys(ops.cast(v_all, "float32"), valid_all)  # [B, W + T, H, M]
    s0 = z0 = None
    if initial_state is not None:
        s0, z0 = (ops.cast(x, "float32") for x in initial_state)
    num, den, den_abs, state = _causal_chunked(qf, kf, _heads_first(vv[:, :length]), chunk_size, s0, z0, with_abs=True)

    # Softmax part: blocks of W queries against the 2W keys that can fall in their windows.
    pad = (window - length % window) % window
    qs = _heads_first(ops.cast(q, "float32")) * scale  # [B, H, T, D]
    qs = ops.pad(qs, [[0, 0], [0, 0], [0, pad], [0, 0]])  # [B, H, N*W, D]
    ks = ops.pad(_heads_first(ops.cast(k_all, "float32")), [[0, 0], [0, 0], [0, pad], [0, 0]])  # [B, H, (N+1)W, D]
    vs = ops.pad(_heads_first(vv), [[0, 0], [0, 0], [0, pad], [0, 0]])  # [B, H, (N+1)W, M]
    ok = ops.pad(valid_all, [[0, 0], [0, pad]])  # [B, (N+1)W]
    qb = ops.reshape(qs, (batch, h, -1, window, d))  # [B, H, N, W, D]
    kb = ops.reshape(ks, (batch, h, -1, window, d))  # [B, H, N+1, W, D]
    vb = ops.reshape(vs, (batch, h, -1, window, m))  # [B, H, N+1, W, M]
    okb = ops.reshape(ok, (batch, -1, window))  # [B, N+1, W]
    kwin = ops.concatenate([kb[:, :, :-1], kb[:, :, 1:]], axis=3)  # [B, H, N, 2W, D]
    vwin = ops.concatenate([vb[:, :, :-1], vb[:, :, 1:]], axis=3)  # [B, H, N, 2W, M]
    okwin = ops.concatenate([okb[:, :-1], okb[:, 1:]], axis=2)  # [B, N, 2W]
    r = ops.arange(window)[:, None]  # [W, 1] query offset in its block
    j = ops.arange(2 * window)[None, :]  # [1, 2W] key offset (the block's buffer start = 0)
    band = ops.logical_and(j >= r + 1, j <= r + window)  # [W, 2W]: keys (i - W, i]
    allowed = ops.logical_and(band, okwin[:, None, :, None, :])  # [B, 1, N, W, 2W]
    scores = _cap(_matmul(qb, kwin, transpose_b=True), soft_cap)  # [B, H, N, W, 2W]
    e = _softmax_terms(scores, allowed)  # [B, H, N, W, 2W]
    gamma = _check_gamma(gamma, h)
    if gamma is not None:
        e = e * gamma[None, :, None, None, None]  # [B, H, N, W, 2W]
    num_sm = ops.reshape(ops.matmul(e, vwin), (batch, h, -1, m))[:, :, :length]  # [B, H, T, M]
    den_sm = ops.reshape(ops.sum(e, axis=-1), (batch, h, -1, 1))[:, :, :length]  # [B, H, T, 1]

    # The softmax terms are positive: they add to the denominator's magnitude as they are.
    den_abs = den_abs + den_sm  # [B, H, T, 1]
    out = _normalize(qf, num + num_sm, den + den_sm, eps, den_abs)  # [B, H, T, M]
    # The rule of `linear_attention`: a row with a real key that has left its window (or a carried state)
    # and no term left raises eagerly, NaN in a graph. A row with a real key in its window has softmax
    # terms (the largest is 1), so it is never flagged.
    out = _mark_underflow(out, qf, den_abs, _has_keys(valid_all[:, :length], True, z0, qf, length))
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), out_dtype)  # [B, T, H, M]
    if return_state:
        return out, state
    return out


def window_attention_step(
    q_t,
    q_features_t,
    k_t,
    v_t,
    k_features_evicted,
    buffer,
    state,
    key_mask_t=None,
    scale=None,
    eps=DEFAULT_EPSILON,
    gamma=None,
    soft_cap=None,
):
    """One decoding step of the hybrid.

    Grouped-query attention: the keys and values may have ``G`` heads, a
    divisor of ``H``, where query head ``h`` reads key/value head
    ``h // (H / G)``. ``k_t``, ``v_t`` and the buffer then have ``G`` heads
    (the buffer is read in place, never repeated to ``H``), and
    ``k_features_evicted`` has ``H`` (each query head's map of the oldest
    key). ``G = H`` is ordinary multi-head attention.

    Args:
        q_t: raw query ``[B, H, D]``; q_features_t: ``phi(q_t)`` ``[B, H, C]``.
        k_t: raw key ``[B, G, D]``; v_t: value ``[B, G, M]``.
        k_features_evicted: ``phi`` of the oldest buffered key,
            ``phi(buffer[0][:, 0])`` (its head repeated to each query head
            that reads it), ``[B, H, C]``: it leaves the window now.
        buffer: ``(keys [B, W, G, D], values [B, W, G, M], valid [B, W])``,
            oldest first.
        state: ``(S [B, H, C, M], z [B, H, C])`` of the keys older than the buffer.
        key_mask_t: optional ``[B]``: a padded token takes its place in the
            window but is never attended.
        scale, eps, gamma, soft_cap: as in `window_attention`.

    Returns:
        ``(out_t [B, H, M], (S, z), (keys, values, valid))``, all state float32.
    """
    check_rank("q_t", q_t, 3)
    check_rank("k_t", k_t, 3)
    _check_state(state, q_features_t.shape[1], q_features_t.shape[2], v_t.shape[2])
    if not isinstance(buffer, (tuple, list)) or len(buffer) != 3:
        raise ValueError(f"`buffer` must be (keys, values, valid). Received: buffer={buffer!r}")
    groups = _query_heads_per_key_head(q_t, k_t, v_t, buffer)
    scale = _check_scale(scale, q_t)
    soft_cap = _check_soft_cap(soft_cap)
    out_dtype = v_t.dtype
    keys, values, valid = (ops.cast(x, "float32") for x in buffer)  # [B, W, G, D], [B, W, G, M], [B, W]
    old_ok = valid[:, 0] > 0  # [B]
    kf_old = _mask_keys(ops.cast(k_features_evicted, "float32"), old_ok)  # [B, H, C]
    v_old = _mask_keys(_repeat_heads(values[:, 0], groups), old_ok)  # [B, H, M]
    s, z = (ops.cast(x, "float32") for x in state)
    s = s + ops.expand_dims(kf_old, -1) * ops.expand_dims(v_old, -2)  # [B, H, C, M]
    z = z + kf_old  # [B, H, C]
    if key_mask_t is None:
        new_ok = ops.ones_like(valid[:, :1])  # [B, 1]
        v_new = ops.cast(v_t, "float32")  # [B, H, M]: every token real, nothing to mask
    else:
        new_ok = ops.expand_dims(ops.cast(ops.cast(key_mask_t, "bool"), "float32"), 1)  # [B, 1]
        v_new = _mask_keys(ops.cast(v_t, "float32"), ops.squeeze(new_ok, axis=1) > 0)  # [B, H, M]
    keys = ops.concatenate([keys[:, 1:], ops.expand_dims(ops.cast(k_t, "float32"), 1)], axis=1)  # [B, W, H, D]
    values = ops.concatenate([values[:, 1:], ops.expand_dims(v_new, 1)], axis=1)  # [B, W, H, M]
    valid = ops.concatenate([valid[:, 1:], new_ok], axis=1)  # [B, W]

    q = ops.cast(q_t, "float32")  # [B, H, D]
    qf = ops.cast(q_features_t, "float32")  # [B, H, C]
    if groups == 1:
        # One key/value head per query head: the softmax part in the buffer's own layout, key axis first
        # (``[B, W, H]``), as broadcast products summed over D and over W. An einsum would copy the
        # [B, W, H, D] keys and values to heads-first on every step for H matrix-vector products, which
        # at decode sizes cost more than the products themselves.
        scores = _cap(ops.sum(ops.expand_dims(q * scale, 1) * keys, axis=-1), soft_cap)  # [B, W, H]
        e = _softmax_terms(scores, ops.expand_dims(valid > 0, -1), axis=1)  # [B, W, H]
        gamma = _check_gamma(gamma, q_t.shape[1])
        if gamma is not None:
            e = e * gamma[None, None, :]  # [B, W, H]
        num_sm = ops.sum(ops.expand_dims(e, -1) * values, axis=1)  # [B, H, M]
        den_sm = ops.expand_dims(ops.sum(e, axis=1), -1)  # [B, H, 1]
    else:
        # Grouped heads: each group's H / G queries against its key/value head are small matrix products.
        scores = _cap(_grouped_scores(q * scale, keys, groups), soft_cap)  # [B, H, W]
        e = _softmax_terms(scores, (valid > 0)[:, None, :])  # [B, H, W]
        gamma = _check_gamma(gamma, q_t.shape[1])
        if gamma is not None:
            e = e * gamma[None, :, None]  # [B, H, W]
        num_sm = _grouped_readout(e, values, groups)  # [B, H, M]
        den_sm = ops.sum(e, axis=-1, keepdims=True)  # [B, H, 1]
    # A batched product rather than an einsum: 3 ONNX nodes where the einsum lowers to ~20 (its
    # reshapes read the dynamic batch size); the same products over C.
    num = num_sm + ops.squeeze(ops.matmul(ops.expand_dims(qf, 2), s), axis=2)  # [B, H, M]
    den = den_sm + ops.sum(qf * z, axis=-1, keepdims=True)  # [B, H, 1]
    den_abs = den_sm + ops.sum(ops.abs(qf) * ops.abs(z), axis=-1, keepdims=True)  # [B, H, 1]
    out = _normalize(qf, num, den, eps, den_abs)  # [B, H, M]
    # Keys that have left the window are known through the state only (as in a masked plain step).
    # `sum |z| > 0` is `any(z != 0)` (a sum of non-negative terms is 0 only if each is; the two differ
    # only for a NaN in z, whose output is NaN already): 2 ONNX nodes beside |z| (shared with den_abs)
    # where `any` and `!=` lower to 5.
    out = _mark_underflow(out, qf, den_abs, ops.sum(ops.abs(z), axis=-1, keepdims=True) > 0)
    return ops.cast(out, out_dtype), (s, z), (keys, values, valid)


def _query_heads_per_key_head(q_t, k_t, v_t, buffer):
    """``H / G`` for a step's query heads ``H`` and key/value heads ``G`` (1 without grouping)."""
    heads, kv_heads = q_t.shape[1], k_t.shape[1]
    shapes = {"k_t": k_t.shape[1], "v_t": v_t.shape[1]}
    shapes.update({"buffer keys": buffer[0].shape[2], "buffer values": buffer[1].shape[2]})
    if heads is None or any(g is None for g in shapes.values()):
        return 1  # unknown head counts: read as H = G (the shapes then have to agree at run time)
    if len(set(shapes.values())) != 1 or heads % kv_heads:
        raise ValueError(
            "The keys, values and buffer must have the same number of heads G, a divisor of the "
            f"query heads H = {heads}. Received: {shapes}"
        )
    return heads // kv_heads


def _repeat_heads(x, groups):
    """``[B, G, X]`` -> ``[B, G * groups, X]``: key/value head g serves query heads g * groups ... + groups - 1."""
    return x if groups == 1 else ops.repeat(x, groups, axis=1)


def _grouped_scores(q, keys, groups):
    """``q . k`` of each query head ``[B, H, D]`` with its group's buffered keys ``[B, W, G, D]``: ``[B, H, W]``."""
    kv_heads = keys.shape[2]
    grouped = ops.reshape(q, (-1, kv_heads, groups, ops.shape(q)[-1]))  # [B, G, H / G, D]
    return ops.reshape(ops.einsum("bgqd,bwgd->bgqw", grouped, keys), (-1, kv_heads * groups, ops.shape(keys)[1]))


def _grouped_readout(e, values, groups):
    """``sum_w e[h, w] v[w, group(h)]`` for ``e [B, H, W]`` and values ``[B, W, G, M]``: ``[B, H, M]``."""
    kv_heads = values.shape[2]
    grouped = ops.reshape(e, (-1, kv_heads, groups, ops.shape(e)[-1]))  # [B, G, H / G, W]
    return ops.reshape(ops.einsum("bgqw,bwgm->bgqm", grouped, values), (-1, kv_heads * groups, ops.shape(values)[-1]))


def window_attention_reference(
    q,
    q_features,
    k,
    k_features,
    v,
    window,
    key_mask=None,
    scale=None,
    eps=DEFAULT_EPSILON,
    compute_dtype="float64",
    gamma=None,
    soft_cap=None,
):
    """The oracle: every (query, key) weight written out, ``[T, T]`` per head, in ``compute_dtype``.

    Self-attention over one sequence from an empty state (``q, k [B, T, H, D]``,
    features ``[B, T, H, C]``, ``v [B, T, H, M]``, ``key_mask [B, T]``);
    `scale`, `eps`, `gamma` and `soft_cap` as in `window_attention`.
    """
    window = check_positive_int("window", window)
    _validate_inputs(q, k, v, key_mask, causal=True, names=("q", "k", "v"))
    scale = _check_scale(scale, q)
    soft_cap = _check_soft_cap(soft_cap)
    cast = lambda x: ops.cast(x, compute_dtype)  # noqa: E731
    t = q.shape[1]
    s = _cap(ops.einsum("bthd,bshd->bhts", cast(q), cast(k)) * scale, soft_cap)  # [B, H, T, T]
    lin = ops.einsum("bthc,bshc->bhts", cast(q_features), cast(k_features))  # [B, H, T, T]
    i = ops.arange(t)[:, None]
    j = ops.arange(t)[None, :]
    in_window = ops.logical_and(j <= i, j > i - window)[None, None]  # [1, 1, T, T]
    older = (j <= i - window)[None, None]  # [1, 1, T, T]
    if key_mask is not None:
        real = ops.cast(key_mask, "bool")[:, None, None, :]  # [B, 1, 1, T]
        in_window = ops.logical_and(in_window, real)
        older = ops.logical_and(older, real)
    peak = ops.max(ops.where(in_window, s, ops.full_like(s, _NEG)), axis=-1, keepdims=True)
    weights = ops.where(in_window, ops.exp(ops.minimum(s - peak, 0.0)), ops.zeros_like(s))
    if gamma is not None:
        weights = weights * ops.cast(gamma, compute_dtype)[None, :, None, None]  # [B, H, T, T]
    weights = weights + ops.where(older, lin, ops.zeros_like(lin))  # [B, H, T, T]
    vv = cast(v)
    if key_mask is not None:
        vv = _mask_keys(vv, key_mask)
    num = ops.einsum("bhts,bshm->bthm", weights, vv)  # [B, T, H, M]
    den = ops.transpose(ops.sum(weights, axis=-1), (0, 2, 1))[..., None]  # [B, T, H, 1]
    den_abs = ops.transpose(ops.sum(ops.abs(weights), axis=-1), (0, 2, 1))[..., None]  # [B, T, H, 1]
    return ops.cast(num / _guarded_denominator(den, den_abs, eps), v.dtype)
