"""Shared body of the pre-norm linear-attention transformer blocks.

`LinearTransformerEncoder` (non-causal) and `LinearTransformerDecoder`
(causal) differ only in the attention direction; both subclass the private
`_LinearTransformerBlock` below.
"""

import keras
from keras import ops

from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn._validation import (
    check_bool,
    check_epsilon,
    check_one_of,
    check_optional_positive_int,
    check_positive_int,
    check_rate,
    check_seed,
)
from keras_linattn.layers._mechanism_doc import MECHANISM_ARGS_DOC
from keras_linattn.layers.linear_attention import LinearAttention
from keras_linattn.layers.mixture_of_experts import MOE_ARGUMENTS, MixtureOfExperts
from keras_linattn.layers.spec import DEFAULT_FEATURE_MAP, AttentionSpec

# The blocks' public classes live in transformer_encoder.py and transformer_decoder.py.
__all__ = []


def _gelu_approximate(x):
    """GELU in its tanh form (GPT-2's): ``keras.activations.gelu(x, approximate=True)``."""
    return keras.activations.gelu(x, approximate=True)


def _get_activation(activation):
    """`keras.activations.get`, plus the name ``"gelu_approximate"``."""
    if activation == "gelu_approximate":
        return _gelu_approximate
    return keras.activations.get(activation)


def _serialize_activation(activation):
    if activation is _gelu_approximate:
        return "gelu_approximate"
    return keras.activations.serialize(activation)


def _step_norm(norm, x):
    """``norm(x)`` for one token ``[B, dim]``, in the plain form where `norm` is a float32 norm of the last axis.

    ``(x - mean) / sqrt(var + eps) * gamma + beta`` for a `LayerNormalization`,
    ``x / sqrt(mean(x^2) + eps) * scale`` for an `RMSNormalization`, with the
    square as a power: the same values as the layer's call up to rounding,
    in fewer ops than Keras' form (9 against 14 in TensorFlow), and in the
    pattern onnxruntime fuses into one ``LayerNormalization`` /
    ``SimplifiedLayerNormalization`` node (Keras' form stays 13 nodes
    there). A decode step runs 2 per layer and one more, each at one
    token, where the op count is the cost. Any other norm (other axes,
    centre or scale off, another dtype) is called as is.
    """
    plain = (
        norm.built
        and norm.compute_dtype == "float32"
        and norm.variable_dtype == "float32"
        and x.dtype == "float32"
        and norm.axis in (-1, [-1], len(x.shape) - 1, [len(x.shape) - 1])
    )
    if plain and type(norm) is keras.layers.RMSNormalization:
        return x / ops.sqrt(ops.mean(ops.power(x, 2.0), axis=-1, keepdims=True) + norm.epsilon) * norm.scale
    if plain and type(norm) is keras.layers.LayerNormalization and norm.center and norm.scale and not norm.rms_scaling:
        centred = x - ops.mean(x, axis=-1, keepdims=True)  # [B, dim]
        variance = ops.mean(ops.power(centred, 2.0), axis=-1, keepdims=True)  # [B, 1]
        return centred / ops.sqrt(variance + norm.epsilon) * norm.gamma + norm.beta
    return norm(x)


def _check_moe(moe):
    """`moe` as a dict of `MixtureOfExperts` arguments (`MOE_ARGUMENTS`), or None.

    Raises:
        ValueError: for a value that is not None or a dict of those keys
            with ``num_experts``, ``top_k`` and ``expert_dim``.
    """
    if moe is None:
        return None
    required = {"num_experts", "top_k", "expert_dim"}
    if not isinstance(moe, dict) or set(moe) - set(MOE_ARGUMENTS) or not required <= set(moe):
        raise ValueError(
            f"`moe` must be None or a dict with {sorted(required)} and optionally the other keys of "
            f"{list(MOE_ARGUMENTS)}. Received: moe={moe!r}"
        )
    return dict(moe)


def _make_norm(kind, epsilon, dtype, name):
    """A LayerNormalization or an RMSNormalization (``x / sqrt(mean(x^2) + eps) * scale``)."""
    if kind == "rms_norm":
        return keras.layers.RMSNormalization(epsilon=epsilon, dtype=dtype, name=name)
    return keras.layers.LayerNormalization(epsilon=epsilon, dtype=dtype, name=name)


