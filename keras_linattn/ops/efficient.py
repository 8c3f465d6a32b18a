"""Efficient attention (Shen et al. 2021), optionally with Linformer projections, as pure functions.

Shape legend: B batch, T query length, S key length, H heads, D key dim,
M value dim, K projected length, N the projections' maximum length.

Per batch row and head, with queries ``q [T, D]``, keys ``k [S, D]`` and
values ``v [S, M]``:

    out = softmax_D(q) . (softmax_S(k)^T . v)                  (no projection)
    out = softmax_D(q) . (softmax_K(E k)^T . (F v))             (E, F: [K, N])

``softmax_D`` normalizes each query over its D features, ``softmax_S`` /
``softmax_K`` each key feature over the (projected) sequence. The product is
evaluated right to left: the context ``[D, M]`` per head is formed first, so
no ``T x S`` (or ``T x K``) matrix ever exists and the cost is
``O(S * K * (D + M) + T * D * M)``. A key sequence of length ``S <= N`` uses
the first S columns of E and F. Everything is accumulated in float32 and
returned in the dtype of ``v``. `keras_linattn.ops.efficient_attention_reference`
is the quadratic oracle of this function.
"""

from keras import ops

from keras_linattn.ops._common import _mask_keys, _validate_inputs

__all__ = ["efficient_attention"]

# Finite stand-in for -inf before the softmax over the sequence: an all-padded
# row then gives exp(0) * 0 = 0 instead of NaN, in the forward and backward pass.
_NEG_LARGE = -1e30


def _check_projections(k, projection_key, projection_value):
    """Both Linformer projections or neither; ``[K, N]`` each, ``N >= S`` when known.

    Raises:
        ValueError: naming the argument and the shape received.
    """
    if (projection_key is None) != (projection_value is None):
        raise ValueError(
            "`projection_key` and `projection_value` go together: pass both or neither. "
            f"Received: projection_key is None: {projection_key is None}, "
            f"projection_value is None: {projection_value is None}"
        )
    if projection_key is None:
        return
    for name, p in (("projection_key", projection_key), ("projection_value", projection_value)):
        if len(p.shape) != 2:
            raise ValueError(f"`{name}` must have rank 2 [K, N]. Received: {name}.shape={tuple(p.shape)}")
    if tuple(projection_key.shape) != tuple(projection_value.shape):
        raise ValueError(
            "`projection_key` and `projection_value` must have the same shape [K, N]. "
            f"Received: {tuple(projection_key.shape)} and {tuple(projection_value.shape)}"
        )
    n, s = projection_key.shape[1], k.shape[1]
    if n is not None and s is not None and s > n:
        raise ValueError(
            f"The key length exceeds the projections' length N={n}. Received: key length {s}, "
            f"projection_key.shape={tuple(projection_key.shape)}"
        )


def efficient_attention(q, k, v, key_mask=None, projection_key=None, projection_value=None):
    """Efficient attention of projected heads, right to left.

    Args:
        q: queries ``[B, T, H, D]`` (raw: the softmax over D is applied here).
        k: keys ``[B, S, H, D]`` (raw: the softmax over the sequence is applied here).
        v: values ``[B, S, H, M]``.
        key_mask: optional ``[B, S]`` boolean/0-1 mask, nonzero for real keys.
            Without projections, padded keys get weight 0 in the softmax over
            S; with them, padded keys and values are zeroed before E and F
            (their columns drop out). A row with no real key gives 0.
        projection_key, projection_value: optional Linformer projections
            ``E, F [K, N]`` with ``N >= S``; both or neither.

    Returns:
        ``[B, T, H, M]`` in the dtype of ``v``.
    """
    _validate_inputs(q, k, v, key_mask, names=("q", "k", "v"))
    _check_projections(k, projection_key, projection_value)
    out_dtype = v.dtype
    q = ops.softmax(ops.cast(q, "float32"), axis=-1)  # [B, T, H, D]
    k = _mask_keys(ops.cast(k, "float32"), key_mask)  # [B, S, H, D]
    v = _mask_keys(ops.cast(v, "float32"), key_mask)  # [B, S, H, M]
    if projection_key is None:
        weights = _softmax_over_keys(k, key_mask)  # [B, S, H, D]
        context = ops.einsum("bshd,bshm->bhdm", weights, v)  # [B, H, D, M]
    else:
        length = ops.shape(k)[1]
        e = ops.cast(projection_key[:, :length], "float32")  # [K, S]
        f = ops.cast(projection_value[:, :length], "float32")  # [K, S]
        kp = ops.einsum("ks,bshd->bkhd", e, k)  # [B, K, H, D]
        vp = ops.einsum("ks,bshm->bkhm", f, v)  # [B, K, H, M]
        weights = ops.softmax(kp, axis=1)  # [B, K, H, D]
        context = ops.einsum("bkhd,bkhm->bhdm", weights, vp)  # [B, H, D, M]
    out = ops.einsum("bthd,bhdm->bthm", q, context)  # [B, T, H, M]
    return ops.cast(out, out_dtype)


def _softmax_over_keys(k, key_mask):
    """Softmax of ``k [B, S, H, D]`` over S; padded keys get weight 0.

    A batch row whose keys are all padded gets all-zero weights (so a zero
    context), never NaN.
    """
    if key_mask is None:
        return ops.softmax(k, axis=1)  # [B, S, H, D]
    keep = ops.cast(key_mask, "bool")[:, :, None, None]  # [B, S, 1, 1]
    logits = ops.where(keep, k, ops.full_like(k, _NEG_LARGE))  # [B, S, H, D]
    peak = ops.stop_gradient(ops.max(logits, axis=1, keepdims=True))  # [B, 1, H, D]
    expd = _mask_keys(ops.exp(logits - peak), key_mask)  # [B, S, H, D]
    total = ops.sum(expd, axis=1, keepdims=True)  # [B, 1, H, D]
    return expd / ops.where(total > 0, total, ops.ones_like(total))  # [B, S, H, D]
