"""elu(x) + 1 feature map (Katharopoulos et al. 2020, "Transformers are RNNs")."""

from keras import ops

from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.registry import register


@register("elu")
class EluFeatureMap(FeatureMap):
    """``phi(x) = elu(x) + 1``: positive, ``C = D``, no weights.

    Example:

    >>> fm = EluFeatureMap()
    >>> fm(np.zeros((1, 4, 2, 8))).shape
    (1, 4, 2, 8)
    """

    def feature_dim(self, input_dim):
        return input_dim

    def call(self, inputs, is_query=True, causal=False):
        return ops.elu(inputs) + 1.0
