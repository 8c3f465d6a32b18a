"""`ProjectedAttention`, the base class of the attention layers: projections, masks, output, and one hook.

`LinearAttention` and `EfficientAttention` both derive from
`ProjectedAttention`: they take `keras.layers.MultiHeadAttention`'s
arguments, check and store them here, and project like it (same kernel
shapes ``[dim, H, D]`` and ``[H, M, dim]``), so weights can be copied
between the three. As in `MultiHeadAttention`, everything between the
inputs and the projected heads and between the attended heads and the
output lives here; a subclass overrides `_compute_attention` and nothing
else on the call path (it may extend `build` for weights of its own).

Shapes: B batch, T query length, S key length, H heads, D key dim, M value dim.
"""

import keras
from keras import ops

from keras_linattn import _compat, _validation
from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers import _quantized_projection

# The projection arguments every attention layer takes, documented once.
PROJECTION_ARGS_DOC = """\
        dropout: dropout rate applied to the per-head attention output before
            the output projection (there is no attention matrix to drop
            from). Keyword-only.
        use_bias: whether the query/key/value/output projections have
            biases. Keyword-only.
        output_shape: size of the last output dim; defaults to the query's.
            Keyword-only.
        kernel_initializer, bias_initializer, kernel_regularizer,
        bias_regularizer, activity_regularizer, kernel_constraint,
        bias_constraint: as in `keras.layers.MultiHeadAttention`.
            Keyword-only."""


document = fill(projection_args=PROJECTION_ARGS_DOC)

# Two sizes for the unknown dims of a symbolic call traced on JAX (any two that
# differ; every unknown dim takes the same one, as Keras' own trace does).
_TRACE_SIZES = (83, 89)


def _has_unknown_dims(structure):
    tensors = [x for x in keras.tree.flatten(structure) if isinstance(x, keras.KerasTensor)]
    return any(d is None for x in tensors for d in x.shape)


def _with_unknown_dims_as(structure, size):
    """``structure`` with every `keras.KerasTensor`'s unknown dims set to ``size``."""

    def known(x):
        if not isinstance(x, keras.KerasTensor):
            return x
        shape = tuple(size if d is None else d for d in x.shape)
        return keras.KerasTensor(shape, x.dtype, sparse=x.sparse, name=x.name)

    return keras.tree.map_structure(known, structure)


def _merge_specs(first, second):
    """One output spec from the traces at two sizes: the dims that differ are unknown."""
    if not isinstance(first, keras.KerasTensor):
        return first
    shape = tuple(a if a == b else None for a, b in zip(first.shape, second.shape, strict=True))
    return keras.KerasTensor(shape, first.dtype, sparse=first.sparse)


def _project_token(dense, x):
    """``dense`` at one token (``x`` without the time axis): its `step_call` where it has one."""
    step_call = getattr(dense, "step_call", None)
    if step_call is not None:
        return step_call(x)
    return ops.squeeze(dense(ops.expand_dims(x, 1)), axis=1)


def _check_output_shape(output_shape):
    if output_shape is None:
        return None
    if isinstance(output_shape, (list, tuple)):
        if len(output_shape) != 1:
            raise ValueError(f"`output_shape` must be an int or a 1-tuple. Received: output_shape={output_shape!r}")
        output_shape = output_shape[0]
    _validation.check_positive_int("output_shape", output_shape)
    return output_shape


# The projections' equations that `_ProjectionDense.step_call` writes as one 2-D product.
_STEP_FORMS = {"btd,dhk->bthk": "input", "bthk,hkd->btd": "output"}


