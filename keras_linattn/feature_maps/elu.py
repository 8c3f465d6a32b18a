"""elu(x) + 1 feature map (Katharopoulos et al. 2020, "Transformers are RNNs")."""

from keras import ops

from keras_linattn.feature_maps._stable import QUERY_LOG_FLOOR
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["EluFeatureMap"]


@register("elu")
class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``: positive, ``C = D``, no weights.

    For ``x < 0`` the features are computed as ``exp(x)`` (``elu(x) + 1 =
    (exp(x) - 1) + 1`` would round to 0 below x ~ -17); ``exp(x)`` underflows
    float32 to 0 below about -87: a query whose coordinates are all that negative would
    have all-zero features and a silent 0 output. Such a query is scaled by
    a positive factor instead (which cancels in ``phi(q)^T S / phi(q)^T z``):
    its features are computed as ``elu(x - s) + 1`` with
    ``s = min(0, max_c x_c + 30)``, i.e. its largest feature is lifted to
    ``exp(-30)``. Queries with any coordinate above -30 (all ordinary
    inputs) are not lifted; keys never are.

    Example:

    >>> import numpy as np
    >>> fm = EluFeatureMap()
    >>> phi = np.asarray(fm(np.array([[[[-1.0, 0.0, 2.0]]]])))  # [B, T, H, D] = [1, 1, 1, 3]
    >>> [round(float(v), 4) for v in phi.ravel()]  # elu(x) + 1: positive everywhere
    [0.3679, 1.0, 3.0]
    """

    def feature_dim(self, input_dim):
        return input_dim

    def call(self, inputs, is_query=True, causal=False):
        if is_query:
            # A per-query shift, only where every feature would be below exp(-30).
            # (`initial`: keras' eager max refuses an empty tensor, and a piece of length 0 is one.)
            peak = ops.max(inputs, axis=-1, keepdims=True, initial=float("-inf"))  # [B, T, H, 1]
            shift = ops.minimum(peak - QUERY_LOG_FLOOR, 0.0)  # [B, T, H, 1]
            inputs = inputs - ops.stop_gradient(shift)
        return _elu_plus_one(inputs)


@ops.custom_gradient
def _elu_plus_one(x):
    """``elu(x) + 1`` as ``exp(min(x, 0)) + relu(x)``: exact for ``x < 0``, where
    ``(exp(x) - 1) + 1`` loses ``e^-x`` ulps and is 0 below x ~ -17.

    The derivative is ``exp(x)`` for ``x < 0`` and 1 above, i.e.
    ``min(phi, 1)``: one pass backward instead of autodiff's four (a `where`
    of the two branches would compute both, forward and backward).
    """
    y = ops.exp(ops.minimum(x, 0.0)) + ops.relu(x)

    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        return upstream * ops.minimum(y, 1.0)

    return y, grad
