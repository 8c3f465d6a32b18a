"""Base class of feature maps ``phi: [B, T, H, D] -> [B, T, H, C]``."""

import keras


class FeatureMap(keras.layers.Layer):
    """A feature map for kernelized attention, ``sim(q, k) = phi(q) . phi(k)``.

    Subclasses implement `feature_dim(input_dim)` and
    `call(inputs, is_query=True, causal=False)`. Feature maps compute in
    float32 by default (the numerics of linear attention need float32
    features under mixed precision); pass ``dtype=`` to override.

    Args:
        **kwargs: standard `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: True for queries, False for keys. Maps that treat the two
            differently (FAVOR+ stabilization, separate trainable kernels) use it.
        causal: True when used in causal attention. A map must never let
            a key's features depend on other time steps when this is True.

    Returns:
        ``[B, T, H, C]`` features with ``C = feature_dim(D)``.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)

    def feature_dim(self, input_dim):
        """The output feature dim ``C`` for input dim ``D``."""
        raise TypeError(
            f"{type(self).__name__} does not define feature_dim(input_dim); "
            "every FeatureMap subclass must."
        )

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"{type(self).__name__} expects inputs of rank 4 [B, T, H, D]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.built = True

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.feature_dim(input_shape[-1]),)
