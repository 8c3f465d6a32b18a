"""Base class of feature maps ``phi: [B, T, H, D] -> [B, T, H, C]``."""

import keras

from keras_linattn._tracking import CheckpointTracked
from keras_linattn._validation import check_rank

__all__ = ["FeatureMap"]


class FeatureMap(CheckpointTracked, keras.layers.Layer):
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
            f"{type(self).__name__} does not define feature_dim(input_dim); every FeatureMap subclass must."
        )

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"{type(self).__name__} expects inputs of rank 4 [B, T, H, D]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.built = True

    def build_heads(self, input_shape):
        """Starts the build of a map with per-head weights.

        Checks ``[B, T, H, D]`` with static ``H`` and ``D`` and returns
        ``(H, D)``, to be built for. If the map is already built (deserializing
        builds it from its build config before the owning layer builds it
        again), checks that ``(H, D)`` is the one it was built for and returns
        None: the weights are kept.
        """
        if self.built:
            if tuple(input_shape[-2:]) != self.heads_dim:
                raise ValueError(
                    f"{type(self).__name__} was built for [H, D] = {list(self.heads_dim)}. "
                    f"Received: input_shape={tuple(input_shape)}"
                )
            return None
        FeatureMap.build(self, input_shape)
        num_heads, dim = input_shape[-2], input_shape[-1]
        if num_heads is None or dim is None:
            raise ValueError(
                f"{type(self).__name__} needs known head and key dims [B, T, H, D]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.heads_dim = (int(num_heads), int(dim))
        return self.heads_dim

    def check_heads(self, inputs):
        """Checks that call inputs are ``[B, T, H, D]`` with the built ``H, D``."""
        check_rank("inputs", inputs, 4)  # [B, T, H, D]
        if tuple(inputs.shape[-2:]) != self.heads_dim:
            num_heads, dim = self.heads_dim
            raise ValueError(
                f"{type(self).__name__} was built for H={num_heads}, D={dim}. "
                f"Received: inputs.shape={tuple(inputs.shape)}"
            )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.feature_dim(input_shape[-1]),)
