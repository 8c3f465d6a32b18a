"""OGLU trainable kernel: GLU with orthogonal filters (Yorsh & Kovalenko 2022)."""

import keras

from keras_linattn.feature_maps import _trainable
from keras_linattn.feature_maps.glu import GLUStack
from keras_linattn.feature_maps.registry import register


@register("oglu")
@_trainable.document
class OGLUFeatureMap(GLUStack):
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

    >>> x = keras.random.normal((2, 100, 64))
    >>> layer = keras_linattn.layers.LinearAttention(
    ...     4, 16, feature_map=OGLUFeatureMap(orthogonal_penalty=0.1))
    >>> layer(x, x, use_causal_mask=True).shape
    (2, 100, 64)
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
