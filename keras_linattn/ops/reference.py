"""Exact quadratic-time attention, the oracles that the fast paths are tested against.

Shape legend: B batch, T query length, S key length, H heads, D key dim,
C feature dim, M value dim, K projected length.
"""

from keras import ops

from keras_linattn.ops._common import _validate_inputs
from keras_linattn.ops.efficient import _check_projections

__all__ = [
    "efficient_attention_reference",
    "kernel_attention_reference",
    "kernel_attention_weights",
    "softmax_attention",
    "softmax_attention_weights",
]


def _length(x):
    """The length (axis 1) of ``x [B, T, ...]``: static where known, else the tensor's (e.g. after a short
    convolution inside a traced function, whose output's length is not static)."""
    return x.shape[1] if x.shape[1] is not None else ops.shape(x)[1]


def _pair_mask(batch_t, batch_s, causal, key_mask, t, s):
    """[B, 1, T, S] boolean mask of allowed (query, key) pairs, or None."""
    mask = None
    if causal:
        mask = ops.tril(ops.ones((t, s), dtype="bool"))[None, None]  # [1, 1, T, S]
    if key_mask is not None:
        km = ops.cast(key_mask, "bool")[:, None, None, :]  # [B, 1, 1, S]
        mask = km if mask is None else ops.logical_and(mask, km)
    return mask


def kernel_attention_reference(q_features, k_features, v, causal=False, key_mask=None, compute_dtype="float64"):
    """Quadratic kernel attention: ``A = phi(q) phi(k)^T``, ``out = A v / A 1``.

    Same contract as `keras_linattn.ops.linear_attention` (features
    ``[B, T, H, C]``, ``[B, S, H, C]``, values ``[B, S, H, M]``), computed
    the slow, obvious way in ``compute_dtype`` (float64: an oracle whose own
    rounding error is negligible next to float32's) and returned in ``v``'s
    dtype. Rows with no allowed key give 0. Refuses the inputs
    `linear_attention` refuses, with the same messages.
    """
    _validate_inputs(q_features, k_features, v, key_mask, causal)
    q = ops.cast(q_features, compute_dtype)
    k = ops.cast(k_features, compute_dtype)
    v32 = ops.cast(v, compute_dtype)
    t, s = _length(q), _length(k)
    scores = ops.einsum("bthc,bshc->bhts", q, k)  # [B, H, T, S]
    mask = _pair_mask(None, None, causal, key_mask, t, s)
    if mask is not None:
        scores = ops.where(mask, scores, ops.zeros_like(scores))
    num = ops.einsum("bhts,bshm->bthm", scores, v32)  # [B, T, H, M]
    den = ops.transpose(ops.sum(scores, axis=-1), (0, 2, 1))[..., None]  # [B, T, H, 1]
    safe = ops.where(ops.equal(den, 0.0), ops.ones_like(den), den)
    return ops.cast(num / safe, v.dtype)


def kernel_attention_weights(q_features, k_features, causal=False, key_mask=None, compute_dtype="float32"):
    """Normalized linear-attention weights ``[B, H, T, S]`` (rows sum to 1).

    Computed in ``compute_dtype``: float32 by default, because the
    distillation loss trains through it (pass "float64" for an oracle).
    """
    _validate_inputs(q_features, k_features, None, key_mask, causal)
    q = ops.cast(q_features, compute_dtype)
    k = ops.cast(k_features, compute_dtype)
    scores = ops.einsum("bthc,bshc->bhts", q, k)  # [B, H, T, S]
    mask = _pair_mask(None, None, causal, key_mask, _length(q), _length(k))
    if mask is not None:
        scores = ops.where(mask, scores, ops.zeros_like(scores))
    den = ops.sum(scores, axis=-1, keepdims=True)
    return scores / ops.where(ops.equal(den, 0.0), ops.ones_like(den), den)


def softmax_attention_weights(q, k, causal=False, key_mask=None, scale=None, compute_dtype="float32"):
    """Softmax attention weights ``[B, H, T, S]`` of raw queries/keys ``[B, *, H, D]``.

    `scale` multiplies the logits; None means ``D ** -0.5``. Computed in
    ``compute_dtype``: float32 by default, because the distillation loss
    trains through it (pass "float64" for an oracle).
    """
    _validate_inputs(q, k, None, key_mask, causal, names=("q", "k", "v"))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"`scale` must be a number or None. Received: scale={scale!r}")
    q = ops.cast(q, compute_dtype)
    k = ops.cast(k, compute_dtype)
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    logits = ops.einsum("bthd,bshd->bhts", q, k) * scale  # [B, H, T, S]
    mask = _pair_mask(None, None, causal, key_mask, _length(q), _length(k))
    if mask is not None:
        logits = ops.where(mask, logits, ops.full_like(logits, -1e30))
    weights = ops.softmax(logits, axis=-1)
    if mask is not None:
        weights = ops.where(mask, weights, ops.zeros_like(weights))
    return weights


