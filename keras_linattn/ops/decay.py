"""Decay-gated causal linear attention: ``S_t = diag(a_t) S_{t-1} + phi(k_t) v_t^T``.

One recurrence, three forms side by side (chunkwise-parallel training path,
recurrent step, float64 per-token oracle), as every recurrence in `ops/`.

Shape legend: B batch, T length, H heads, C feature dim, M value dim,
G gate width (1 for a scalar per head, C for a gate per key channel),
L chunk length, N number of chunks.

The gate enters as its logarithm ``log_decay = log a_t <= 0``
(``[B, T, H, G]``): RetNet's fixed decay, Mamba2's data-dependent scalar and
GLA's per-channel gates are the same computation with different ``log_decay``
(see `keras_linattn.layers.LinearAttention`'s ``decay``):

    S_t = a_t S_{t-1} + phi(k_t) v_t^T,   z_t = a_t z_{t-1} + phi(k_t)
    out_t = phi(q_t)^T S_t / phi(q_t)^T z_t         (normalize=True)
    out_t = phi(q_t)^T S_t                          (normalize=False)

Chunked form. Inside a chunk let ``b_i = sum_{s <= i} log a_s`` (a float32
cumulative sum, non-increasing). Then the weight of key j for query i (both in
the chunk, ``j <= i``) is ``phi(q_i) . (exp(b_i - b_j) * phi(k_j))``, the
carried state enters query i as ``exp(b_i)`` and key j leaves the chunk
decayed by ``exp(b_last - b_j)``. Across chunks the same holds with the chunk
totals. Only differences of cumulative sums are exponentiated, and every
difference that is exponentiated is ``<= 0``: nothing under- or overflows
however long the sequence (a bare ``exp(cumsum)`` does).

Padding: a padded step (``key_mask`` False) neither writes nor decays the
state: its key, value and log-decay are set to 0 (with `where`, so NaN/Inf
junk cannot leak).
"""

from keras import ops

from keras_linattn._validation import check_bool, check_epsilon, check_positive_int, check_rank
from keras_linattn.ops._common import (
    _check_state,
    _guarded_denominator,
    _has_keys,
    _heads_first,
    _mark_underflow,
    _mask_keys,
    _matmul,
    _normalize,
    _step_has_keys,
    _validate_inputs,
)
from keras_linattn.ops.core import DEFAULT_EPSILON

__all__ = [
    "CHANNEL_CHUNK",
    "gated_linear_attention",
    "gated_linear_attention_reference",
    "gated_linear_attention_step",
]

# Longest chunk used with per-channel gates: the intra-chunk weights are an
# [L, L, C] tensor per chunk (memory T * L * C per head), so the chunk is kept short.
CHANNEL_CHUNK = 16


def _check_log_decay(log_decay, q_features, name="log_decay", rank=4):
    check_rank(name, log_decay, rank)
    g, c = log_decay.shape[-1], q_features.shape[-1]
    if g is not None and c is not None and g not in (1, c):
        raise ValueError(
            f"`{name}` must have a last dim of 1 (one gate per head) or C={c} (one per feature "
            f"channel). Received: {name}.shape={tuple(log_decay.shape)}"
        )
    leading = tuple(log_decay.shape[:-1])
    expected = tuple(q_features.shape[:-1])
    if any(a is not None and b is not None and a != b for a, b in zip(leading, expected, strict=True)):
        raise ValueError(
            f"`{name}` must have the leading dims of the query features {expected}. "
            f"Received: {name}.shape={tuple(log_decay.shape)}"
        )


def _initial(initial_state):
    if initial_state is None:
        return None, None
    return tuple(ops.cast(x, "float32") for x in initial_state)


