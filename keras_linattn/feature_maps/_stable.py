"""Log-space stabilization shared by the exponential-type feature maps.

A positive factor per query cancels in ``phi(q)^T S / phi(q)^T z``, and so
does one positive factor shared by all keys of a (batch, head). Maps whose
features are exponentials (elu's negative branch, the softplus/sigmoid tails
of the GLU family and ffn) use the first to keep a query's features from
underflowing to an all-zero vector: a query whose largest feature would be
below ``exp(QUERY_LOG_FLOOR)`` is lifted so that it is exactly that. Every
other query is left bit-identical.
"""

from keras import ops

QUERY_LOG_FLOOR = -30.0
# Below this, log(softplus(x)) = x - exp(x)/2 + ... is x to float32 precision.
_SOFTPLUS_LINEAR = -20.0


def log_softplus(x):
    """``log(softplus(x))`` without underflow (``x`` for ``x < -20``)."""
    safe = ops.maximum(x, _SOFTPLUS_LINEAR)
    return ops.where(x < _SOFTPLUS_LINEAR, x, ops.log(ops.softplus(safe)))


def query_shift(log_features):
    """``s = min(0, max_c log phi_c - QUERY_LOG_FLOOR)`` per query (``[..., 1]``, no gradient)."""
    # `initial`: keras' eager max refuses an empty tensor, and a piece of length 0 is one.
    peak = ops.max(log_features, axis=-1, keepdims=True, initial=float("-inf"))
    return ops.stop_gradient(ops.minimum(peak - QUERY_LOG_FLOOR, 0.0))


def lift_query(features, log_features):
    """``features``, except for queries whose features would all be below ``exp(QUERY_LOG_FLOOR)``.

    Those get ``exp(log phi - s)`` (`query_shift`): the same features times
    one positive factor, their largest at ``exp(QUERY_LOG_FLOOR)``.
    """
    shift = query_shift(log_features)  # [..., 1]
    lifted = ops.exp(ops.minimum(log_features - shift, 0.0))
    return ops.where(shift < 0, lifted, features)