class _ProjectionDense(keras.layers.EinsumDense):
    """An `EinsumDense` that consumes the Keras mask of its input.

    The attention layer reads the inputs' Keras masks itself (as key
    padding, and the query's for the output); the projected heads carry no
    mask, and the projection does not warn that it drops one.
    """

    def compute_mask(self, inputs, previous_mask=None):
        return None

    # LoRA (`keras_linattn.linearization.enable_lora`). Keras' `EinsumDense`
    # writes a LoRA kernel merged (``W + (alpha / r) A B``) and, loading,
    # zeroes A and B: the adapters and the frozen W are lost, and the zeroed
    # adapters can no longer train (both gradients are 0). A projection whose
    # adapters the model's config records (`lora_in_config`, set by
    # `enable_lora` inside a `LinearBackbone`) writes W, the bias, A and B as
    # they are; one whose config cannot record them refuses to be saved.
    # `lora_save_merged` (set by `merge_lora` while it copies the weights)
    # writes Keras' merged layout.
    lora_in_config = False
    lora_save_merged = False

    def save_own_variables(self, store):
        if not self.lora_enabled or self.quantization_mode is not None or self.lora_save_merged:
            return super().save_own_variables(store)
        if not self.lora_in_config:
            raise ValueError(
                f"The projection {self.path!r} has LoRA adapters, which this model's config does not record: "
                "a saved file would hold the merged kernel and lose the adapters, their rank and alpha and the "
                "frozen weights. Merge first: `merged = keras_linattn.linearization.merge_lora(model)`, then save "
                "`merged`; or linearize a keras-hub teacher (a `LinearCausalLM`), whose files keep the adapters."
            )
        store["0"] = _compat.unmerged_kernel(self)
        if self.bias is not None:
            store["1"] = self.bias
        store["lora_kernel_a"] = self.lora_kernel_a
        store["lora_kernel_b"] = self.lora_kernel_b

    def quantize(self, mode=None, type_check=True, config=None):
        """Quantizes the kernel with Keras' `EinsumDense.quantize` (``"int8"``, ``"int4"``, ...).

        Keras' `EinsumDense.quantize` refuses subclasses (their calls may
        differ); this one's call is `EinsumDense`'s, so its machinery applies
        as it is: per-output-channel scales over the kernel's contracted axes
        (``d`` of ``[dim, H, D]``, ``h, k`` of ``[H, M, dim]``), inputs
        quantized per token, LoRA adapters kept in float beside the
        quantized kernel.

        Args:
            mode: a Keras quantization mode (``keras.quantizers``).
            type_check: Keras' subclass check; not applied here.
            config: optional `keras.quantizers.QuantizationConfig`.
        """
        del type_check
        super().quantize(mode, type_check=False, config=config)

    def _int8_call(self, inputs, training=None):
        # Keras' int8 call with the product as one 2-D int8 x int8 -> int32 matmul (`_quantized_projection`).
        form = _STEP_FORMS.get(self.equation)
        if form is None or not self.inputs_quantizer:
            return super()._int8_call(inputs, training=training)
        return _quantized_projection.int8_call(self, inputs, form)

    def step_call(self, x):
        """This projection at one token, without the time axis.

        ``[B, dim] -> [B, heads, size]`` for the input projections
        (``btd,dhk->bthk``) and ``[B, heads, size] -> [B, dim]`` for the output
        one (``bthk,hkd->btd``): the same einsum at ``T = 1``, written as one
        matrix product of the kernel seen as 2-D (LoRA included: `kernel`
        merges it) plus the bias. In an ONNX step that is a `Gemm` and a
        `Reshape` where the einsum over ``[B, 1, ...]`` lowers to five nodes
        (the time axis added and dropped, the einsum's own reshapes). Any
        other equation, a quantized kernel or an activation goes through the
        layer itself.
        """
        form = _STEP_FORMS.get(self.equation)
        plain = self.quantization_mode is None and self.activation in (None, keras.activations.linear)
        if form is None or not plain:
            return ops.squeeze(self(ops.expand_dims(x, 1)), axis=1)
        # The layer's own name scope, as its call has: profiles and graphs name these ops after it.
        with keras.name_scope(self.name):
            return self._step_product(x, form)

    def _step_product(self, x, form):
        dtype = self.compute_dtype
        kernel = ops.cast(self.kernel, dtype)
        x = ops.cast(x, dtype)
        if form == "input":
            dim, heads, size = kernel.shape
            y = ops.matmul(x, ops.reshape(kernel, (dim, heads * size)))  # [B, heads * size]
            if self.bias is not None:
                y = y + ops.reshape(ops.cast(self.bias, dtype), (heads * size,))
            return ops.reshape(y, (-1, heads, size))  # [B, heads, size]
        heads, size, dim = kernel.shape
        y = ops.matmul(ops.reshape(x, (-1, heads * size)), ops.reshape(kernel, (heads * size, dim)))  # [B, dim]
        if self.bias is not None:
            y = y + ops.cast(self.bias, dtype)
        return y

    def load_own_variables(self, store):
        if "lora_kernel_a" in store.keys():
            if not self.lora_enabled or self.quantization_mode is not None:
                raise ValueError(
                    f"The weights of {self.path!r} hold LoRA adapters but the layer has none: load them into a "
                    "model with the same adapters (`keras_linattn.linearization.enable_lora`)."
                )
            _compat.unmerged_kernel(self).assign(store["0"])
            if self.bias is not None:
                self.bias.assign(store["1"])
            self.lora_kernel_a.assign(store["lora_kernel_a"])
            self.lora_kernel_b.assign(store["lora_kernel_b"])
            return
        if not self.lora_enabled or self.quantization_mode is not None:
            return super().load_own_variables(store)
        # A merged kernel into a LoRA layer: Keras zeroes A and B, which then
        # never train; keep A (B = 0 keeps the merged function).
        a = ops.convert_to_numpy(self.lora_kernel_a)
        super().load_own_variables(store)
        self.lora_kernel_a.assign(a)