def gated_linear_attention(
    q_features,
    k_features,
    v,
    log_decay,
    key_mask=None,
    chunk_size=64,
    initial_state=None,
    return_state=False,
    normalize=True,
    eps=DEFAULT_EPSILON,
):
    """Causal linear attention with a decaying state, chunkwise-parallel.

    Args:
        q_features: ``phi(q)``, ``[B, T, H, C]``.
        k_features: ``phi(k)``, ``[B, T, H, C]``.
        v: values, ``[B, T, H, M]``.
        log_decay: ``log a_t <= 0``, ``[B, T, H, 1]`` (one gate per head) or
            ``[B, T, H, C]`` (one per feature channel). Positive values are
            not checked (they would make the state grow).
        key_mask: optional ``[B, T]``, 1 for real tokens. A padded step
            neither writes nor decays the state.
        chunk_size: chunk length L (at most `CHANNEL_CHUNK` with channel
            gates). Any T is accepted.
        initial_state: optional ``(S [B, H, C, M], z [B, H, C])``.
        return_state: also return the final float32 state.
        normalize: divide by ``phi(q_t) . z_t`` (guarded as in
            `keras_linattn.ops.linear_attention`); False returns the
            numerator ``phi(q_t)^T S_t``.
        eps: relative guard of the denominator.

    Returns:
        ``[B, T, H, M]`` in ``v``'s dtype (and ``(S, z)`` if `return_state`).

    Raises:
        KernelUnderflowError: eagerly, for a row with a real key (or a
            carried state) whose every term underflowed float32 (in a graph
            such rows are NaN), as `keras_linattn.ops.linear_attention`.
    """
    _validate_inputs(q_features, k_features, v, key_mask, causal=True)
    _check_log_decay(log_decay, q_features)
    if initial_state is not None:
        _check_state(initial_state, q_features.shape[2], q_features.shape[3], v.shape[3], name="initial_state")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    check_bool("normalize", normalize)
    check_epsilon("eps", eps, allow_zero=True)
    out_dtype = v.dtype
    q = _heads_first(ops.cast(q_features, "float32"))  # [B, H, T, C]
    k = _heads_first(_mask_keys(ops.cast(k_features, "float32"), key_mask))  # [B, H, T, C]
    v = _heads_first(_mask_keys(ops.cast(v, "float32"), key_mask))  # [B, H, T, M]
    g = _heads_first(_mask_keys(ops.cast(log_decay, "float32"), key_mask))  # [B, H, T, G]
    s0, z0 = _initial(initial_state)
    num, den, den_abs, state = _gated_chunked(q, k, v, g, chunk_size, s0, z0, with_abs=normalize)
    if normalize:
        out = _normalize(q, num, den, eps, den_abs)  # [B, H, T, M]
        # The rule of `linear_attention`: a row with a real key (or a carried state) whose every term
        # underflowed raises eagerly, NaN in a graph. The query's latest real key enters its row undecayed
        # (padded steps do not decay), so decay alone never empties a row: |phi(q)|.|z| <= KERNEL_FLOOR is underflow.
        num_keys = k.shape[2] if k.shape[2] is not None else ops.shape(k)[2]  # T
        out = _mark_underflow(out, q, den_abs, _has_keys(key_mask, True, z0, q, num_keys))
    else:
        out = num  # [B, H, T, M]
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), out_dtype)  # [B, T, H, M]
    if return_state:
        return out, state
    return out


def _decay_weights(diff, allowed):
    """``exp(diff)`` where `allowed` (there ``diff <= 0``), else 0; never exponentiates a positive number."""
    return ops.where(allowed, ops.exp(ops.minimum(diff, 0.0)), ops.zeros_like(diff))


