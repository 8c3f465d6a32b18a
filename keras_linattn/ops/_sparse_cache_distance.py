"""The sparse cache scored at each pair's real distance up to a bound L, and at L beyond it (``min(d, L)``).

`keras_linattn.ops.sparse_cache` scores its cached pairs either at their
real distance (the rotated query against the rotated key) or all at one
fixed distance (``cache_q``, ``cache_k_all``: the query rotated to d against
the key before the rotary embedding). The first recalls a pair by its
position, as the teacher does, but past the training length L a cached pair
can sit at a distance the teacher never saw; the second never meets such a
distance, but ranks every cached pair as if it sat d tokens back, which the
teacher's retrieval did not learn either. This module scores a cached pair
that sits ``d`` tokens before its query at RoPE distance ``min(d, L)``::

    s_ij = scale * q_i . k_j                 if i - j <= L   (both rotated: the real distance)
    s_ij = scale * q_fixed_i . k_fixed_j     otherwise       (q rotated to L against the unrotated key)

(RoPE's score depends on the distance alone, so the second line is the
score at distance L.) Within the training length nothing changes from the
real-distance cache; beyond it no score uses a distance over L.

**What the cache keeps.** Each slot holds both forms of its key and its
age, packed along the key axis as ``[k, k_fixed, age]`` (``2D + 1``
values): the slot's ``keys [B, N, H, 2D + 1]`` in the ops'
``(keys, features, values, valid)`` cache, so that the selection
(`keras_linattn.ops.sparse_cache._admit`, which carries the keys through
unread) is shared. The age is the pair's distance from the last query
read, clamped at ``L + 1`` (past L only "beyond" matters), so the state
stays bounded at any length. At each token the ages grow by one, then the
pair leaving the window enters with age W (at query i it is token i - W).

Shape legend: B batch, T length, W window, N cache slots, H heads, D key
dim.
"""

import keras
from keras import ops

from keras_linattn._validation import check_non_negative_int
from keras_linattn.ops._sparse_selection import _admit, _scan_tokens, _selection
from keras_linattn.ops.window import _NEG

__all__ = [
    "age_cache",
    "cache_key_width",
    "clamped_scores",
    "pack_keys",
    "packed_inputs",
    "selection",
    "step_scores",
    "unpack_keys",
]


def _width(x):
    """The last axis's size: static where known, else a tensor (a compiled loop relaxed to unknown shapes)."""
    return x.shape[-1] if x.shape[-1] is not None else ops.shape(x)[-1]


def pack_keys(keys, fixed_keys, age):
    """``[k, k_fixed, age]`` along the last axis: ``[..., D]``, ``[..., D]``, ``[...]`` -> ``[..., 2D + 1]``."""
    keys, fixed_keys, age = (ops.cast(x, "float32") for x in (keys, fixed_keys, age))
    return ops.concatenate([keys, fixed_keys, age[..., None]], axis=-1)


def unpack_keys(packed):
    """`pack_keys` undone: ``[..., 2D + 1]`` -> ``(keys [..., D], fixed_keys [..., D], age [...])``."""
    d = (_width(packed) - 1) // 2
    return packed[..., :d], packed[..., d : 2 * d], packed[..., 2 * d]


def age_cache(cache, max_distance):
    """The cache one token later: each valid slot's age grows by one, up to ``L + 1``; free slots stay zeros."""
    keys, features, values, valid = cache
    k, k_fixed, age = unpack_keys(keys)
    age = ops.where(valid > 0, ops.minimum(age + 1.0, float(max_distance) + 1.0), ops.zeros_like(age))  # [B, N, H]
    return (pack_keys(k, k_fixed, age), features, values, valid)


