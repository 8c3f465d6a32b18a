"""LinearAttentionCell: causal linear self-attention as a `keras.layers.RNN` cell."""

import keras
from keras import ops

from keras_linattn import _state
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers.linear_attention import LinearAttention

__all__ = ["LinearAttentionCell"]


@keras.saving.register_keras_serializable(package="keras_linattn")
class LinearAttentionCell(CheckpointTracked, keras.layers.Layer):
    """Causal linear self-attention as a recurrent cell for `keras.layers.RNN`.

    Causal linear attention is an RNN whose state is
    ``(S [B, H, C, M], z [B, H, C])``:
    ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``out_t = phi(q_t)^T S_t / phi(q_t)^T z_t``. This cell runs one such step
    per call through `LinearAttention.step`, so it shares every weight with
    the wrapped `LinearAttention` layer: a model can train with the layer's
    chunkwise-parallel path (``use_causal_mask=True``) and run the very same
    weights token by token inside ``keras.layers.RNN``.

    ``keras.layers.RNN`` wants integer state sizes, so the state travels
    flattened, one ``[B, size]`` tensor per entry of the attention's
    `LinearAttention.state_spec` (``[S.reshape(B, H*C*M), z.reshape(B, H*C)]``
    for plain linear attention);
    `pack_state` / `unpack_state` convert between the two forms. The cell
    computes in float32 by default (``dtype="float32"``) because the RNN
    layer casts the states to the cell's compute dtype between steps and the
    state must accumulate in float32; the wrapped layer keeps its own policy.
    The RNN layer also casts the states it *returns* to its own compute
    dtype: under a mixed policy, build it with
    ``keras.layers.RNN(cell, ..., dtype="float32")`` to get float32 states back.

    Args:
        attention: a `LinearAttention` layer (shared, not copied) or its
            serialized config. The cell runs it as causal self-attention
            (query = key = value = the step input).
        **kwargs: standard `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: ``[B, dim]`` the input at one time step.
        states: flat states, one per `LinearAttention.state_spec` entry
            (``[S_flat [B, H*C*M], z_flat [B, H*C]]`` for plain attention).
        training: Python boolean, passed to the attention layer (dropout).

    Returns:
        ``(output [B, output_dim], [S_flat, z_flat])``.

    Example:

    >>> import numpy as np
    >>> keras.utils.set_random_seed(0)
    >>> attention = LinearAttention(num_heads=2, key_dim=8)
    >>> x = np.random.default_rng(0).normal(size=(2, 10, 16)).astype("float32")  # [B, T, width]
    >>> parallel = np.asarray(attention(x, x, use_causal_mask=True))  # [2, 10, 16]
    >>> rnn = keras.layers.RNN(LinearAttentionCell(attention), return_sequences=True)
    >>> recurrent = np.asarray(rnn(x))
    >>> bool(np.allclose(parallel, recurrent, atol=1e-4))  # the same attention, token by token
    True
    """

    def __init__(self, attention, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(attention, dict):
            attention = keras.saving.deserialize_keras_object(attention)
        if not isinstance(attention, LinearAttention):
            raise ValueError(
                "`attention` must be a LinearAttention layer or its serialized config. "
                f"Received: attention={attention!r}"
            )
        self.attention = attention
        self._input_dim = None

    # --------------------------------------------------------------- sizes
    @property
    def num_heads(self):
        return self.attention.num_heads

    @property
    def feature_dim(self):
        return self.attention.feature_dim

    @property
    def value_dim(self):
        return self.attention.value_dim

    @property
    def state_size(self):
        return [_state.flat_size(entry) for entry in self.attention.state_spec()]

    @property
    def output_size(self):
        if self.attention.output_shape_ is not None:
            return self.attention.output_shape_
        return self._input_dim

    # --------------------------------------------------------------- state
    def pack_state(self, state):
        """The attention's state (`LinearAttention.state_spec`) -> flat ``[B, size]`` tensors for the RNN."""
        return [
            ops.reshape(ops.cast(x, "float32"), (-1, size))  # [B, size]
            for x, size in zip(state, self.state_size, strict=True)
        ]

    def unpack_state(self, states):
        """Flat ``[B, size]`` tensors -> the attention's state, e.g. ``(S [B, H, C, M], z [B, H, C])``."""
        spec = self.attention.state_spec()
        if not isinstance(states, (list, tuple)) or len(states) != len(spec):
            shapes = ", ".join(f"[B, {size}]" for size in self.state_size)
            raise ValueError(
                f"`states` must be a list of {len(spec)} flat tensors of shapes {shapes} "
                f"({', '.join(e.name for e in spec)}). Received: states={states!r}"
            )
        for i, (x, size) in enumerate(zip(states, self.state_size, strict=True)):
            if len(x.shape) != 2 or (x.shape[-1] is not None and x.shape[-1] != size):
                raise ValueError(
                    f"`states[{i}]` must have shape [B, {size}]. Received: states[{i}].shape={tuple(x.shape)}"
                )
        return tuple(
            ops.reshape(ops.cast(x, entry.dtype), (-1,) + tuple(entry.shape))
            for x, entry in zip(states, spec, strict=True)
        )

    def get_initial_state(self, batch_size=None):
        """Zero flat states ``[B, size]`` (float32), one per `LinearAttention.state_spec` entry."""
        return [ops.zeros((batch_size, size), dtype="float32") for size in self.state_size]

    # ---------------------------------------------------------------- call
    def build(self, input_shape):
        if len(input_shape) != 2:
            raise ValueError(
                "LinearAttentionCell expects step inputs of rank 2 [batch, dim]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self._input_dim = input_shape[-1]
        if not self.attention.built:
            seq_shape = (input_shape[0], None, input_shape[-1])
            self.attention.build(seq_shape, seq_shape)
        self.built = True

    def call(self, inputs, states, training=None):
        state = self.unpack_state(list(states))
        inputs = ops.cast(inputs, self.attention.compute_dtype)
        output, new_state = self.attention.step(inputs, inputs, state, training=training)  # [B, out_dim]
        return output, self.pack_state(new_state)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.output_size or input_shape[-1])

    # -------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config["attention"] = keras.saving.serialize_keras_object(self.attention)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["attention"] = keras.saving.deserialize_keras_object(config["attention"])
        return cls(**config)