def _gated_chunked(q, k, v, g, chunk_size, s0, z0, with_abs=False):
    """Chunkwise-parallel decayed attention on float32 heads-first tensors.

    ``q, k [B, H, T, C]``, ``v [B, H, T, M]``, ``g [B, H, T, G]`` (log decay,
    0 at padded steps). Returns ``(num [B, H, T, M], den [B, H, T, 1],
    den_abs, (S, z))``: ``den_abs`` (None unless `with_abs`) is the
    magnitude of the terms summed into ``den``, as in
    `keras_linattn.ops._common._causal_chunked`: ``sum_j |w_ij|`` over the
    chunk's own decayed weights plus ``|phi(q_i) exp(b_i)| . |z|`` of the
    carried state; it equals ``den`` for non-negative features.
    """
    h, c, m, width = q.shape[1], q.shape[3], v.shape[3], g.shape[3]
    channel = width != 1
    batch, length = ops.shape(q)[0], ops.shape(q)[2]
    chunk = min(chunk_size, CHANNEL_CHUNK) if channel else chunk_size
    if q.shape[2] is not None:
        chunk = max(1, min(chunk, q.shape[2]))
    # Both operands non-negative: floor and truncated modulo agree.
    pad = (chunk - length % chunk) % chunk
    paddings = [[0, 0], [0, 0], [0, pad], [0, 0]]
    qc = ops.reshape(ops.pad(q, paddings), (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    kc = ops.reshape(ops.pad(k, paddings), (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    vc = ops.reshape(ops.pad(v, paddings), (batch, h, -1, chunk, m))  # [B, H, N, L, M]
    gc = ops.reshape(ops.pad(g, paddings), (batch, h, -1, chunk, width))  # [B, H, N, L, G] (pad: no decay)
    b = ops.cumsum(gc, axis=3)  # [B, H, N, L, G], inclusive, non-increasing along L

    # Intra-chunk: weights phi(q_i) . (exp(b_i - b_j) phi(k_j)) for j <= i.
    idx = ops.arange(chunk)
    tril = idx[:, None] >= idx[None, :]  # [L, L]
    if channel:
        diff = b[:, :, :, :, None, :] - b[:, :, :, None, :, :]  # [B, H, N, L, L, C]
        w = _decay_weights(diff, tril[:, :, None])  # [B, H, N, L, L, C]
        scores = ops.sum(qc[:, :, :, :, None, :] * kc[:, :, :, None, :, :] * w, axis=-1)  # [B, H, N, L, L]
    else:
        bs = b[..., 0]  # [B, H, N, L]
        w = _decay_weights(bs[:, :, :, :, None] - bs[:, :, :, None, :], tril)  # [B, H, N, L, L]
        scores = _matmul(qc, kc, transpose_b=True) * w  # [B, H, N, L, L]
    num = ops.matmul(scores, vc)  # [B, H, N, L, M]
    den = ops.sum(scores, axis=-1, keepdims=True)  # [B, H, N, L, 1]
    den_abs = ops.sum(ops.abs(scores), axis=-1, keepdims=True) if with_abs else None  # [B, H, N, L, 1]

    # Each chunk's own state, decayed to the chunk's end.
    last = b[:, :, :, -1:, :]  # [B, H, N, 1, G] total log decay of each chunk
    k_out = kc * ops.exp(last - b)  # [B, H, N, L, C]  (last - b <= 0)
    u = _matmul(k_out, vc, transpose_a=True)  # [B, H, N, C, M]
    uz = ops.sum(k_out, axis=3)  # [B, H, N, C]

    # Across chunks: the state entering chunk n is
    # E_n = sum_{m < n} exp(Bx_n - Bc_m) U_m + exp(Bx_n) S_0, with Bc the
    # inclusive and Bx the exclusive cumulative sum of the chunk totals.
    total = last[:, :, :, 0, :]  # [B, H, N, G]
    bc = ops.cumsum(total, axis=2)  # [B, H, N, G]
    bx = bc - total  # [B, H, N, G]
    nidx = ops.arange(ops.shape(total)[2])
    strict = nidx[:, None] > nidx[None, :]  # [N, N]
    wn = _decay_weights(bx[:, :, :, None, :] - bc[:, :, None, :, :], strict[:, :, None])  # [B, H, N, N, G]
    if channel:
        wt = ops.transpose(wn, (0, 1, 4, 2, 3))  # [B, H, C, N, N]
        enter = ops.matmul(wt, ops.transpose(u, (0, 1, 3, 2, 4)))  # [B, H, C, N, M]
        enter = ops.transpose(enter, (0, 1, 3, 2, 4))  # [B, H, N, C, M]
        enter_z = ops.sum(wn * uz[:, :, None, :, :], axis=3)  # [B, H, N, C]
    else:
        w2 = wn[..., 0]  # [B, H, N, N]
        enter = ops.reshape(ops.matmul(w2, ops.reshape(u, (batch, h, -1, c * m))), (batch, h, -1, c, m))
        enter_z = ops.matmul(w2, uz)  # [B, H, N, C]
    # The final state: every chunk decayed to the end of the sequence.
    grand = ops.sum(total, axis=2)  # [B, H, G]
    to_end = ops.exp(grand[:, :, None, :] - bc)  # [B, H, N, G]  (<= 0 exponent)
    s_final = ops.sum(to_end[..., None] * u, axis=2)  # [B, H, C, M]
    z_final = ops.sum(to_end * uz, axis=2)  # [B, H, C]
    if s0 is not None:
        carried = ops.exp(bx)  # [B, H, N, G]
        enter = enter + carried[..., None] * s0[:, :, None]
        enter_z = enter_z + carried * z0[:, :, None]
        s_final = s_final + ops.exp(grand)[..., None] * s0
        z_final = z_final + ops.exp(grand) * z0

    q_in = qc * ops.exp(b)  # [B, H, N, L, C]: the carried state decays from the chunk start to i
    num = num + ops.matmul(q_in, enter)  # [B, H, N, L, M]
    den = den + ops.matmul(q_in, enter_z[..., None])  # [B, H, N, L, 1]
    num = ops.reshape(num, (batch, h, -1, m))[:, :, :length]  # [B, H, T, M]
    den = ops.reshape(den, (batch, h, -1, 1))[:, :, :length]  # [B, H, T, 1]
    if with_abs:
        den_abs = den_abs + ops.matmul(ops.abs(q_in), ops.abs(enter_z)[..., None])  # [B, H, N, L, 1]
        den_abs = ops.reshape(den_abs, (batch, h, -1, 1))[:, :, :length]  # [B, H, T, 1]
    return num, den, den_abs, (s_final, z_final)


def gated_linear_attention_step(
    q_t, k_t, v_t, log_decay_t, state, key_mask_t=None, normalize=True, eps=DEFAULT_EPSILON
):
    """One recurrent step: ``S <- a_t S + phi(k_t) v_t^T``, ``z <- a_t z + phi(k_t)``, then the readout.

    Args:
        q_t, k_t: features ``[B, H, C]``.
        v_t: values ``[B, H, M]``.
        log_decay_t: ``[B, H, 1]`` or ``[B, H, C]``.
        state: ``(S [B, H, C, M], z [B, H, C])``.
        key_mask_t: optional ``[B]``; a masked step leaves the state unchanged.
        normalize, eps: as in `gated_linear_attention`.

    Returns:
        ``(out_t [B, H, M], (S, z))`` with the state in float32.
    """
    check_rank("q_t", q_t, 3)
    check_rank("k_t", k_t, 3)
    check_rank("v_t", v_t, 3)
    _check_log_decay(log_decay_t, q_t, name="log_decay_t", rank=3)
    _check_state(state, q_t.shape[1], q_t.shape[2], v_t.shape[2])
    check_bool("normalize", normalize)
    out_dtype = v_t.dtype
    q = ops.cast(q_t, "float32")  # [B, H, C]
    k = _mask_keys(ops.cast(k_t, "float32"), key_mask_t)  # [B, H, C]
    v = _mask_keys(ops.cast(v_t, "float32"), key_mask_t)  # [B, H, M]
    a = ops.exp(_mask_keys(ops.cast(log_decay_t, "float32"), key_mask_t))  # [B, H, G]
    s, z = (ops.cast(x, "float32") for x in state)
    s = a[..., None] * s + k[..., :, None] * v[..., None, :]  # [B, H, C, M]
    z = a * z + k  # [B, H, C]
    num = ops.einsum("bhc,bhcm->bhm", q, s)  # [B, H, M]
    if normalize:
        den = ops.sum(q * z, axis=-1, keepdims=True)  # [B, H, 1]
        den_abs = ops.sum(ops.abs(q) * ops.abs(z), axis=-1, keepdims=True)  # [B, H, 1]
        num = _normalize(q, num, den, eps, den_abs)
        num = _mark_underflow(num, q, den_abs, _step_has_keys(z, key_mask_t))
    return ops.cast(num, out_dtype), (s, z)


def gated_linear_attention_reference(
    q_features,
    k_features,
    v,
    log_decay,
    key_mask=None,
    initial_state=None,
    normalize=True,
    eps=DEFAULT_EPSILON,
    compute_dtype="float64",
):
    """The oracle: the recurrence itself, one token at a time, in ``compute_dtype``.

    Same contract as `gated_linear_attention`; returns ``(out, (S, z))`` with
    ``out`` in ``v``'s dtype and the state in ``compute_dtype``.
    Differentiable (a Python loop of `keras.ops`), for gradient checks.
    """
    _validate_inputs(q_features, k_features, v, key_mask, causal=True)
    _check_log_decay(log_decay, q_features)
    cast = lambda x: ops.cast(x, compute_dtype)  # noqa: E731
    q, k, vv, g = cast(q_features), cast(k_features), cast(v), cast(log_decay)
    batch, length, h, c = q.shape
    m = vv.shape[-1]
    if initial_state is None:
        s = ops.zeros((batch, h, c, m), compute_dtype)
        z = ops.zeros((batch, h, c), compute_dtype)
    else:
        s, z = (cast(x) for x in initial_state)
    outs = []
    for t in range(length):
        keep = None if key_mask is None else ops.cast(key_mask, "bool")[:, t]  # [B]
        kt, vt, gt = (_mask_keys(x[:, t], keep) for x in (k, vv, g))  # [B, H, *]
        a = ops.exp(gt)  # [B, H, G]
        s = a[..., None] * s + kt[..., :, None] * vt[..., None, :]  # [B, H, C, M]
        z = a * z + kt  # [B, H, C]
        qt = q[:, t]  # [B, H, C]
        num = ops.einsum("bhc,bhcm->bhm", qt, s)  # [B, H, M]
        if normalize:
            den = ops.sum(qt * z, axis=-1, keepdims=True)  # [B, H, 1]
            den_abs = ops.sum(ops.abs(qt) * ops.abs(z), axis=-1, keepdims=True)  # [B, H, 1]
            num = num / _guarded_denominator(den, den_abs, eps)
        outs.append(num)
    out = ops.stack(outs, axis=1) if outs else ops.zeros((batch, 0, h, m), compute_dtype)  # [B, T, H, M]
    return ops.cast(out, v.dtype), (s, z)
