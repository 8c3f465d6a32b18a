"""`ShortConvolution`: the causal short convolutions of `LinearAttention` on q, k and v, before its recurrence.

The convolution owns its weights (created on the attention layer, so that
they keep the paths older `.keras` files and SavedModels use), its part of
the decode state and its parallel, step and float64 forms. Off
(``conv_size=None``) it is the identity and has no weights and no state.
"""

import keras

from keras_linattn import _state
from keras_linattn.ops import short_conv as conv_ops

__all__ = []


class ShortConvolution:
    """Causal depthwise convolutions of size K over time on q, k and v (Based's "short convolution").

    State: the last ``K - 1`` inputs of each, ``conv_q [K-1, H, D]``,
    ``conv_k [K-1, H, D]``, ``conv_v [K-1, H, M]``. Padded positions enter as
    zeros.

    Args:
        size: None (the identity) or K >= 2 (validated by `AttentionSpec`).
    """

    def __init__(self, size):
        self.size = size

    def attach(self, layer):
        self.layer = layer

    def build(self, layer):
        """Creates ``conv_q``, ``conv_k``, ``conv_v`` on `layer` (PyTorch's Conv1d initialization, as fla's)."""
        self.layer = layer
        if self.size is None:
            return
        h, d, m, seed = layer.num_heads, layer.key_dim, layer.value_dim, layer.seed
        bound = self.size**-0.5

        def init(index):
            return keras.initializers.RandomUniform(-bound, bound, seed=None if seed is None else seed + 10 + index)

        for index, (name, width) in enumerate((("conv_q", d), ("conv_k", d), ("conv_v", m))):
            weight = layer.add_weight(
                name=name, shape=(self.size, h, width), initializer=init(index), dtype="float32", autocast=False
            )
            setattr(self, name, weight)

    def state_spec(self):
        if self.size is None:
            return []
        k, h, d, m = self.size - 1, self.layer.num_heads, self.layer.key_dim, self.layer.value_dim
        return [
            _state.StateSpec("conv_q", (k, h, d), "float32"),
            _state.StateSpec("conv_k", (k, h, d), "float32"),
            _state.StateSpec("conv_v", (k, h, m), "float32"),
        ]

    def __call__(self, q, k, v, key_mask, query_mask, state):
        """``(q, k, v)`` over a piece, from the buffers in `state` (a dict, or None: zeros).

        Returns ``((q, k, v), new_buffers)``.
        """
        if self.size is None:
            return (q, k, v), {}
        state = state or {}
        q, buf_q = conv_ops.causal_conv(q, self.conv_q, state.get("conv_q"), query_mask, return_buffer=True)
        k, buf_k = conv_ops.causal_conv(k, self.conv_k, state.get("conv_k"), key_mask, return_buffer=True)
        v, buf_v = conv_ops.causal_conv(v, self.conv_v, state.get("conv_v"), key_mask, return_buffer=True)
        return (q, k, v), {"conv_q": buf_q, "conv_k": buf_k, "conv_v": buf_v}  # [B, T, H, D|D|M]

    def step(self, q, k, v, state):
        """One step on ``q, k [B, H, D]``, ``v [B, H, M]``; returns ``((q, k, v), new_buffers)``."""
        if self.size is None:
            return (q, k, v), {}
        q, buf_q = conv_ops.causal_conv_step(q, self.conv_q, state["conv_q"])  # [B, H, D]
        k, buf_k = conv_ops.causal_conv_step(k, self.conv_k, state["conv_k"])  # [B, H, D]
        v, buf_v = conv_ops.causal_conv_step(v, self.conv_v, state["conv_v"])  # [B, H, M]
        return (q, k, v), {"conv_q": buf_q, "conv_k": buf_k, "conv_v": buf_v}

    def oracle(self, q, k, v, mask):
        """The float64 reference of the causal convolutions from empty buffers."""
        if self.size is None:
            return q, k, v
        pairs = ((q, self.conv_q), (k, self.conv_k), (v, self.conv_v))
        return tuple(conv_ops.causal_conv_reference(x, w, mask=mask) for x, w in pairs)