# The constructor arguments of both blocks, documented once (see
# `keras_linattn._docstrings.fill`).
_BLOCK_ARGS_DOC = (
    """\
        num_heads: number of attention heads H.
        intermediate_dim: hidden size of the feed-forward network.
        key_dim: size of each query/key head D; defaults to ``dim // num_heads``.
        value_dim: size of each value head M; defaults to `key_dim`.
        feature_map: a registered feature-map name
            (`keras_linattn.feature_maps.available()`), a serialized
            feature-map config, or a `FeatureMap` instance (used as a
            template: the attention layer owns a copy). Default ``"taylor"``
            with the default ``conv_size=4``, the recommended attention
            (`keras_linattn.layers.LinearAttention`); its feature dim is
            ``1 + D + D^2`` (4161 at D = 64), so give it a small `key_dim`
            (16). ``feature_map="elu", conv_size=None`` is plain linear
            attention.
        chunk_size: chunk length of the causal algorithm. Default 64. (The
            encoder keeps it for a uniform config; its non-causal path does
            not chunk.)
        dropout: dropout rate of the attention output and of the residual
            branches.
        activation: activation of the feed-forward network. Default "gelu"
            (exact); ``"gelu_approximate"`` is the tanh form GPT-2 uses.
        layer_norm_epsilon: epsilon of the two norms.
        use_bias: whether the dense layers (feed-forward and attention
            projections) have biases.
        normalization: ``"layer_norm"`` (default) or ``"rms_norm"``
            (``x / rms(x) * scale``, as in Llama).
        feedforward: ``"dense"`` (default: ``Dense(activation(Dense(x)))``)
            or ``"gated"`` (``Dense(activation(gate(x)) * up(x))``, SwiGLU
            with ``activation="silu"``, as in Llama).
        kernel_initializer, bias_initializer: initializers of the dense layers.
        seed: seed of the dropout layers.
        post_norms: False (default) or True: a norm (of `normalization`'s
            kind) on the attention's output and on the feed-forward's output
            before each is added to the residual stream (Gemma 2 and 3's
            ``post_attention_norm`` / ``post_ffw_norm``).
        parallel_residual: False (default) or True: the attention and the
            feed-forward both read the block's input, ``x + Attn(LN1(x)) +
            FFN(LN2(x))`` (GPT-NeoX).
        moe: None (default), or a dict of `MixtureOfExperts` arguments
            (``num_experts``, ``top_k``, ``expert_dim``, optionally
            ``normalize_top_k`` and ``shared_expert_dim``): the feed-forward
            is a mixture of gated experts with `activation` (Mixtral, Qwen
            MoE) instead of the dense layers.
"""
    + MECHANISM_ARGS_DOC
    + """
            The block's attention gets them; the encoder refuses causal
            recurrences."""
)

_document = fill(block_args=_BLOCK_ARGS_DOC)


