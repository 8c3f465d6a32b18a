"""Trainable feedforward kernel (Yorsh & Kovalenko 2022)."""

import keras
from keras import ops

from keras_linattn._validation import check_non_negative_float
from keras_linattn.feature_maps import _stable, _trainable
from keras_linattn.feature_maps.registry import register

__all__ = ["FFNFeatureMap"]


@register("ffn")
@_trainable.document
class FFNFeatureMap(_trainable.StackedFeatureMap):
    """Trainable feedforward kernel ``phi(x) = softplus(h_{k-1} W_k)``.

        From Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via
        Trainable Feedforward Kernel". A head-wise feedforward network of depth
        ``k``: ``h_0 = x``, ``h_i = act(h_{i-1} W_i)`` for the hidden layers,
        and a softplus output layer, so features are positive. Each head has its
        own matrices (weights ``[H, D, C]`` then ``[H, C, C]``, float32, no
        biases). Parameters: ``H * (D*C + (k-1)*C^2)``, twice that with
        ``share_qk=False``. A query whose features would all underflow is scaled
        up by a positive factor (`keras_linattn.feature_maps._stable`), which
        cancels in the attention ratio.

        Args:
            kernel_initializer: initializer of every ``W_i``, applied head by
                head (each head a ``[in, out]`` matrix, a fresh initializer
                instance per head and weight). Default ``"orthogonal"``: each
                head's matrix has orthonormal rows (columns when in > out).
            orthogonal_penalty: factor of
                `keras_linattn.regularizers.OrthogonalRegularizer` on every
                ``W_i`` (``factor * sum_h ||W_h W_h^T - I||_F^2``); 0 (default)
                disables it.
    {shared_args}

    {call}

        Example:

        >>> import keras
        >>> import numpy as np
        >>> import keras_linattn
        >>> keras.utils.set_random_seed(0)
        >>> x = np.random.default_rng(0).normal(size=(2, 100, 64)).astype("float32")  # [B, T, width]
        >>> fm = FFNFeatureMap(depth=2, feature_dim=32)
        >>> layer = keras_linattn.layers.LinearAttention(4, 16, feature_map=fm)
        >>> x_changed = x.copy()
        >>> x_changed[:, 60:] += 1.0  # change the future of token 59
        >>> y = np.asarray(layer(x, x, use_causal_mask=True))
        >>> y_changed = np.asarray(layer(x_changed, x_changed, use_causal_mask=True))
        >>> y.shape, bool(np.array_equal(y[:, :60], y_changed[:, :60]))  # causal: tokens 0..59 unchanged
        ((2, 100, 64), True)
    """

    def __init__(self, *, kernel_initializer="orthogonal", orthogonal_penalty=0.0, **kwargs):
        super().__init__(**kwargs)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.orthogonal_penalty = check_non_negative_float("orthogonal_penalty", orthogonal_penalty)

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

    lifts_queries = True

    def apply_branch(self, inputs, weights, is_query=False):
        act = _trainable.HIDDEN_ACTIVATIONS[self.hidden_activation]
        x = inputs  # [B, T, H, D]
        for w in weights[:-1]:
            x = act(_trainable.headwise_matmul(x, w))  # [B, T, H, C]
        y = _trainable.headwise_matmul(x, weights[-1])  # [B, T, H, C]
        features = ops.softplus(y)  # [B, T, H, C]
        if is_query:
            # softplus(y) underflows for very negative y: lift the query (a factor that cancels).
            features = _stable.lift_query(features, _stable.log_softplus(y))
        return features

    def get_config(self):
        return {
            **super().get_config(),
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "orthogonal_penalty": self.orthogonal_penalty,
        }
