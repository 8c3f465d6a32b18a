"""elu(x) + 1 feature map (Katharopoulos et al. 2020, "Transformers are RNNs")."""

from keras import ops

from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["EluFeatureMap"]


@register("elu")
class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``: positive, ``C = D``, no weights.

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
        return ops.elu(inputs) + 1.0
