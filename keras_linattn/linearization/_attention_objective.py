"""Attention transfer's attention-weight objective (Hedgehog's) and the variables it may leave frozen.

Hedgehog (Zhang et al. 2024, arXiv 2402.04347) trains the feature map so
that the linear attention's weights match the softmax's: per layer, head and
query row, the cross-entropy

    CE_i = - sum_j p_ij log a_ij

between the teacher's softmax weights ``p_ij`` and the student's weights
``a_ij``, averaged over the unpadded rows, the heads and the layers. Output
MSE (LoLCATs) rewards a diffuse average of the values; the cross-entropy
rewards putting the teacher's weight on the teacher's keys, which is what
retrieval needs.

**The teacher's weights** are the causal softmax of the student layer's own
rotated queries and keys, ``softmax_j(scale * q_i . k_j)``: linearization
copies the projections and the rotary embedding and attention transfer
never trains them, so these are the teacher's queries and keys (for a
teacher that scores ``q . k / sqrt(D)`` with a causal mask, as the
families `linearize` supports do).

**The student's weights** are those of its window and linear state: with a
window W, gamma ``g`` and features ``phi`` (the linear weight and
``linear_mean``'s ``1 / n_i`` included, the unrotated queries and keys
with ``linear_rope=False``)::

    a_ij = (g exp(s_ij - m_i) [i - W < j <= i] + phi(q_i) . phi(k_j) [j <= i - W]) / (the same summed over j)

(`keras_linattn.ops.window`'s readout, whose output is ``sum_j a_ij v_j``);
without a window (the additive recurrence) ``a_ij`` is the normalized
``phi(q_i) . phi(k_j)``. For the sparse cache these are the weights with
every pair older than the window in the linear state: its selection
(which pairs the cache keeps) is not differentiable and is left out.

Shape legend: B batch, T length (queries and keys: causal self-attention),
H heads, D key dim, C feature dim.
"""

from keras import ops

from keras_linattn.recurrences.additive import AdditiveRecurrence
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = ["OBJECTIVES", "attention_cross_entropy", "attention_weights", "frozen_names"]

OBJECTIVES = ("output", "attention", "both")
# The parts of a student layer `freeze` may name, each mapped to the weight names of `transfer.transfer_variables`.
FREEZABLE = {
    "gamma": ("window_gamma_logit", "window_gamma", "gamma"),
    "linear_weight": ("window_linear_weight_log",),
}
_TINY = 1e-30  # log's floor: a weight the student cannot give (a key outside its window and state) costs log(1e-30)


def frozen_names(freeze):
    """The weight names `freeze` leaves untrained: ``freeze`` a tuple of `FREEZABLE` keys (or a str, or None).

    Raises:
        ValueError: for anything else, naming the value.
    """
    if freeze is None:
        return ()
    parts = (freeze,) if isinstance(freeze, str) else freeze
    if not isinstance(parts, (tuple, list)) or any(part not in FREEZABLE for part in parts):
        raise ValueError(f"`freeze` must be a tuple of names among {sorted(FREEZABLE)}. Received: freeze={freeze!r}")
    return tuple(name for part in parts for name in FREEZABLE[part])


