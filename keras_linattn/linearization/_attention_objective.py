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

**Which weights learn what** (``split_gradient="weights"``, the gradient
`keras_linattn.attention_transfer` takes). With a window, a row's
cross-entropy is the sum of three parts, ``W`` the keys in the window and
``L`` the older ones, ``P_W, P_L`` the teacher's mass on each, ``G, A``
the student's (``Z = G + A``)::

    CE = - sum_{j in W} p_j log(a_j / G)          the window's shape (the softmax itself: nothing learned)
         - P_W log(G / Z) - P_L log(A / Z)         the split between window and linear part
         - sum_{j in L} p_j log(a_j / A)           the linear part's shape: which older keys it weighs

The split is what the window's gamma and the linear weight are for; the
linear part's shape is what the feature map is for. Hedgehog's plain
gradient (``"all"``) also lets the feature map move the split: with
bounded features (hedgehog's each sum to 1) it can raise the linear mass
only by making ``phi(q) . phi(k)`` large for every older key, i.e. by
collapsing every key onto the same features, which erases the shape.
With the weights frozen (``freeze``) that is the only way left, and
transfer then spends itself on the mass: on the recall benchmark's
sparse-cache student (linear weight 0.001, frozen) the mean
``phi(q) . phi(k)`` went from 0.09-0.18 to 1.1-1.8 of its ceiling 2, the
linear share of the weights from 2% to 28%, while the linear part's shape
(its cross-entropy given ``L``) did not move; retrieval inside the window
fell from 1.00 to 0.44 and came back with the linear readout switched off.
``"weights"`` gives the split's gradient to gamma and the linear weight
alone (the value is the same cross-entropy): the feature map learns the
shape and is never pushed to move the split. It can still move it as a
side effect (a sharper shape lowers most ``phi(q) . phi(k)``): with both
weights frozen nothing pulls the split back, and the cross-entropy as a
whole can rise while its shape part falls (bench_length's cache student:
linear share 2% -> 0.1-0.7%, the shape 5.31 -> 5.02, the whole 3.70 ->
3.87 in its first layer).

Shape legend: B batch, T length (queries and keys: causal self-attention),
H heads, D key dim, C feature dim.
"""

from keras import ops

from keras_linattn._validation import check_one_of
from keras_linattn.recurrences.additive import AdditiveRecurrence
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = ["OBJECTIVES", "SPLIT_GRADIENTS", "attention_cross_entropy", "attention_weights", "frozen_names"]

OBJECTIVES = ("output", "attention", "both")
# What the window / linear split's gradient reaches: every weight (Hedgehog's), or gamma and the linear weight.
SPLIT_GRADIENTS = ("all", "weights")
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
    teacher, soft, linear, _ = _weight_parts(layer, query, value, key, key_mask)
    return teacher, _normalized(linear if soft is None else soft + linear)


def _weight_parts(layer, query, value, key, key_mask):
    """``(teacher, soft, linear, older)``: the teacher's weights and the student's unnormalized terms.

    ``teacher [B, H, T, T]`` normalized; ``soft [B, H, T, T]`` the window's
    terms (gamma included; None without a window); ``linear [B, H, T, T]``
    the linear terms, zero outside the keys older than the window (every
    causal key without one); ``older [B, 1, T, T]`` bool, those keys (None
    without a window). The student's weights are ``(soft + linear)`` over
    its row sum.
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
        return teacher, None, ops.where(causal, linear, ops.zeros_like(linear)), None
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
    return teacher, soft, ops.where(older, linear, ops.zeros_like(linear)), older


def _masked_softmax(scores, allowed):
    peak = ops.max(ops.where(allowed, scores, ops.full_like(scores, -1e30)), axis=-1, keepdims=True)
    e = ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))
    return _normalized(e)


def _normalized(a):
    """Rows divided by their sum; a row with none (a padded query) stays zeros."""
    total = ops.sum(a, axis=-1, keepdims=True)
    return a / ops.where(total > 0, total, ops.ones_like(total))


def attention_cross_entropy(layer, query, value, key=None, key_mask=None, split_gradient="all"):
    """Hedgehog's objective of one call: the mean over heads and unpadded rows of ``- sum_j p_ij log a_ij``.

    Args:
        layer, query, value, key, key_mask: as `attention_weights`.
        split_gradient: ``"all"`` (default): the cross-entropy's own
            gradient. ``"weights"``: the same value, but the gradient of its
            window / linear split (module docstring) reaches only the
            window's gamma and the linear weight, and the feature map's
            gradient is that of the linear part's shape,
            ``- sum_{j older} p_j log(a_j / A)``. Without a window the two
            are the same.

    Returns:
        A float32 scalar (the teacher's weights carry no gradient).

    Raises:
        ValueError: for another recurrence (as `attention_weights`) or
            another `split_gradient`.
    """
    check_one_of("split_gradient", split_gradient, SPLIT_GRADIENTS)
    teacher, soft, linear, older = _weight_parts(layer, query, value, key, key_mask)
    teacher = ops.stop_gradient(teacher)
    if split_gradient == "all" or soft is None:
        student = _normalized(linear if soft is None else soft + linear)
        rows = -ops.sum(teacher * _log(student), axis=-1)  # [B, H, T]
    else:
        rows = _split_rows(layer.recurrence, teacher, soft, linear, older)  # [B, H, T]
    if key_mask is None:
        return ops.mean(rows)
    weights = ops.cast(key_mask, "float32")[:, None, :] * ops.ones_like(rows)  # [B, H, T]
    return ops.sum(rows * weights) / ops.maximum(ops.sum(weights), 1.0)


def _log(x):
    """``log(max(x, _TINY))``: a weight the student cannot give costs log(1e-30), as in the plain form."""
    return ops.log(ops.maximum(x, _TINY))


def _split_rows(recurrence, teacher, soft, linear, older):
    """``[B, H, T]``: each row's cross-entropy as window shape + split + linear shape (module docstring).

    The split's linear mass ``A`` carries the gradient of the linear weight
    only (its value times ``w / stop_gradient(w)``, ``w`` the learned
    weight): the features' part of it is held constant.
    """
    zero = ops.zeros_like(teacher)
    window_mass = ops.sum(soft, axis=-1, keepdims=True)  # G [B, H, T, 1]
    linear_mass = ops.sum(linear, axis=-1, keepdims=True)  # A [B, H, T, 1]
    split_mass = ops.stop_gradient(linear_mass)
    log_weight = getattr(recurrence, "linear_weight_log", None)
    if log_weight is not None:  # [H]: the value of A, the gradient of A with respect to the weight
        weight = ops.exp(log_weight)[None, :, None, None]
        split_mass = split_mass * weight / ops.stop_gradient(weight)
    total = window_mass + split_mass  # Z [B, H, T, 1]
    teacher_linear = ops.sum(ops.where(older, teacher, zero), axis=-1, keepdims=True)  # P_L [B, H, T, 1]
    teacher_window = ops.sum(ops.where(older, zero, teacher), axis=-1, keepdims=True)  # P_W
    split = -(teacher_window * (_log(window_mass) - _log(total)) + teacher_linear * (_log(split_mass) - _log(total)))
    inside = ops.where(older, zero, teacher * (_log(soft) - _log(window_mass)))  # [B, H, T, T]
    shape = ops.where(older, teacher * (_log(linear) - _log(linear_mass)), zero)  # [B, H, T, T]
    return split[..., 0] - ops.sum(inside + shape, axis=-1)
