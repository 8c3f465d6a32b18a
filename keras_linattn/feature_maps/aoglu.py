"""AOGLU trainable kernel: OGLU with low-rank gates (Yorsh & Kovalenko 2022)."""

from keras_linattn.feature_maps.oglu import OGLUFeatureMap
from keras_linattn.feature_maps.registry import register


@register("aoglu")
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
        depth: number of GLU units ``k``, 1 to 3. Default 1.
        feature_dim: width ``n = C`` of every unit (the output feature dim).
            Default None: ``C = D``.
        hidden_activation: filter activation of the units before the last:
            ``"sigmoid"`` (default), ``"gelu"``, ``"relu"``, ``"tanh"``.
        share_qk: True (default): one kernel for queries and keys. False:
            separate kernels.
        rank: rank ``r`` of the gates, ``1 <= r < n/2``. Default None:
            ``max(1, n // 4)``. Checked when the width is known (here if
            `feature_dim` is given, else when the layer is built).
        orthogonal_penalty: factor of the orthogonal regularizer on the
            filters, >= 0. Default 0.01.
        gate_initializer: initializer of ``A`` and ``B``, applied head by
            head. Default ``"glorot_uniform"``.
        seed: optional integer base seed of the initializers.
        **kwargs: `FeatureMap` / `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: selects the query or key kernel when ``share_qk=False``.
        causal: unused (the map is token-wise).

    Returns:
        ``[B, T, H, C]`` positive float32 features.

    Example:

    >>> x = keras.random.normal((2, 100, 64))
    >>> layer = keras_linattn.layers.LinearAttention(
    ...     4, 16, feature_map=AOGLUFeatureMap(feature_dim=32, rank=8))
    >>> layer(x, x).shape
    (2, 100, 64)
    """

    def __init__(
        self,
        depth=1,
        feature_dim=None,
        hidden_activation="sigmoid",
        share_qk=True,
        rank=None,
        orthogonal_penalty=0.01,
        gate_initializer="glorot_uniform",
        seed=None,
        **kwargs,
    ):
        super().__init__(
            depth=depth,
            feature_dim=feature_dim,
            hidden_activation=hidden_activation,
            share_qk=share_qk,
            orthogonal_penalty=orthogonal_penalty,
            gate_initializer=gate_initializer,
            seed=seed,
            **kwargs,
        )
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"`rank` must be a positive integer or None. Received: rank={rank!r}")
        self.rank = rank
        if feature_dim is not None:
            self.gate_rank(feature_dim)

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