def softmax_attention(q, k, v, causal=False, key_mask=None, scale=None, compute_dtype="float64"):
    """Exact softmax attention ``[B, T, H, M]`` of queries/keys ``[B, *, H, D]``.

    Computed in ``compute_dtype`` (float64: an oracle) and returned in ``v``'s dtype.
    """
    _validate_inputs(q, k, v, key_mask, causal, names=("q", "k", "v"))
    weights = softmax_attention_weights(q, k, causal, key_mask, scale, compute_dtype)  # [B, H, T, S]
    out = ops.einsum("bhts,bshm->bthm", weights, ops.cast(v, compute_dtype))
    return ops.cast(out, v.dtype)


def efficient_attention_reference(
    q, k, v, key_mask=None, projection_key=None, projection_value=None, compute_dtype="float64"
):
    """Efficient attention the obvious way: the attention matrix, then its product with the values.

    Same contract as `keras_linattn.ops.efficient_attention` (queries ``[B, T, H, D]``,
    keys ``[B, S, H, D]``, values ``[B, S, H, M]``, projections ``E, F [K, N]``),
    evaluated left to right: ``A = softmax_D(q) softmax_S(k)^T`` (``[B, H, T, S]``)
    or ``A = softmax_D(q) softmax_K(E k)^T`` (``[B, H, T, K]``), then ``A v`` or
    ``A (F v)``. Padded keys are left out of the softmax over S (weight 0); with
    projections, padded keys and values are zeroed, so their columns of E and F
    contribute nothing. Computed in ``compute_dtype`` (float64: an oracle) and
    returned in ``v``'s dtype; a row with no real key gives 0.
    """
    _validate_inputs(q, k, v, key_mask, names=("q", "k", "v"))
    _check_projections(k, projection_key, projection_value)
    out_dtype = v.dtype
    q = ops.softmax(ops.cast(q, compute_dtype), axis=-1)  # [B, T, H, D]
    k = ops.cast(k, compute_dtype)  # [B, S, H, D]
    v = ops.cast(v, compute_dtype)  # [B, S, H, M]
    allowed = None if key_mask is None else ops.cast(key_mask, "bool")[:, :, None, None]  # [B, S, 1, 1]
    if allowed is not None:
        v = ops.where(allowed, v, ops.zeros_like(v))  # [B, S, H, M]
    if projection_key is None:
        if allowed is None:
            weights = ops.softmax(k, axis=1)  # [B, S, H, D]
        else:
            peak = ops.max(ops.where(allowed, k, ops.full_like(k, -float("inf"))), axis=1, keepdims=True)
            peak = ops.stop_gradient(ops.where(ops.isfinite(peak), peak, ops.zeros_like(peak)))  # [B, 1, H, D]
            expd = ops.where(allowed, ops.exp(ops.where(allowed, k, peak) - peak), ops.zeros_like(k))  # [B, S, H, D]
            total = ops.sum(expd, axis=1, keepdims=True)  # [B, 1, H, D]
            weights = expd / ops.where(total > 0, total, ops.ones_like(total))  # [B, S, H, D]
        attn = ops.einsum("bthd,bshd->bhts", q, weights)  # [B, H, T, S]
        out = ops.einsum("bhts,bshm->bthm", attn, v)  # [B, T, H, M]
    else:
        if allowed is not None:
            k = ops.where(allowed, k, ops.zeros_like(k))  # [B, S, H, D]
        length = k.shape[1]
        e = ops.cast(projection_key[:, :length], compute_dtype)  # [K, S]
        f = ops.cast(projection_value[:, :length], compute_dtype)  # [K, S]
        kp = ops.softmax(ops.einsum("ks,bshd->bkhd", e, k), axis=1)  # [B, K, H, D]
        vp = ops.einsum("ks,bshm->bkhm", f, v)  # [B, K, H, M]
        attn = ops.einsum("bthd,bkhd->bhtk", q, kp)  # [B, H, T, K]
        out = ops.einsum("bhtk,bkhm->bthm", attn, vp)  # [B, T, H, M]
    return ops.cast(out, out_dtype)
