"""Second-order Taylor (polynomial) feature map, as in "Based" (Arora et al. 2024)."""

import math

from keras import ops

from keras_linattn._validation import check_positive_float
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["TaylorFeatureMap"]


@register("taylor")
class TaylorFeatureMap(FeatureMap):
    """``phi(x) = [1, x', vec(x' x'^T) / sqrt(2)]`` with ``x' = scale * x``.

    ``phi(q) . phi(k) = 1 + q'.k' + (q'.k')^2 / 2``, the second-order Taylor
    expansion of ``exp(q'.k')``, which is always >= 1/2: the attention
    weights are positive even though single features can be negative. With
    the default ``scale = D^(-1/4)`` it approximates ``exp(q.k / sqrt(D))``,
    the softmax kernel. ``C = 1 + D + D^2``: use a small key dim (e.g. 16).

    Args:
        scale: multiplier applied to the inputs; None means ``D^(-1/4)``.
    """

    def __init__(self, scale=None, **kwargs):
        super().__init__(**kwargs)
        self.scale = check_positive_float("scale", scale, allow_none=True)

    def feature_dim(self, input_dim):
        return 1 + input_dim + input_dim * input_dim

    def call(self, inputs, is_query=True, causal=False):
        d = inputs.shape[-1]
        scale = self.scale if self.scale is not None else d**-0.25
        x = inputs * scale  # [B, T, H, D]
        outer = x[..., :, None] * x[..., None, :]  # [B, T, H, D, D]
        outer = _flatten_last_two(outer, d)  # [B, T, H, D*D]
        ones = ops.ones_like(x[..., :1])  # [B, T, H, 1]
        return ops.concatenate([ones, x, outer / math.sqrt(2.0)], axis=-1)  # [B, T, H, C]

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


def _flatten_last_two(x, d):
    """[B, T, H, D, D] -> [B, T, H, D*D] keeping dynamic leading dims."""
    shape = ops.shape(x)
    return ops.reshape(x, (shape[0], shape[1], shape[2], d * d))