class _LinearTransformerBlock(CheckpointTracked, keras.layers.Layer):
    """Pre-norm block: ``x + Drop(Attn(LN(x)))``, then ``x + Drop(FFN(LN(x)))``.

    Subclasses set the class attribute ``_causal``.
    """

    _causal = False

    def __init__(
        self,
        num_heads,
        intermediate_dim,
        key_dim=None,
        value_dim=None,
        feature_map=DEFAULT_FEATURE_MAP,
        chunk_size=64,
        dropout=0.0,
        activation="gelu",
        layer_norm_epsilon=1e-5,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        seed=None,
        normalization="layer_norm",
        feedforward="dense",
        post_norms=False,
        parallel_residual=False,
        moe=None,
        *,
        spec=None,
        **kwargs,
    ):
        spec = AttentionSpec.pop(
            kwargs,
            feature_map,
            spec=spec,
            causal=self._causal,
            chunk_size=chunk_size,
            epsilon=kwargs.pop("epsilon", AttentionSpec.epsilon),
        )
        super().__init__(**kwargs)
        self.attention_spec = spec
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.intermediate_dim = check_positive_int("intermediate_dim", intermediate_dim)
        self.key_dim = check_optional_positive_int("key_dim", key_dim)
        self.value_dim = check_optional_positive_int("value_dim", value_dim)
        spec.check_heads(self.num_heads, self.key_dim)
        self.chunk_size = spec.chunk_size
        self.dropout = check_rate("dropout", dropout)
        self.activation = _get_activation(activation)
        self.normalization = check_one_of("normalization", normalization, ("layer_norm", "rms_norm"))
        self.feedforward = check_one_of("feedforward", feedforward, ("dense", "gated"))
        self.layer_norm_epsilon = check_epsilon("layer_norm_epsilon", layer_norm_epsilon)
        self.use_bias = check_bool("use_bias", use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed = check_seed("seed", seed)
        self.post_norms = check_bool("post_norms", post_norms)
        self.parallel_residual = check_bool("parallel_residual", parallel_residual)
        self.moe = _check_moe(moe)
        self._attention_post_norm = self._ffn_post_norm = None
        self._moe = self._ffn_gate = self._ffn_intermediate = self._ffn_output = None
        self.supports_masking = True

    def _init(self, initializer):
        # A fresh initializer per weight: an initializer instance reuses its seed.
        return initializer.__class__.from_config(initializer.get_config())

    def build(self, inputs_shape):
        if len(inputs_shape) != 3:
            raise ValueError(
                f"{type(self).__name__} expects inputs of rank 3 [batch, length, dim]. "
                f"Received: inputs.shape={tuple(inputs_shape)}"
            )
        dim = inputs_shape[-1]
        if dim is None:
            raise ValueError(
                f"The last dim of the inputs of {type(self).__name__} must be defined. "
                f"Received: inputs.shape={tuple(inputs_shape)}"
            )
        key_dim = self.key_dim
        if key_dim is None:
            if dim % self.num_heads:
                raise ValueError(
                    "With `key_dim=None` the hidden dim must be divisible by `num_heads`. "
                    f"Received: hidden dim={dim}, num_heads={self.num_heads}"
                )
            key_dim = dim // self.num_heads
        self.hidden_dim = dim
        self._attention_norm = _make_norm(
            self.normalization, self.layer_norm_epsilon, self.dtype_policy, "self_attention_layer_norm"
        )
        self._attention_norm.build(inputs_shape)
        self._self_attention = LinearAttention(
            num_heads=self.num_heads,
            key_dim=key_dim,
            value_dim=self.value_dim,
            spec=self.attention_spec,  # the layer builds its own feature map and recurrence from it
            dropout=self.dropout,
            use_bias=self.use_bias,
            kernel_initializer=self._init(self.kernel_initializer),
            bias_initializer=self._init(self.bias_initializer),
            seed=self.seed,
            dtype=self.dtype_policy,
            name="self_attention",
        )
        self._self_attention.build(inputs_shape, inputs_shape)
        self._attention_dropout = keras.layers.Dropout(self.dropout, seed=self.seed, dtype=self.dtype_policy)
        self._ffn_norm = _make_norm(
            self.normalization, self.layer_norm_epsilon, self.dtype_policy, "feedforward_layer_norm"
        )
        self._ffn_norm.build(inputs_shape)
        if self.moe is not None:
            self._moe = MixtureOfExperts(
                **self.moe,
                activation=_serialize_activation(self.activation),
                dtype=self.dtype_policy,
                name="feedforward_experts",
            )
            self._moe.build(inputs_shape)
        else:
            self._build_dense_feedforward(inputs_shape, dim)
        self._ffn_dropout = keras.layers.Dropout(self.dropout, seed=self.seed, dtype=self.dtype_policy)
        if self.post_norms:  # last: the weights of blocks without them keep their indices
            self._attention_post_norm, self._ffn_post_norm = (
                _make_norm(self.normalization, self.layer_norm_epsilon, self.dtype_policy, name)
                for name in ("post_attention_norm", "post_feedforward_norm")
            )
            self._attention_post_norm.build(inputs_shape)
            self._ffn_post_norm.build(inputs_shape)
        self.built = True

    def _build_dense_feedforward(self, inputs_shape, dim):
        """The dense feed-forward's layers (`feedforward`: gate, intermediate, output)."""
        gated = self.feedforward == "gated"
        if gated:
            self._ffn_gate = keras.layers.Dense(
                self.intermediate_dim,
                activation=self.activation,
                use_bias=self.use_bias,
                kernel_initializer=self._init(self.kernel_initializer),
                bias_initializer=self._init(self.bias_initializer),
                dtype=self.dtype_policy,
                name="feedforward_gate_dense",
            )
            self._ffn_gate.build(inputs_shape)
        self._ffn_intermediate = keras.layers.Dense(
            self.intermediate_dim,
            activation=None if gated else self.activation,
            use_bias=self.use_bias,
            kernel_initializer=self._init(self.kernel_initializer),
            bias_initializer=self._init(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_intermediate_dense",
        )
        self._ffn_intermediate.build(inputs_shape)
        self._ffn_output = keras.layers.Dense(
            dim,
            use_bias=self.use_bias,
            kernel_initializer=self._init(self.kernel_initializer),
            bias_initializer=self._init(self.bias_initializer),
            dtype=self.dtype_policy,
            name="feedforward_output_dense",
        )
        self._ffn_output.build(tuple(inputs_shape[:-1]) + (self.intermediate_dim,))

    @property
    def attention(self):
        """The block's `LinearAttention` layer (built with the block)."""
        return self._self_attention

    def _post_norm(self, norm, h, step=False):
        """``norm(h)`` where the block has post norms (`post_norms`), else `h`."""
        if norm is None:
            return h
        return _step_norm(norm, h) if step else norm(h)

    def _feedforward_branch(self, x, training, norm=None, step=False):
        """The feed-forward's contribution to the residual stream, from `x` ``[..., dim]``."""
        h = (norm or self._ffn_norm)(x)  # [..., dim]
        if self._moe is not None:
            h = self._post_norm(self._ffn_post_norm, self._moe(h, step=step), step)  # [..., dim]
            return self._ffn_dropout(h, training=training)
        if self.feedforward == "gated":
            h = self._ffn_gate(h) * self._ffn_intermediate(h)  # [..., intermediate_dim]
        else:
            h = self._ffn_intermediate(h)  # [..., intermediate_dim]
        h = self._post_norm(self._ffn_post_norm, self._ffn_output(h), step)  # [..., dim]
        return self._ffn_dropout(h, training=training)

    def _residual(self, inputs, attended, training, norm=None, step=False):
        """The block's output from its input and its attention's output (sequential or parallel residual)."""
        x = inputs + self._attention_dropout(attended, training=training)  # [..., dim]
        if self.parallel_residual:
            return x + self._feedforward_branch(inputs, training, norm, step)
        return x + self._feedforward_branch(x, training, norm, step)

    def call(self, inputs, padding_mask=None, training=None, return_state=False, initial_state=None, mask=None):
        if padding_mask is None:
            padding_mask = mask
        if padding_mask is not None:
            if len(padding_mask.shape) != 2:
                raise ValueError(
                    "`padding_mask` must have shape [batch, length]. "
                    f"Received: padding_mask.shape={tuple(padding_mask.shape)}"
                )
        h = self._attention_norm(inputs)  # [B, T, dim]
        result = self._self_attention(
            h,
            h,
            key_mask=padding_mask,
            use_causal_mask=self._causal,
            training=training,
            return_state=return_state,
            initial_state=initial_state,
        )
        attended, state = result if return_state else (result, None)
        attended = self._post_norm(self._attention_post_norm, attended)  # [B, T, dim]
        x = self._residual(inputs, attended, training)  # [B, T, dim]
        if return_state:
            return x, state
        return x

    def compute_mask(self, inputs, mask=None, **kwargs):
        if kwargs.get("return_state"):
            return (mask, None)
        return mask

    def compute_output_shape(self, inputs_shape):
        return inputs_shape

    # -------------------------------------------------------- recurrent API
    def get_initial_state(self, batch_size):
        """Empty state of the block's attention (`LinearAttention.state_spec`), e.g. ``(S, z)`` zeros."""
        if not self.built:
            raise ValueError(
                f"{type(self).__name__} must be built (called once or `build(shape)`) before "
                f"`get_initial_state`. Received: batch_size={batch_size!r} on an unbuilt layer."
            )
        return self._self_attention.get_initial_state(batch_size)

    def step(self, inputs_t, state, training=None):
        """One step of the block in its recurrent form.

        Args:
            inputs_t: ``[B, dim]`` the input token's hidden vector.
            state: the attention's state (`LinearAttention.state_spec`, e.g.
                ``(S [B, H, C, M], z [B, H, C])``) from `get_initial_state`, a
                previous `step`, or ``call(..., return_state=True)``.
            training: Python boolean (dropout).

        Returns:
            ``(outputs_t [B, dim], new_state)``.
        """
        if len(inputs_t.shape) != 2:
            raise ValueError(
                f"`inputs_t` must have rank 2 [batch, dim]. Received: inputs_t.shape={tuple(inputs_t.shape)}"
            )
        if not self.built:
            self.build((None, None, inputs_t.shape[-1]))
        if inputs_t.shape[-1] is not None and inputs_t.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"`inputs_t` must have last dim {self.hidden_dim}. Received: inputs_t.shape={tuple(inputs_t.shape)}"
            )
        h = _step_norm(self._attention_norm, inputs_t)  # [B, dim]
        attended, new_state = self._self_attention.step(h, h, state, training=training)  # [B, dim]
        attended = self._post_norm(self._attention_post_norm, attended, step=True)  # [B, dim]
        x = self._residual(inputs_t, attended, training, norm=lambda v: _step_norm(self._ffn_norm, v), step=True)
        return x, new_state

    # ----------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "feature_map": self.attention_spec.feature_map,
                "chunk_size": self.chunk_size,
                "dropout": self.dropout,
                "activation": _serialize_activation(self.activation),
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "use_bias": self.use_bias,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer),
                "seed": self.seed,
                "normalization": self.normalization,
                "feedforward": self.feedforward,
                **self.attention_spec.mechanism_config(),
            }
        )
        if self.attention_spec.epsilon != AttentionSpec.epsilon:
            config["epsilon"] = self.attention_spec.epsilon
        if self.post_norms:  # only then: configs without them are unchanged
            config["post_norms"] = True
        if self.parallel_residual:
            config["parallel_residual"] = True
        if self.moe is not None:
            config["moe"] = dict(self.moe)
        return config