class ProjectedAttention(CheckpointTracked, keras.layers.Layer):
    """Base of the attention layers: MultiHeadAttention's arguments, projections and call.

    Checks and stores `num_heads`, `key_dim`, `value_dim`, `dropout`,
    `use_bias`, `output_shape`, the initializers, regularizers and
    constraints of the projections and `seed`, and serializes them
    (`get_config`). `build` builds ``{query,key,value,output}_dense``.
    `call` checks the inputs, resolves the key padding (`key_mask`, else the
    Keras mask of `key`, else of `value`), projects to heads, hands them to
    `_compute_attention`, casts its result to the compute dtype, applies
    dropout and the output projection, and gives the output the query's
    Keras mask. Not registered and not meant to be used directly.

    Subclasses override `_compute_attention` (see its contract) and, for
    weights of their own, extend `build`.
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        *,
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
        _validation.check_positive_int("num_heads", num_heads)
        _validation.check_positive_int("key_dim", key_dim)
        if value_dim is not None:
            _validation.check_positive_int("value_dim", value_dim)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
        if not isinstance(use_bias, bool):
            raise ValueError(f"`use_bias` must be a bool. Received: use_bias={use_bias!r}")
        seed = _validation.check_seed("seed", seed)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim if value_dim is not None else key_dim
        self.dropout = dropout
        self.use_bias = use_bias
        self.output_shape_ = _check_output_shape(output_shape)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed
        self._dropout_layer = keras.layers.Dropout(dropout, seed=seed)

    def resolve_keys(self, value, key, value_mask, key_mask, attention_mask, alternatives):
        """The call's keys and key mask: `key` defaults to `value`, `key_mask` to `value_mask`.

        Raises the ValueError for an `attention_mask` (which this layer can't
        apply), naming what to use instead (`alternatives`).
        """
        if attention_mask is not None:
            raise ValueError(
                f"{type(self).__name__} does not support an arbitrary `attention_mask`: a "
                "full [B, T, S] mask cannot be applied without forming the T x S attention "
                f"matrix, which this layer never does. Use {alternatives}. "
                f"Received: attention_mask with shape {tuple(attention_mask.shape)}"
            )
        return (value if key is None else key), (value_mask if key_mask is None else key_mask)

    @staticmethod
    def _fresh(initializer):
        """A copy of `initializer` for one weight: an initializer instance reuses its seed."""
        return initializer.__class__.from_config(initializer.get_config())

    def _einsum_dense(self, equation, output_shape, bias_axes, name):
        kernel_init = self._fresh(self.kernel_initializer)
        bias_init = self._fresh(self.bias_initializer)
        return _ProjectionDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if self.use_bias else None,
            kernel_initializer=kernel_init,
            bias_initializer=bias_init,
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
            name=name,
        )

    # ------------------------------------------------------------------ build
    def _check_shapes(self, query_shape, value_shape, key_shape):
        for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 [batch, length, dim]. Received: {name}.shape={tuple(shape)}"
                )
        if value_shape[1] is not None and key_shape[1] is not None and value_shape[1] != key_shape[1]:
            raise ValueError(
                "`key` and `value` must have the same length. "
                f"Received: key.shape={tuple(key_shape)}, value.shape={tuple(value_shape)}"
            )

    def build(self, query_shape, value_shape, key_shape=None):
        """Builds ``self.{query,key,value,output}_dense``.

        Subclasses with weights of their own extend this (``super().build(...)``
        first).

        Raises:
            ValueError: for inputs that are not rank 3 or keys and values of
                different lengths.
        """
        key_shape = value_shape if key_shape is None else key_shape
        self._check_shapes(query_shape, value_shape, key_shape)
        self._input_dims = {"query": query_shape[-1], "value": value_shape[-1], "key": key_shape[-1]}
        h, d, m = self.num_heads, self.key_dim, self.value_dim
        out_dim = self.output_shape_ or query_shape[-1]
        kv = self.key_value_heads
        self.query_dense = self._einsum_dense("btd,dhk->bthk", (None, h, d), "hk", "query")
        self.query_dense.build(query_shape)
        self.key_dense = self._einsum_dense("btd,dhk->bthk", (None, kv, d), "hk", "key")
        self.key_dense.build(key_shape)
        self.value_dense = self._einsum_dense("btd,dhk->bthk", (None, kv, m), "hk", "value")
        self.value_dense.build(value_shape)
        self.output_dense = self._einsum_dense("bthk,hkd->btd", (None, out_dim), "d", "attention_output")
        self.output_dense.build((query_shape[0], query_shape[1], h, m))

    # ------------------------------------------------------------------- call
    def check_call_inputs(self, query, value, key):
        """Ranks, and last dims against those the projections were built for."""
        for name, x in (("query", query), ("value", value), ("key", key)):
            if len(x.shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3 [batch, length, dim]. Received: {name}.shape={tuple(x.shape)}"
                )
            built = getattr(self, "_input_dims", {}).get(name)
            if built is not None and x.shape[-1] is not None and x.shape[-1] != built:
                raise ValueError(
                    f"{type(self).__name__} was built for `{name}` of last dim {built}. "
                    f"Received: {name}.shape={tuple(x.shape)}"
                )

    # Grouped-query attention: None (every head has its own keys and values)
    # or a divisor of `num_heads`; set by subclasses that take the argument.
    num_key_value_heads = None

    @property
    def key_value_heads(self):
        """The number of key/value heads: `num_key_value_heads`, else `num_heads`."""
        return self.num_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def project(self, query, value, key=None):
        """Per-head projections.

        Returns ``(q [B, T, H, D], k [B, S, H, D], v [B, S, H, M])``, what
        `_compute_attention` receives; used by attention distillation and by
        anyone who wants to inspect the attention this layer computes. With
        grouped-query attention the ``G = H / kv_heads`` query heads of a
        group share one key/value head: k and v are repeated ``G`` times on
        the head axis (head h reads key/value head ``h // G``, as keras-hub's
        Llama does).
        """
        if key is None:
            key = value
        q = self.query_dense(query)  # [B, T, H, D]
        k = self.key_dense(key)  # [B, S, kv, D]
        v = self.value_dense(value)  # [B, S, kv, M]
        groups = self.num_heads // self.key_value_heads
        if groups > 1:
            k = ops.repeat(k, groups, axis=2)  # [B, S, H, D]
            v = ops.repeat(v, groups, axis=2)  # [B, S, H, M]
        return q, k, v

    def project_step(self, query_t, value_t, key_t):
        """`project` at one token, without the time axis.

        ``query_t [B, dim]``, ``value_t``, ``key_t [B, dim]`` ->
        ``(q [B, H, D], k [B, H, D], v [B, H, M])``, the same values as
        `project` on ``[B, 1, dim]`` (grouped heads repeated the same way),
        through each projection's `step_call` (fewer ops per decoding step).
        """
        q, k, v = (
            _project_token(dense, x)
            for dense, x in ((self.query_dense, query_t), (self.key_dense, key_t), (self.value_dense, value_t))
        )
        groups = self.num_heads // self.key_value_heads
        if groups > 1:
            k = ops.repeat(k, groups, axis=1)  # [B, H, D]
            v = ops.repeat(v, groups, axis=1)  # [B, H, M]
        return q, k, v

    def project_output_step(self, attended_t, training):
        """`project_output` at one token: ``[B, H, M] -> [B, out_dim]``."""
        attended_t = self._dropout_layer(attended_t, training=training)  # [B, H, M]
        return _project_token(self.output_dense, attended_t)

    def project_output(self, attended, training):
        """Dropout, then the output projection: ``[B, T, H, M] -> [B, T, out_dim]``."""
        attended = self._dropout_layer(attended, training=training)  # [B, T, H, M]
        return self.output_dense(attended)  # [B, T, out_dim]

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
        return_state=False,
        initial_state=None,
        return_attention_scores=False,
    ):
        _validation.refuse_attention_scores(return_attention_scores)
        key, key_mask = self.resolve_keys(
            value,
            key,
            value_mask,
            key_mask,
            attention_mask,
            "`key_mask` ([B, S]) for padding (and `use_causal_mask=True` for causal attention, "
            "where the layer supports it)",
        )
        self.check_call_inputs(query, value, key)
        _validation.check_same_batch((("query", query), ("value", value), ("key", key)))
        t, s = query.shape[1], key.shape[1]  # T, S when static
        if use_causal_mask and t is not None and s is not None and t != s:
            raise ValueError(
                "`use_causal_mask=True` needs query and key of the same length. "
                f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
            )
        if key_mask is not None:
            _validation.check_rank("key_mask", key_mask, 2)
            if key_mask.shape[1] is not None and key.shape[1] is not None and key_mask.shape[1] != key.shape[1]:
                raise ValueError(
                    "`key_mask` must have shape [B, S] matching the keys. "
                    f"Received: key_mask.shape={tuple(key_mask.shape)}, key length S={key.shape[1]}"
                )
            key_mask = ops.cast(key_mask, "bool")  # [B, S]
        q, k, v = self.project(query, value, key)  # [B, T, H, D], [B, S, H, D], [B, S, H, M]
        attended, state = self._compute_attention(
            q,
            k,
            v,
            key_mask=key_mask,
            use_causal_mask=use_causal_mask,
            training=training,
            initial_state=initial_state,
        )  # [B, T, H, M], state or None
        output = self.project_output(ops.cast(attended, self.compute_dtype), training)  # [B, T, out_dim]
        if not return_state:
            return output
        if state is None:
            raise ValueError(f"{type(self).__name__} keeps no state to return. Received: return_state={return_state!r}")
        return output, state

    def _compute_attention(
        self, query, key, value, key_mask=None, use_causal_mask=False, training=None, initial_state=None
    ):
        """The attention between the projections: the one method a subclass overrides.

        Args:
            query: projected queries ``[B, T, H, D]``, in the compute dtype.
            key: projected keys ``[B, S, H, D]``, in the compute dtype. Padded
                keys are as projected (possibly junk): mask them.
            value: projected values ``[B, S, H, M]``, in the compute dtype,
                likewise unmasked.
            key_mask: None, or a boolean ``[B, S]`` (True = real key) already
                checked against S: the `key_mask` argument, else the Keras
                mask of `key`, else of `value`. Zero what belongs to padded
                keys with `keras_linattn.ops._common._mask_keys` (`where`, so
                NaN/Inf junk cannot leak).
            use_causal_mask: whether query i may attend to keys ``0..i`` only
                (``S == T`` was checked where the lengths are static). An
                attention that cannot be causal raises ``ValueError``.
            training: Python boolean or None, for training-only behaviour.
            initial_state: None, or the state a previous call returned, to
                continue from. An attention without state raises
                ``ValueError`` for a state.

        Returns:
            ``(attended, state)``: ``attended [B, T, H, M]`` in any float
            dtype (the caller casts it to the compute dtype before dropout
            and the output projection); ``state`` the attention's state after
            these keys, or None if it keeps none (then ``return_state=True``
            raises ``ValueError``). It is computed whether or not the caller
            asked for it (unused, it is pruned from compiled graphs).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `_compute_attention`.")

    def compute_mask(self, query, previous_mask=None):
        """The output's Keras mask: the query's (keys' masks are consumed as padding)."""
        return previous_mask

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        """``[B, T, output_shape or query dim]``: the shape of `call`'s output (without state)."""
        key_shape = value_shape if key_shape is None else key_shape
        self._check_shapes(query_shape, value_shape, key_shape)
        return tuple(query_shape[:-1]) + (self.output_shape_ or query_shape[-1],)

    def compute_output_spec(self, *args, **kwargs):
        # Symbolic calls trace `call`, as Keras does for a layer without
        # `compute_output_shape` (`Layer.compute_output_spec` would switch to
        # `compute_output_shape`, which knows neither the state of
        # ``return_state=True`` nor the call's argument checks). Skipping
        # `Layer` in the MRO reaches `Operation.compute_output_spec`: that trace.
        trace = super(keras.layers.Layer, self).compute_output_spec
        if keras.backend.backend() != "jax" or not _has_unknown_dims((args, kwargs)):
            return trace(*args, **kwargs)
        # JAX traces an unknown length as one symbolic dimension, and the
        # chunked forms' reshapes cannot be proven divisible for it ("Cannot
        # divide evenly"). Trace at two concrete sizes instead: the output dims
        # that differ between them are the unknown ones.
        first = trace(*_with_unknown_dims_as(args, _TRACE_SIZES[0]), **_with_unknown_dims_as(kwargs, _TRACE_SIZES[0]))
        second = trace(*_with_unknown_dims_as(args, _TRACE_SIZES[1]), **_with_unknown_dims_as(kwargs, _TRACE_SIZES[1]))
        return keras.tree.map_structure(_merge_specs, first, second)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "output_shape": self.output_shape_,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
            "activity_regularizer": keras.regularizers.serialize(self.activity_regularizer),
            "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
            "bias_constraint": keras.constraints.serialize(self.bias_constraint),
            "seed": self.seed,
        }
