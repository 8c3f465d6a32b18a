"""GLU trainable kernels (Yorsh & Kovalenko 2022): the shared GLU stack and `glu`."""

import keras
from keras import ops

from keras_linattn._validation import check_non_negative_float
from keras_linattn.feature_maps import _stable, _trainable
from keras_linattn.feature_maps.registry import register

__all__ = ["GLUFeatureMap"]


class _GLUStack(_trainable.StackedFeatureMap):
    """A head-wise stack of GLU units; the logic shared by `glu`, `oglu`, `aoglu`.

    Unit ``i`` maps ``u_{i-1}`` (``u_0 = x``) to
    ``u_i = act(u_{i-1} W_f^i) * sigmoid(u_{i-1} W_g^i)``; the last unit
    uses softplus for ``act``, so features are positive. The filter
    ``W_f^i`` and gate ``W_g^i`` are ``[H, D, C]`` for the first unit and
    ``[H, C, C]`` after it. A query whose features would all underflow is
    scaled up by a positive factor (`keras_linattn.feature_maps._stable`),
    which cancels in the attention ratio. A subclass whose `gate_rank(width)` returns an
    integer ``r`` gets a low-rank gate ``W_g = A B`` with ``A [H, in, r]``
    and ``B [H, r, C]``, applied as ``(u A) B``.

    Not registered and not meant to be built directly: the public maps
    (`GLUFeatureMap`, `OGLUFeatureMap`, `AOGLUFeatureMap`) fix its
    arguments and serialize their own.

    Args:
        filter_initializer, gate_initializer: initializers, applied head by head.
        filter_penalty: `OrthogonalRegularizer` factor on the filters (0: none).
        **kwargs: the shared arguments of `StackedFeatureMap` (`depth`,
            `feature_dim`, `hidden_activation`, `share_qk`, `seed`) and
            `FeatureMap` arguments.
    """

    def __init__(self, *, filter_initializer, gate_initializer, filter_penalty=0.0, **kwargs):
        super().__init__(**kwargs)
        self._filter_initializer = keras.initializers.get(filter_initializer)
        self._gate_initializer = keras.initializers.get(gate_initializer)
        self._filter_penalty = check_non_negative_float("orthogonal_penalty", filter_penalty)

    def gate_rank(self, width):
        """Rank of the gates of units of width `width`; None: full-rank gates."""
        return None

    def build_branch(self, prefix, num_heads, input_dim):
        rank = self.gate_rank(self.feature_dim(input_dim))
        dims = _trainable.layer_dims(input_dim, self.feature_dim(input_dim), self.depth)
        units = []
        for i, (n_in, n_out) in enumerate(dims):
            unit = {
                "filter": self.add_headwise_weight(
                    f"{prefix}_filter_{i}",
                    (num_heads, n_in, n_out),
                    self._filter_initializer,
                    self.orthogonal_regularizer(self._filter_penalty),
                )
            }
            if rank is None:
                unit["gate"] = self.add_headwise_weight(
                    f"{prefix}_gate_{i}", (num_heads, n_in, n_out), self._gate_initializer
                )
            else:
                unit["gate_a"] = self.add_headwise_weight(
                    f"{prefix}_gate_a_{i}", (num_heads, n_in, rank), self._gate_initializer
                )
                unit["gate_b"] = self.add_headwise_weight(
                    f"{prefix}_gate_b_{i}", (num_heads, rank, n_out), self._gate_initializer
                )
            units.append(unit)
        return units

    def _gate_logits(self, x, unit):
        if "gate" in unit:
            return _trainable.headwise_matmul(x, unit["gate"])  # [B, T, H, C]
        low = _trainable.headwise_matmul(x, unit["gate_a"])  # [B, T, H, r]
        return _trainable.headwise_matmul(low, unit["gate_b"])  # [B, T, H, C]

    lifts_queries = True

    def apply_branch(self, inputs, units, is_query=False):
        hidden = _trainable.HIDDEN_ACTIVATIONS[self.hidden_activation]
        x = inputs  # [B, T, H, D]
        for i, unit in enumerate(units):
            last = i == len(units) - 1
            act = ops.softplus if last else hidden
            f = _trainable.headwise_matmul(x, unit["filter"])  # [B, T, H, C]
            g = self._gate_logits(x, unit)  # [B, T, H, C]
            x = act(f) * ops.sigmoid(g)  # [B, T, H, C]
            if last and is_query:
                # softplus(f) * sigmoid(g) underflows for very negative f or g: lift the query.
                x = _stable.lift_query(x, _stable.log_softplus(f) + ops.log_sigmoid(g))  # [B, T, H, C]
        return x


@register("glu")
@_trainable.document
class GLUFeatureMap(_GLUStack):
    """GLU trainable kernel: a stack of gated linear units with a positive output.

        From Yorsh & Kovalenko 2022, "Linear Self-Attention Approximation via
        Trainable Feedforward Kernel". With ``u_0 = x``, unit ``i`` computes
        ``u_i = act(u_{i-1} W_f^i) * sigmoid(u_{i-1} W_g^i)``, and the last unit
        ``phi(x) = softplus(u W_f) * sigmoid(u W_g)``, which is positive. Each
        head has its own filter and gate matrices (``[H, D, C]`` for the first
        unit, ``[H, C, C]`` after; float32, no biases). Parameters:
        ``H * (2*D*C + 2*(k-1)*C^2)`` for ``k`` units, twice that with
        ``share_qk=False``.

        Args:
            kernel_initializer: initializer of filters and gates, applied head by
                head with a fresh instance per head and weight. Default
                ``"glorot_uniform"``.
    {shared_args}

    {call}

        Example:

        >>> import keras
        >>> import numpy as np
        >>> import keras_linattn
        >>> keras.utils.set_random_seed(0)
        >>> x = np.random.default_rng(0).normal(size=(2, 100, 64)).astype("float32")  # [B, T, width]
        >>> fm = GLUFeatureMap(depth=2, feature_dim=32)
        >>> layer = keras_linattn.layers.LinearAttention(4, 16, feature_map=fm)
        >>> y = np.asarray(layer(x, x))
        >>> y.shape, bool(np.isfinite(y).all())
        ((2, 100, 64), True)
    """

    def __init__(self, *, kernel_initializer="glorot_uniform", **kwargs):
        super().__init__(filter_initializer=kernel_initializer, gate_initializer=kernel_initializer, **kwargs)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def get_config(self):
        return {
            **super().get_config(),
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        }
