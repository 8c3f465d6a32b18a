"""AOGLU trainable kernel: OGLU with low-rank gates (Yorsh & Kovalenko 2022)."""

from keras_linattn._validation import check_optional_positive_int
from keras_linattn.feature_maps import _trainable
from keras_linattn.feature_maps.oglu import OGLUFeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["AOGLUFeatureMap"]


@register("aoglu")
@_trainable.document
class AOGLUFeatureMap(OGLUFeatureMap):
    """AOGLU: OGLU whose gates are low-rank, ``W_g ~ A B``.

        From Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via
        Trainable Feedforward Kernel". As `OGLUFeatureMap` (orthogonal filters,
        softplus-times-sigmoid last unit), but each gate ``W_g [in, n]`` is
        replaced by the product of ``A [in, r]`` and ``B [r, n]`` (per head:
        ``A [H, in, r]``, ``B [H, r, n]``), applied as ``(u A) B``. A unit of
        width ``n`` then has ``n^2 + 2*n*r`` parameters per head instead of
        OGLU's ``2*n^2``: ``1.5 * n^2`` at the default ``r = n/4`` (25% fewer).
        The rank must satisfy ``1 <= r < n/2``, the range in which the
        factorization saves parameters.

        Args:
            rank: rank ``r`` of the gates, ``1 <= r < n/2``. Default None:
                ``max(1, n // 4)``. Checked when the width is known (here if
                `feature_dim` is given, else when the layer is built).
            orthogonal_penalty: factor of the orthogonal regularizer on the
                filters, >= 0. Default 0.01.
            gate_initializer: initializer of ``A`` and ``B``, applied head by
                head. Default ``"glorot_uniform"``.
    {shared_args}

    {call}

        Example:

        >>> import keras
        >>> import numpy as np
        >>> import keras_linattn
        >>> keras.utils.set_random_seed(0)
        >>> x = np.random.default_rng(0).normal(size=(2, 100, 64)).astype("float32")  # [B, T, width]
        >>> fm = AOGLUFeatureMap(feature_dim=32, rank=8)
        >>> layer = keras_linattn.layers.LinearAttention(4, 16, feature_map=fm)
        >>> y = np.asarray(layer(x, x))
        >>> y.shape, bool(np.isfinite(y).all())
        ((2, 100, 64), True)
    """

    def __init__(self, *, rank=None, **kwargs):
        super().__init__(**kwargs)
        self.rank = check_optional_positive_int("rank", rank)
        if self._feature_dim is not None:
            self.gate_rank(self._feature_dim)

    def gate_rank(self, width):
        rank = self.rank if self.rank is not None else max(1, width // 4)
        if not 1 <= rank < width / 2:
            raise ValueError(
                f"`rank` must satisfy 1 <= rank < n/2 for unit width n={width} "
                f"(the low-rank gate must have fewer parameters than a full one). "
                f"Received: rank={self.rank!r}"
                + ("" if self.rank is not None else f" (default max(1, n // 4) = {rank})")
            )
        return rank

    def get_config(self):
        return {**super().get_config(), "rank": self.rank}
