"""Trainable feedforward kernel (Yorsh & Kovalenko 2022)."""

import keras
from keras import ops

from keras_linattn.feature_maps import _trainable
from keras_linattn.feature_maps.registry import register


@register("ffn")
class FFNFeatureMap(_trainable.TrainableFeatureMap):
    """Trainable feedforward kernel ``phi(x) = softplus(h_{k-1} W_k)``.

    From Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via
    Trainable Feedforward Kernel". A head-wise feedforward network of depth
    ``k``: ``h_0 = x``, ``h_i = act(h_{i-1} W_i)`` for the hidden layers,
    and a softplus output layer, so features are positive. Each head has its
    own matrices (weights ``[H, D, C]`` then ``[H, C, C]``, float32, no
    biases). Parameters: ``H * (D*C + (k-1)*C^2)``, twice that with
    ``share_qk=False``.

    Args:
        depth: number of layers ``k``, 1 to 3. Default 1 (``softplus(x W)``).
        feature_dim: output feature dim ``C`` (and width of the hidden
            layers). Default None: ``C = D``.
        hidden_activation: activation of the hidden layers, one of
            ``"sigmoid"`` (as in the paper, the default), ``"gelu"``,
            ``"relu"``, ``"tanh"``.
        share_qk: True (default): queries and keys share one kernel. False:
            separate kernels for queries and keys.
        kernel_initializer: initializer of every ``W_i``, applied head by
            head (each head a ``[in, out]`` matrix, a fresh initializer
            instance per head and weight). Default ``"orthogonal"``: each
            head's matrix has orthonormal rows (columns when in > out).
        orthogonal_penalty: factor of
            `keras_linattn.regularizers.OrthogonalRegularizer` on every
            ``W_i`` (``factor * sum_h ||W_h W_h^T - I||_F^2``); 0 (default)
            disables it.
        seed: optional integer base seed of the initializers (head ``h`` of
            weight ``i`` uses ``seed + i * H + h``).
        **kwargs: `FeatureMap` / `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: selects the query or key kernel when ``share_qk=False``.
        causal: unused (the map is token-wise).

    Returns:
        ``[B, T, H, C]`` positive float32 features.

    Example:

    >>> x = keras.random.normal((2, 100, 64))
    >>> fm = FFNFeatureMap(depth=2, feature_dim=32)
    >>> layer = keras_linattn.layers.LinearAttention(4, 16, feature_map=fm)
    >>> layer(x, x, use_causal_mask=True).shape
    (2, 100, 64)
    """

    def __init__(
        self,
        depth=1,
        feature_dim=None,
        hidden_activation="sigmoid",
        share_qk=True,
        kernel_initializer="orthogonal",
        orthogonal_penalty=0.0,
        seed=None,
        **kwargs,
    ):
        super().__init__(feature_dim=feature_dim, share_qk=share_qk, seed=seed, **kwargs)
        _trainable.check_int_range("depth", depth, 1, 3)
        _trainable.check_activation("hidden_activation", hidden_activation)
        self.depth = depth
        self.hidden_activation = hidden_activation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.orthogonal_penalty = _trainable.check_penalty("orthogonal_penalty", orthogonal_penalty)

    def build_branch(self, prefix, num_heads, input_dim):
        dims = _trainable.layer_dims(input_dim, self.feature_dim(input_dim), self.depth)
        return [
            self.add_headwise_weight(
                f"{prefix}_kernel_{i}",
                (num_heads, n_in, n_out),
                self.kernel_initializer,
                self.orthogonal_regularizer(self.orthogonal_penalty),
            )
            for i, (n_in, n_out) in enumerate(dims)
        ]

    def apply_branch(self, inputs, weights):
        act = _trainable.HIDDEN_ACTIVATIONS[self.hidden_activation]
        x = inputs  # [B, T, H, D]
        for w in weights[:-1]:
            x = act(_trainable.headwise_matmul(x, w))  # [B, T, H, C]
        return ops.softplus(_trainable.headwise_matmul(x, weights[-1]))  # [B, T, H, C]

    def get_config(self):
        return {
            **super().get_config(),
            "depth": self.depth,
            "hidden_activation": self.hidden_activation,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "orthogonal_penalty": self.orthogonal_penalty,
        }
