"""EfficientAttention: softmax-normalized linear attention with optional Linformer projections."""

import keras
import numpy as np
from keras import ops

from keras_linattn import _validation
from keras_linattn.layers import _attention_base
from keras_linattn.ops import efficient as efficient_ops

__all__ = ["EfficientAttention"]

# Sequence projections: name -> whether E and F are trainable.
_PROJECTIONS = {"random": False, "learned": True}


@keras.saving.register_keras_serializable(package="keras_linattn")
@_attention_base.document
class EfficientAttention(_attention_base.ProjectedAttention):
    """Multi-head "efficient attention", optionally with Linformer projections.

        Per head, with projected queries ``Q [T, D]``, keys ``K [S, D]`` and
        values ``V [S, M]``:

            out = softmax_features(Q) . (softmax_seq(E K)^T . (F V))

        where ``softmax_features`` normalizes each query over its ``D`` features
        and ``softmax_seq`` normalizes each key feature over the (projected)
        sequence. The product is evaluated right to left: ``(E K)^T (F V)`` is a
        ``D x M`` context per head, so the cost is ``O(S * k * (D + M) + T * D * M)``
        and no ``T x S`` (or ``T x k``) matrix is ever formed
        (`keras_linattn.ops.efficient_attention`, in float32 under any policy).

        - ``projection="random"`` ("Revisiting Linformer"): ``E = delta * R`` and
          ``F = exp(-delta) * R`` with ``R`` a fixed ``k x n`` Gaussian matrix,
          entries ``N(0, 1/k)``, drawn from `seed` and stored as non-trainable
          weights (so a saved model reloads the same projection).
        - ``projection="learned"``: ``E`` and ``F`` are trainable weights, with
          the same initial values as ``"random"``.
        - ``projection=None``: plain efficient attention (Shen et al. 2021),
          ``softmax_features(Q) . (softmax_seq(K)^T V)``, for any length.

        ``E`` and ``F`` are shared by all heads. With a projection, `max_length`
        is the longest key sequence ``n``; a shorter key sequence of length
        ``S`` uses the first ``S`` columns of ``E`` and ``F`` (so a right-padded
        batch with a `key_mask` gives exactly the outputs of the unpadded
        sequences). Keys longer than `max_length` raise ``ValueError`` when the
        length is known at trace time and fail in the projection einsum
        otherwise.

        This attention is non-causal: every query sees every key.

        Shapes: B batch, T query length, S key length, H heads, D key dim,
        M value dim, K projection dim k.

        Args:
            num_heads: number of attention heads H.
            key_dim: size of each query/key head D.
            value_dim: size of each value head M; defaults to `key_dim`.
            projection: ``"random"``, ``"learned"`` or ``None`` (default).
            projection_dim: the projected length k (required with a projection).
            max_length: the maximum key length n (required with a projection).
            delta: the scale ``delta`` of ``E = delta R``, ``F = exp(-delta) R``.
                Default 1.0.
    {projection_args}
            seed: seed of the random projection ``R`` and of the dropout. With
                ``None`` a fresh ``R`` is drawn (and saved with the weights).
                Keyword-only.

        Call arguments:
            query: ``[B, T, dim]``.
            value: ``[B, S, dim]``.
            key: optional ``[B, S, dim]``; defaults to `value`.
            key_mask: optional ``[B, S]`` padding mask of the keys (1 = keep).
                Without a projection, padded keys get ``-inf`` before the softmax
                over the sequence; with a projection, padded keys and values are
                zeroed before ``E`` and ``F`` (their columns drop out). Keras
                masks on `value`/`key` are used automatically.
            attention_mask: not supported (``ValueError``); use `key_mask`.
            use_causal_mask: must be False: this layer is non-causal.
            training: Python boolean, for dropout.
            return_state, initial_state: not supported (``ValueError``): this
                attention keeps no state.

        Returns:
            ``[B, T, output_dim]``, with the query's Keras mask.

        Example:

        >>> import numpy as np
        >>> layer = EfficientAttention(num_heads=4, key_dim=16, projection="random",
        ...                            projection_dim=32, max_length=512, seed=0)
        >>> x = np.random.default_rng(0).normal(size=(2, 300, 64)).astype("float32")  # [B, T, width]
        >>> y = np.asarray(layer(x, x))
        >>> y.shape, bool(np.isfinite(y).all())
        ((2, 300, 64), True)
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        projection=None,
        projection_dim=None,
        max_length=None,
        delta=1.0,
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim, **kwargs)
        if projection is not None and projection not in _PROJECTIONS:
            raise ValueError(
                f"`projection` must be one of {sorted(_PROJECTIONS)} or None. Received: projection={projection!r}"
            )
        if projection is None:
            for name, val in (("projection_dim", projection_dim), ("max_length", max_length)):
                if val is not None:
                    raise ValueError(
                        f"`{name}` only applies with a sequence projection "
                        "(projection='random' or 'learned'); with projection=None "
                        f"leave it None. Received: {name}={val!r}"
                    )
        else:
            _validation.check_positive_int("projection_dim", projection_dim)
            _validation.check_positive_int("max_length", max_length)
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not np.isfinite(delta):
            raise ValueError(f"`delta` must be a finite number. Received: delta={delta!r}")
        self.projection = projection
        self.projection_dim = projection_dim
        self.max_length = max_length
        self.delta = float(delta)

    # ------------------------------------------------------------------ build
    def _random_matrix(self):
        """``R [K, N]`` with ``N(0, 1/k)`` entries, deterministic given `seed`."""
        rng = np.random.default_rng(self.seed)
        r = rng.standard_normal((self.projection_dim, self.max_length)) / np.sqrt(self.projection_dim)
        return r.astype("float32")  # [K, N]

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        self._check_length((value_shape if key_shape is None else key_shape)[1])
        if self.projection is not None:
            r = self._random_matrix()  # [K, N]
            trainable = _PROJECTIONS[self.projection]
            self.projection_key = self.add_weight(
                name="projection_key",
                shape=r.shape,
                initializer=lambda shape, dtype=None: ops.convert_to_tensor(self.delta * r, dtype),
                trainable=trainable,
                dtype="float32",
            )  # E [K, N]
            self.projection_value = self.add_weight(
                name="projection_value",
                shape=r.shape,
                initializer=lambda shape, dtype=None: ops.convert_to_tensor(np.exp(-self.delta) * r, dtype),
                trainable=trainable,
                dtype="float32",
            )  # F [K, N]

    def _check_length(self, length):
        if self.projection is not None and length is not None and length > self.max_length:
            raise ValueError(
                f"The key length exceeds `max_length` of the {self.projection!r} projection. "
                f"Received: key length {length} with max_length={self.max_length}"
            )

    # ------------------------------------------------------------------- call
    def _compute_attention(
        self, query, key, value, key_mask=None, use_causal_mask=False, training=None, initial_state=None
    ):
        """`keras_linattn.ops.efficient_attention` with this layer's E and F; no state."""
        if use_causal_mask:
            raise ValueError(
                "EfficientAttention is non-causal: every query attends to every key "
                "through one context matrix, so a causal mask cannot be applied. Use "
                "`LinearAttention` for causal attention. "
                f"Received: use_causal_mask={use_causal_mask!r}"
            )
        if initial_state is not None:
            raise ValueError(
                "EfficientAttention keeps no state between calls: `initial_state` only applies to "
                f"`LinearAttention`. Received: initial_state={initial_state!r}"
            )
        self._check_length(key.shape[1])
        if self.projection is None:
            attended = efficient_ops.efficient_attention(query, key, value, key_mask)  # [B, T, H, M]
        else:
            attended = efficient_ops.efficient_attention(
                query, key, value, key_mask, self.projection_key, self.projection_value
            )  # [B, T, H, M]
        return attended, None

    # ----------------------------------------------------------------- config
    def get_config(self):
        return {
            **super().get_config(),
            "projection": self.projection,
            "projection_dim": self.projection_dim,
            "max_length": self.max_length,
            "delta": self.delta,
        }