def clamped_scores(q, q_fixed, keys, max_distance):
    """The cache's logits ``[B, H, N]`` of one query (``q``, ``q_fixed [B, H, D]``, already scaled).

    Args:
        q: the rotated query; q_fixed: the query rotated to L (unrotated keys read it).
        keys: the packed cache keys ``[B, N, H, 2D + 1]``.
        max_distance: L.

    Returns:
        ``q . k`` for the slots of age <= L, ``q_fixed . k_fixed`` for the older.
    """
    k, k_fixed, age = unpack_keys(keys)
    real = ops.einsum("bhd,bnhd->bhn", q, k)  # [B, H, N]
    fixed = ops.einsum("bhd,bnhd->bhn", q_fixed, k_fixed)  # [B, H, N]
    return ops.where(ops.transpose(age, (0, 2, 1)) <= float(max_distance), real, fixed)


def packed_inputs(q_scaled, cache_q_scaled, k_all, cache_k_all, window, max_distance):
    """The selection loop's queries ``[B, T, H, 2D]`` and leaving keys ``[B, W + T, H, 2D + 1]``.

    Each query carries both its forms; each key both its forms and the age
    it has when it leaves the window (W, at most ``L + 1``).
    """
    q_packed = ops.concatenate([q_scaled, cache_q_scaled], axis=-1)  # [B, T, H, 2D]
    age = ops.full(ops.shape(k_all)[:-1], float(min(window, max_distance + 1)), "float32")  # [B, W + T, H]
    return q_packed, pack_keys(k_all, cache_k_all, age)


def _terms(q_packed, cache, max_distance):
    """The cache's softmax terms of one query under the cache's own max, as `sparse_cache._cache_terms`."""
    keys, _, values, valid = cache
    d = _width(q_packed) // 2
    scores = clamped_scores(q_packed[..., :d], q_packed[..., d:], keys, max_distance)  # [B, H, N]
    allowed = ops.transpose(valid, (0, 2, 1)) > 0  # [B, H, N]
    peak = ops.max(ops.where(allowed, scores, ops.full_like(scores, _NEG)), axis=-1, keepdims=True, initial=_NEG)
    e = ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))  # [B, H, N]
    return ops.einsum("bhn,bnhm->bhm", e, values), ops.sum(e, axis=-1, keepdims=True), peak


def _selection_loop(carry, xs, eps, max_distance):
    """`sparse_cache._selection_loop` with the ages: per token, age, admit, then the query's cache terms."""

    def step(carry, x):
        cache = age_cache(carry[2:], max_distance)
        (s, z), cache_i, (kf_e, v_e) = _admit(carry[:2], cache, x[1:], eps)
        return (s, z) + cache_i, (kf_e, v_e) + _terms(x[0], cache_i, max_distance)

    return _scan_tokens(step, carry, xs, 5)


_COMPILED = []  # the `tf.function` of `_selection_loop`, built at the first eager call


def selection(carry, xs, eps, max_distance):
    """`_selection_loop`, compiled when TensorFlow runs eagerly (as `_sparse_selection._selection`, for its reason).

    With ``max_distance=None`` it is `_sparse_selection._selection` (the real distances, no ages).
    """
    if max_distance is None:
        return _selection(carry, xs, eps)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.executing_eagerly():
            if not _COMPILED:
                _COMPILED.append(tf.function(_selection_loop, reduce_retracing=True, autograph=False))
            return _COMPILED[0](carry, xs, eps, max_distance)
    return _selection_loop(carry, xs, eps, max_distance)


def cache_key_width(max_distance, cache_q, cache_k, d):
    """The width of the cache's keys: D, or ``2D + 1`` packed with `cache_max_distance` (which needs both forms)."""
    if max_distance is None:
        return d
    check_non_negative_int("cache_max_distance", max_distance)
    if cache_q is None or cache_k is None:
        raise ValueError(
            "`cache_max_distance` scores a cached pair beyond it with the second form of the query and the key: "
            f"it needs both. Received: cache_max_distance={max_distance!r}, "
            f"cache query given: {cache_q is not None}, cache key given: {cache_k is not None}"
        )
    return None if d is None else 2 * d + 1


def step_scores(q, q_cache, keys, max_distance):
    """A step's cache logits ``[B, H, N]``: one form of query and key, or both (`cache_max_distance`)."""
    if max_distance is None:
        return ops.einsum("bhd,bnhd->bhn", q_cache, keys)
    return clamped_scores(q, q_cache, keys, max_distance)
