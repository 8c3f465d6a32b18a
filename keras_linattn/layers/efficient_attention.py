"""EfficientAttention: softmax-normalized linear attention with optional Linformer projections."""

import keras
import numpy as np
from keras import ops

from keras_linattn.layers._projections import build_projections, projection_config, set_projection_arguments
from keras_linattn.ops import core as la_ops

# Finite stand-in for -inf before the softmax over the sequence: an all-padded
# row then gives exp(0) * 0 = 0 instead of NaN.
_NEG_LARGE = -1e30

# Sequence projections: name -> whether E and F are trainable.
_PROJECTIONS = {"random": False, "learned": True}


@keras.saving.register_keras_serializable(package="keras_linattn")
class EfficientAttention(keras.layers.Layer):
    """Multi-head "efficient attention", optionally with Linformer projections.

    Per head, with projected queries ``Q [T, D]``, keys ``K [S, D]`` and
    values ``V [S, M]``:

        out = softmax_features(Q) . (softmax_seq(E K)^T . (F V))

    where ``softmax_features`` normalizes each query over its ``D`` features
    and ``softmax_seq`` normalizes each key feature over the (projected)
    sequence. The product is evaluated right to left: ``(E K)^T (F V)`` is a
    ``D x M`` context per head, so the cost is ``O(S * k * (D + M) + T * D * M)``
    and no ``T x S`` (or ``T x k``) matrix is ever formed.

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
        dropout: dropout rate applied to the per-head attention output before
            the output projection (there is no attention matrix to drop from).
        use_bias: whether the query/key/value/output projections have biases.
        output_shape: size of the last output dim; defaults to the query's.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in `keras.layers.MultiHeadAttention`.
        seed: seed of the random projection ``R`` and of the dropout. With
            ``None`` a fresh ``R`` is drawn (and saved with the weights).

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

    Returns:
        ``[B, T, output_dim]``.

    Example:

    >>> layer = EfficientAttention(num_heads=4, key_dim=16, projection="random",
    ...                            projection_dim=32, max_length=512, seed=0)
    >>> x = keras.random.normal((2, 300, 64))
    >>> layer(x, x).shape
    (2, 300, 64)
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
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        seed=None,
        **kwargs,
    ):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.supports_masking = True
        la_ops._check_positive_int("num_heads", num_heads)
        la_ops._check_positive_int("key_dim", key_dim)
        if value_dim is not None:
            la_ops._check_positive_int("value_dim", value_dim)
        if projection is not None and projection not in _PROJECTIONS:
            raise ValueError(
                f"`projection` must be one of {sorted(_PROJECTIONS)} or None. "
                f"Received: projection={projection!r}"
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
            la_ops._check_positive_int("projection_dim", projection_dim)
            la_ops._check_positive_int("max_length", max_length)
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not np.isfinite(delta):
            raise ValueError(f"`delta` must be a finite number. Received: delta={delta!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
        if output_shape is not None:
            if isinstance(output_shape, (list, tuple)):
                if len(output_shape) != 1:
                    raise ValueError(
                        "`output_shape` must be an int or a 1-tuple. "
                        f"Received: output_shape={output_shape!r}"
                    )
                output_shape = output_shape[0]
            la_ops._check_positive_int("output_shape", output_shape)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"`seed` must be a non-negative integer or None. Received: seed={seed!r}")
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim if value_dim is not None else key_dim
        self.projection = projection
        self.projection_dim = projection_dim
        self.max_length = max_length
        self.delta = float(delta)
        self.dropout = dropout
        self.use_bias = use_bias
        self.output_shape_ = output_shape
        set_projection_arguments(
            self, kernel_initializer, bias_initializer, kernel_regularizer,
            bias_regularizer, kernel_constraint, bias_constraint,
        )
        self.seed = seed
        self._dropout_layer = keras.layers.Dropout(dropout, seed=seed)

    # ------------------------------------------------------------------ build
    def _random_matrix(self):
        """``R [K, N]`` with ``N(0, 1/k)`` entries, deterministic given `seed`."""
        rng = np.random.default_rng(self.seed)
        r = rng.standard_normal((self.projection_dim, self.max_length)) / np.sqrt(self.projection_dim)
        return r.astype("float32")  # [K, N]

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        build_projections(self, query_shape, value_shape, key_shape)
        self._check_length(key_shape[1])
        for dense in (self.query_dense, self.key_dense, self.value_dense):
            # Inputs may carry a Keras mask; it is consumed by `call`, not lost.
            dense.supports_masking = True
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
        self.built = True

    def _check_length(self, length):
        if self.projection is not None and length is not None and length > self.max_length:
            raise ValueError(
                f"The key length exceeds `max_length` of the {self.projection!r} projection. "
                f"Received: key length {length} with max_length={self.max_length}"
            )

    # ------------------------------------------------------------------- call
    def call(
        self,
        query,
        value,
        key=None,
        query_mask=None,
        value_mask=None,
        key_mask=None,
        attention_mask=None,
        use_causal_mask=False,
        training=None,
    ):
        if use_causal_mask:
            raise ValueError(
                "EfficientAttention is non-causal: every query attends to every key "
                "through one context matrix, so a causal mask cannot be applied. Use "
                "`LinearAttention` for causal attention. "
                f"Received: use_causal_mask={use_causal_mask!r}"
            )
        if attention_mask is not None:
            raise ValueError(
                "EfficientAttention does not support an arbitrary `attention_mask` (it "
                "never forms the T x S attention matrix). Use `key_mask` ([B, S]) for "
                f"padding. Received: attention_mask with shape {tuple(attention_mask.shape)}"
            )
        if key is None:
            key = value
        if key_mask is None:
            key_mask = value_mask
        for name, x in (("query", query), ("value", value), ("key", key)):
            if len(x.shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 [batch, length, dim]. Received: {name}.shape={tuple(x.shape)}"
                )
        self._check_length(key.shape[1])
        if key_mask is not None and len(key_mask.shape) != 2:
            raise ValueError(
                f"`key_mask` must have shape [B, S]. Received: key_mask.shape={tuple(key_mask.shape)}"
            )
        q = self.query_dense(query)  # [B, T, H, D]
        k = self.key_dense(key)  # [B, S, H, D]
        v = self.value_dense(value)  # [B, S, H, M]
        attended = self._attend(q, k, v, key_mask)  # [B, T, H, M]
        attended = self._dropout_layer(attended, training=training)  # [B, T, H, M]
        return self.output_dense(attended)  # [B, T, out_dim]

    def _attend(self, q, k, v, key_mask):
        """Right-to-left efficient attention on projected heads, in float32."""
        out_dtype = v.dtype
        q = ops.softmax(ops.cast(q, "float32"), axis=-1)  # [B, T, H, D]
        k = ops.cast(k, "float32")  # [B, S, H, D]
        v = ops.cast(v, "float32")  # [B, S, H, M]
        mask = None if key_mask is None else ops.cast(key_mask, "float32")[:, :, None, None]  # [B, S, 1, 1]
        if self.projection is None:
            weights = _masked_softmax_over_sequence(k, mask)  # [B, S, H, D]
            context = ops.einsum("bshd,bshm->bhdm", weights, v)  # [B, H, D, M]
        else:
            if mask is not None:
                k = k * mask  # [B, S, H, D]
                v = v * mask  # [B, S, H, M]
            length = ops.shape(k)[1]
            e = self.projection_key[:, :length]  # [K, S]
            f = self.projection_value[:, :length]  # [K, S]
            kp = ops.einsum("ks,bshd->bkhd", e, k)  # [B, K, H, D]
            vp = ops.einsum("ks,bshm->bkhm", f, v)  # [B, K, H, M]
            weights = ops.softmax(kp, axis=1)  # [B, K, H, D]
            context = ops.einsum("bkhd,bkhm->bhdm", weights, vp)  # [B, H, D, M]
        out = ops.einsum("bthd,bhdm->bthm", q, context)  # [B, T, H, M]
        return ops.cast(out, out_dtype)

    def compute_mask(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, **kwargs):
        return query_mask

    # ----------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "projection": self.projection,
                "projection_dim": self.projection_dim,
                "max_length": self.max_length,
                "delta": self.delta,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "output_shape": self.output_shape_,
                **projection_config(self),
                "seed": self.seed,
            }
        )
        return config


def _masked_softmax_over_sequence(k, mask):
    """Softmax of ``k [B, S, H, D]`` over S; masked keys get weight 0.

    ``mask`` is ``[B, S, 1, 1]`` (1 = keep) or None. A batch row whose keys are
    all masked gets all-zero weights (so a zero context), never NaN.
    """
    if mask is None:
        return ops.softmax(k, axis=1)  # [B, S, H, D]
    logits = ops.where(mask > 0, k, ops.full_like(k, _NEG_LARGE))  # [B, S, H, D]
    peak = ops.stop_gradient(ops.max(logits, axis=1, keepdims=True))  # [B, 1, H, D]
    expd = ops.exp(logits - peak) * mask  # [B, S, H, D]
    total = ops.sum(expd, axis=1, keepdims=True)  # [B, 1, H, D]
    return expd / ops.where(total > 0, total, ops.ones_like(total))
