"""relu(x) + eps feature map (a common baseline)."""

from keras import ops

from keras_linattn._validation import check_epsilon
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["ReluFeatureMap"]


@register("relu")
class ReluFeatureMap(FeatureMap):
    """``phi(x) = relu(x) + epsilon``: non-negative, ``C = D``, no weights.

    Args:
        epsilon: finite non-negative constant added to every feature so that no
            query has an all-zero feature vector. Default 1e-6.
    """

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = check_epsilon("epsilon", epsilon, allow_zero=True)

    def feature_dim(self, input_dim):
        return input_dim

    def call(self, inputs, is_query=True, causal=False):
        return ops.relu(inputs) + self.epsilon

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}
