"""`OutputNorm`: the per-head RMSNorm of `LinearAttention`'s output, after its recurrence.

The norm owns its weight (created on the attention layer, so that it keeps
the path older `.keras` files and SavedModels use). It is on for a readout
without a normalizer; for a normalized readout it is the identity and has
no weight.
"""

from keras import ops

# Output RMSNorm epsilon (a readout without a normalizer).
OUTPUT_NORM_EPSILON = 1e-6

__all__ = []


class OutputNorm:
    """Per-head RMSNorm of ``[..., H, M]`` with a learned scale ``output_norm_scale [H, M]`` (float32).

    On when the recurrence's readout has no normalizer; the identity otherwise.
    """

    def __init__(self, enabled):
        self.enabled = enabled

    def build(self, layer):
        if self.enabled:
            self.scale = layer.add_weight(
                name="output_norm_scale",
                shape=(layer.num_heads, layer.value_dim),
                initializer="ones",
                dtype="float32",
                autocast=False,
            )

    def __call__(self, out, compute_dtype="float32"):
        if not self.enabled:
            return out
        x = ops.cast(out, compute_dtype)
        x = x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + OUTPUT_NORM_EPSILON)
        return ops.cast(x, "float32") * self.scale if compute_dtype != "float32" else x * self.scale
