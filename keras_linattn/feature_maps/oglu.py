"""OGLU trainable kernel: GLU with orthogonal filters (Yorsh & Kovalenko 2022)."""

import keras

from keras_linattn.feature_maps import _trainable
from keras_linattn.feature_maps.glu import _GLUStack
from keras_linattn.feature_maps.registry import register

__all__ = ["OGLUFeatureMap"]


@register("oglu")
@_trainable.document
class OGLUFeatureMap(_GLUStack):
    """OGLU: a GLU kernel whose filters are kept orthogonal.

        From Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via
        Trainable Feedforward Kernel". The GLU stack of `GLUFeatureMap`
        (``u_i = act(u_{i-1} W_f^i) * sigmoid(u_{i-1} W_g^i)``, last unit
        ``softplus(u W_f) * sigmoid(u W_g)``), where every filter ``W_f`` is
        initialized orthogonal head by head and regularized with
        `keras_linattn.regularizers.OrthogonalRegularizer`
        (``orthogonal_penalty * sum_h ||W_f,h W_f,h^T - I||_F^2``). Gates are
        unconstrained. Parameters: ``2 * n^2`` per unit per head for width ``n``
        (first unit ``2*D*C``), twice that with ``share_qk=False``.

        Args:
            orthogonal_penalty: factor of the orthogonal regularizer on the
                filters, >= 0 (0 keeps only the orthogonal initialization).
                Default 0.01.
            gate_initializer: initializer of the gates, applied head by head.
                Default ``"glorot_uniform"``.
    {shared_args}

    {call}

        Example:

        >>> import keras
        >>> import numpy as np
        >>> import keras_linattn
        >>> keras.utils.set_random_seed(0)
        >>> x = np.random.default_rng(0).normal(size=(2, 100, 64)).astype("float32")  # [B, T, width]
        >>> fm = OGLUFeatureMap(orthogonal_penalty=0.1)
        >>> layer = keras_linattn.layers.LinearAttention(4, 16, feature_map=fm)
        >>> x_changed = x.copy()
        >>> x_changed[:, 60:] += 1.0  # change the future of token 59
        >>> y = np.asarray(layer(x, x, use_causal_mask=True))
        >>> y_changed = np.asarray(layer(x_changed, x_changed, use_causal_mask=True))
        >>> y.shape, bool(np.array_equal(y[:, :60], y_changed[:, :60]))  # causal: tokens 0..59 unchanged
        ((2, 100, 64), True)
        >>> len(layer.losses)  # the orthogonality penalty of the filter weights
        1
    """

    def __init__(self, *, orthogonal_penalty=0.01, gate_initializer="glorot_uniform", **kwargs):
        super().__init__(
            filter_initializer=keras.initializers.Orthogonal(),
            gate_initializer=gate_initializer,
            filter_penalty=orthogonal_penalty,
            **kwargs,
        )
        self.orthogonal_penalty = self._filter_penalty
        self.gate_initializer = self._gate_initializer

    def get_config(self):
        return {
            **super().get_config(),
            "orthogonal_penalty": self.orthogonal_penalty,
            "gate_initializer": keras.initializers.serialize(self.gate_initializer),
        }