def attention_weights(layer, query, value, key=None, key_mask=None):
    """``(teacher [B, H, T, T], student [B, H, T, T])``: both attention weights of a causal self-attention call.

    Args:
        layer: a built `LinearAttention` whose recurrence is a
            `WindowRecurrence` (the sparse cache included) or an
            `AdditiveRecurrence` with ``normalize=True``.
        query, value, key: its call's inputs ``[B, T, dim]``.
        key_mask: optional ``[B, T]``, 1 = a real token.

    Returns:
        The teacher's softmax weights and the student's (module docstring),
        float32; rows of padded queries are zeros.

    Raises:
        ValueError: for another recurrence.
    """
    recurrence = layer.recurrence
    window = isinstance(recurrence, WindowRecurrence)
    if not window and not (isinstance(recurrence, AdditiveRecurrence) and recurrence.normalize):
        raise ValueError(
            "The attention objective reads the student's weights from a window (or window + cache) recurrence or "
            f"the normalized additive one. Received: recurrence={type(recurrence).__name__}"
        )
    mask = None if key_mask is None else ops.cast(key_mask, "bool")
    q, k, v = layer.project(query, value, key)
    (q, k, _), _, (q_plain, k_plain), _ = layer._before_recurrence(q, k, v, mask, True, None)
    length = ops.shape(q)[1]
    i = ops.arange(length)[:, None]
    j = ops.arange(length)[None, :]
    real = ops.ones(ops.shape(q)[:2], "bool") if mask is None else mask  # [B, T]
    causal = ops.logical_and(j <= i, real[:, None, None, :])  # [B, 1, T, T]
    f32 = lambda x: ops.cast(x, "float32")  # noqa: E731
    scores = ops.einsum("bthd,bshd->bhts", f32(q), f32(k)) / float(q.shape[-1]) ** 0.5  # [B, H, T, T]
    teacher = _masked_softmax(scores, causal)  # [B, H, T, T]

    plain = window and not recurrence.linear_rope
    q_lin, k_lin = (q_plain, k_plain) if plain else (q, k)
    qf = f32(recurrence.features(q_lin, True, True, False))  # [B, T, H, C], the linear weight included
    kf = f32(recurrence.features(k_lin, False, True, False))  # [B, T, H, C]
    linear = ops.einsum("bthc,bshc->bhts", qf, kf)  # [B, H, T, T]
    if not window:
        return teacher, _normalized(ops.where(causal, linear, ops.zeros_like(linear)))
    w = recurrence.window_size
    older = ops.logical_and(causal, j <= i - w)  # [B, 1, T, T]
    inside = ops.logical_and(causal, j > i - w)  # [B, 1, T, T]
    if recurrence.linear_mean:  # 1 / max(n_i, 1), n_i the real keys older than query i's window
        count = ops.sum(ops.cast(older, "float32"), axis=-1, keepdims=True)  # [B, 1, T, 1]
        linear = linear / ops.maximum(count, 1.0)
    peak = ops.max(ops.where(inside, scores, ops.full_like(scores, -1e30)), axis=-1, keepdims=True)
    soft = ops.where(inside, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))  # [B, H, T, T]
    gamma = recurrence._gamma()
    if gamma is not None:
        soft = soft * gamma[None, :, None, None]
    student = soft + ops.where(older, linear, ops.zeros_like(linear))  # [B, H, T, T]
    return teacher, _normalized(student)


def _masked_softmax(scores, allowed):
    peak = ops.max(ops.where(allowed, scores, ops.full_like(scores, -1e30)), axis=-1, keepdims=True)
    e = ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))
    return _normalized(e)


def _normalized(a):
    """Rows divided by their sum; a row with none (a padded query) stays zeros."""
    total = ops.sum(a, axis=-1, keepdims=True)
    return a / ops.where(total > 0, total, ops.ones_like(total))


def attention_cross_entropy(layer, query, value, key=None, key_mask=None):
    """Hedgehog's objective of one call: the mean over heads and unpadded rows of ``- sum_j p_ij log a_ij``.

    Args: as `attention_weights`.

    Returns:
        A float32 scalar (the teacher's weights carry no gradient).
    """
    teacher, student = attention_weights(layer, query, value, key, key_mask)
    teacher = ops.stop_gradient(teacher)
    rows = -ops.sum(teacher * ops.log(ops.maximum(student, _TINY)), axis=-1)  # [B, H, T]
    if key_mask is None:
        return ops.mean(rows)
    weights = ops.cast(key_mask, "float32")[:, None, :] * ops.ones_like(rows)  # [B, H, T]
    return ops.sum(rows * weights) / ops.maximum(ops.sum(weights), 1.0)
