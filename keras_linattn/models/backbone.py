"""LinearBackbone: embeddings, causal linear-attention blocks and the final norm, with a decode state."""

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_linattn import _compat, _validation
from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers.spec import MECHANISM_ARGS_DOC, AttentionSpec
from keras_linattn.layers.transformer import _make_norm
from keras_linattn.layers.transformer_decoder import LinearTransformerDecoder
from keras_linattn.models import _presets, generation

__all__ = ["LinearBackbone"]


def _is_concrete(x):
    """True for a tensor with values (eager), False inside a traced function."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and not _compat.is_tf_symbolic_tensor(x)
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


def _max_or_none(x):
    """The largest entry of a concrete tensor (None when empty), for error messages."""
    return int(ops.max(x)) if int(ops.size(x)) else None


def _unpack_inputs(inputs, padding_mask=None):
    """``(token_ids, padding_mask)`` from a tensor (and `padding_mask`) or keras-hub's dict.

    Raises:
        ValueError: for a dict without ``"token_ids"``, a dict given with a
            separate `padding_mask`, or a tuple/list (ambiguous: fit's
            ``(x, y)``).
    """
    if isinstance(inputs, dict):
        unknown = set(inputs) - {"token_ids", "padding_mask"}
        if "token_ids" not in inputs or unknown:
            raise ValueError(
                'Inputs given as a dict must be {"token_ids": [B, T], "padding_mask": [B, T] (optional)}. '
                f"Received: keys={sorted(inputs)}"
            )
        if padding_mask is not None:
            raise ValueError("Pass `padding_mask` inside the inputs dict or as an argument, not both.")
        return inputs["token_ids"], inputs.get("padding_mask")
    if isinstance(inputs, (list, tuple)):
        raise ValueError(
            'Inputs must be token ids [B, T] or a dict {"token_ids", "padding_mask"}; a tuple is ambiguous '
            f"(fit reads (x, y) from it). Received: a {type(inputs).__name__} of {len(inputs)} items"
        )
    return inputs, padding_mask


def _nan_where(bad, x):
    """`x` (``[B, T, d]`` or ``[B, d]``), NaN at the tokens marked in `bad` (``[B, T]``/``[B]``; None: unchanged)."""
    if bad is None:
        return x
    # A scalar NaN: tf2onnx lowers a where between two full tensors to x * c + y * (1 - c),
    # where NaN * 0 poisons every row.
    return ops.where(bad[..., None], ops.cast(float("nan"), x.dtype), x)


def _block_seed(seed, index):
    """The seed of block `index`'s feature map, derived from the template's `seed`.

    Block 0 keeps `seed` (a one-block model is the template); block ``i > 0``
    gets a hash of ``(seed, i)`` (NumPy's `SeedSequence`), below 2**30 so
    that seeds derived from it (per head, per weight) stay in int32. Seeds
    ``seed + i`` would give block 1 of seed s the matrix of block 0 of seed
    s + 1.
    """
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0]) % (2**30)


def _block_spec(spec, index):
    """Block `index`'s spec: the backbone's, with a seeded feature map's seed replaced by `_block_seed`.

    Without it every block of a seeded LM drew the same random projection
    (favor+, favor_trig) or the same initial weights (trainable maps), and
    `RedrawRandomFeatures` redrew them equal.
    """
    feature_map = spec.make_feature_map()
    seed = None if feature_map is None else feature_map.seed
    if feature_map is None or seed is None or index == 0:
        return spec
    config = dict(feature_map.get_config(), seed=_block_seed(seed, index))
    return spec.replace(feature_map=type(feature_map).from_config(config))


def _check_sizes(vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim, key_dim, max_sequence_length):
    """Raises ValueError for a size that is not a positive int, or a width the heads do not divide."""
    for name, value in (
        ("vocabulary_size", vocabulary_size),
        ("num_layers", num_layers),
        ("hidden_dim", hidden_dim),
        ("num_heads", num_heads),
        ("intermediate_dim", intermediate_dim),
    ):
        _validation.check_positive_int(name, value)
    if max_sequence_length is not None:
        _validation.check_positive_int("max_sequence_length", max_sequence_length)
    if key_dim is not None:
        _validation.check_positive_int("key_dim", key_dim)
    elif hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads` when `key_dim` is None. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )


class _DecoderStack(CheckpointTracked, keras.layers.Layer):
    """The layers and the decode state of `LinearBackbone` (see its docstring), as one Keras layer.

    `LinearBackbone` is a functional keras-hub model over this layer; the
    embeddings, blocks, final norm and every state method live here.
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        hidden_dim,
        num_heads,
        intermediate_dim,
        feature_map="elu",
        key_dim=None,
        chunk_size=64,
        dropout=0.0,
        max_sequence_length=None,
        tie_embeddings=True,
        activation="gelu",
        layer_norm_epsilon=1e-5,
        normalization="layer_norm",
        feedforward="dense",
        use_bias=True,
        lora=None,
        *,
        spec=None,
        **kwargs,
    ):
        spec = AttentionSpec.pop(
            kwargs,
            feature_map,
            spec=spec,
            chunk_size=chunk_size,
            epsilon=kwargs.pop("epsilon", AttentionSpec.epsilon),
        )
        super().__init__(**kwargs)
        self.attention_spec = spec
        _check_sizes(vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim, key_dim, max_sequence_length)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        spec.check_heads(num_heads, key_dim if key_dim is not None else hidden_dim // num_heads)
        self.key_dim = key_dim
        self.chunk_size = spec.chunk_size
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.tie_embeddings = tie_embeddings
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.normalization = normalization
        self.feedforward = feedforward
        self.use_bias = use_bias

        self._make_layers()
        self.build(None)
        # LoRA adapters (`keras_linattn.linearization.enable_lora` sets these
        # and `get_config` records them, so that saved copies keep them).
        self.lora_rank = self.lora_alpha = None
        if lora is not None:
            from keras_linattn.linearization import lora as lora_lib

            lora_lib._restore_lora(self, lora)

    def _make_layers(self):
        """The embeddings, the blocks (each with its spec) and the final norm, from the settings."""
        self.token_embedding = keras.layers.ReversibleEmbedding(
            self.vocabulary_size,
            self.hidden_dim,
            tie_weights=self.tie_embeddings,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = None
        if self.max_sequence_length is not None:
            self.position_embedding = keras.layers.Embedding(
                self.max_sequence_length,
                self.hidden_dim,
                embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
                dtype=self.dtype_policy,
                name="position_embedding",
            )
        self.decoder_blocks = [
            LinearTransformerDecoder(
                num_heads=self.num_heads,
                intermediate_dim=self.intermediate_dim,
                key_dim=self.key_dim,
                spec=_block_spec(self.attention_spec, i),
                dropout=self.dropout,
                activation=self.activation,
                layer_norm_epsilon=self.layer_norm_epsilon,
                normalization=self.normalization,
                feedforward=self.feedforward,
                use_bias=self.use_bias,
                dtype=self.dtype_policy,
                name=f"decoder_block_{i}",
            )
            for i in range(self.num_layers)
        ]
        self.final_norm = _make_norm(self.normalization, self.layer_norm_epsilon, self.dtype_policy, "final_layer_norm")

    def build(self, input_shape=None, padding_mask_shape=None):
        # Built in __init__ (the input shape never changes the weights); a
        # second build, e.g. `model.build((None, None))`, is a no-op.
        if self.built:
            return
        seq_shape = (None, None, self.hidden_dim)
        self.token_embedding.build((None, None))
        if self.position_embedding is not None:
            self.position_embedding.build((None, None))
        for block in self.decoder_blocks:
            block.build(seq_shape)
        self.final_norm.build(seq_shape)
        self.built = True

    def compute_output_shape(self, inputs_shape, padding_mask_shape=None):
        # Declared, so that building the functional `LinearBackbone` does not
        # trace `call` (JAX cannot compare symbolic lengths with the chunk size).
        return tuple(inputs_shape) + (self.hidden_dim,)

    # ------------------------------------------------------------ helpers
    def _check_token_ids(self, token_ids, name, rank):
        token_ids = ops.convert_to_tensor(token_ids)
        if len(token_ids.shape) != rank:
            shape = "[batch, length]" if rank == 2 else "[batch]"
            raise ValueError(f"`{name}` must have shape {shape}. Received: {name}.shape={tuple(token_ids.shape)}")
        if "int" not in str(token_ids.dtype):
            raise ValueError(f"`{name}` must be integer token ids. Received: {name}.dtype={token_ids.dtype}")
        if _is_concrete(token_ids) and int(ops.size(token_ids)) > 0:
            # Concrete ids are checked (a negative id would silently wrap around
            # in the embedding lookup); inside a traced graph (fit, XLA) they
            # can't be without a per-step assertion.
            low, high = int(ops.min(token_ids)), int(ops.max(token_ids))
            if low < 0 or high >= self.vocabulary_size:
                raise ValueError(f"`{name}` must be in [0, {self.vocabulary_size}). Received: min={low}, max={high}")
        elif not _is_concrete(token_ids):
            # Traced (fit, predict, SavedModel): a run-time assertion before the lookup.
            ok = ops.logical_and(ops.all(token_ids >= 0), ops.all(token_ids < self.vocabulary_size))
            token_ids = _validation.graph_assert(token_ids, ok, f"`{name}` must be in [0, {self.vocabulary_size})")
        if rank == 2 and token_ids.shape[1] is not None and self.max_sequence_length is not None:
            if token_ids.shape[1] > self.max_sequence_length:
                raise ValueError(
                    f"`{name}` is longer than max_sequence_length={self.max_sequence_length}. "
                    f"Received: {name}.shape={tuple(token_ids.shape)}"
                )
        return token_ids

    def _past_limit(self, token_ids, last_index, name, received):
        """The rule "a row holds at most `max_sequence_length` tokens", and what graphs do instead.

        `last_index` is the index each token would have in its row (the
        state's position plus its index in the piece; padding counts):
        ``[B, T]`` or ``[B]``. Concrete values raise here (`received`, a
        function, gives the message's values). In a traced graph the rule is
        a run-time assertion (`_validation.graph_assert`), and the tokens
        that break it or have an id outside the vocabulary are marked: their
        outputs (and so the task's logits) are NaN, which is what graphs without assertions (XLA, ONNX)
        return.

        Returns:
            ``(token_ids, bad)``: the ids (behind the assertion in graphs),
            and None (concrete inputs) or the ``[B, T]`` / ``[B]`` bool mark.
        """
        limit = self.max_sequence_length
        if _is_concrete(last_index):
            if limit is not None and int(ops.size(last_index)) and int(ops.max(last_index)) >= limit:
                raise ValueError(
                    f"`{name}` runs past max_sequence_length={limit}: a row would hold "
                    f"{int(ops.max(last_index)) + 1} tokens. Received: {received()}"
                )
            return token_ids, None
        bad = ops.logical_or(token_ids < 0, token_ids >= self.vocabulary_size)
        if limit is not None:
            past = last_index >= limit
            token_ids = _validation.graph_assert(
                token_ids, ops.logical_not(ops.any(past)), f"`{name}` runs past max_sequence_length={limit}"
            )
            bad = ops.logical_or(bad, past)
        return token_ids, bad

    def _embed(self, token_ids, positions):
        x = self.token_embedding(token_ids)  # [B, T, dim] or [B, dim]
        if self.position_embedding is not None:
            positions = ops.clip(positions, 0, self.max_sequence_length - 1)
            x = x + self.position_embedding(positions)  # [B, T, dim] or [B, dim]
        return x

    def _hidden(self, x, bad):
        """The final norm, then NaN at the tokens marked in `bad` (see `_past_limit`)."""
        return _nan_where(bad, self.final_norm(x))  # [..., dim]

    def _positions(self, token_ids, padding_mask, start):
        """Position of each token: real tokens before it (start [B] + prefix count)."""
        if padding_mask is None:
            length = ops.shape(token_ids)[1]
            offsets = ops.arange(length, dtype="int32")[None, :]  # [1, T]
            count = ops.zeros_like(start) + length
        else:
            mask = ops.cast(ops.cast(padding_mask, "bool"), "int32")  # [B, T], nonzero = real
            offsets = ops.cumsum(mask, axis=1) - mask  # [B, T]
            count = ops.sum(mask, axis=1)  # [B]
        return start[:, None] + offsets, start + count  # [B, T], [B]

    def _check_padding_mask(self, padding_mask, token_ids):
        if padding_mask is None:
            return None
        padding_mask = ops.convert_to_tensor(padding_mask)
        static_match = all(
            a is None or b is None or a == b for a, b in zip(padding_mask.shape, token_ids.shape, strict=True)
        )
        if len(padding_mask.shape) != 2 or not static_match:
            raise ValueError(
                "`padding_mask` must have the shape of the token ids [batch, length]. "
                f"Received: padding_mask.shape={tuple(padding_mask.shape)}, "
                f"token_ids.shape={tuple(token_ids.shape)}"
            )
        return padding_mask

    def state_spec(self):
        """The decode state, described once: a list of `generation.StateSpec`.

        Per block, its attention's `LinearAttention.state_spec` with names
        prefixed by the block's (``<block>/S [H, C, M]``, ``<block>/z [H, C]``
        for plain linear attention), then ``position []`` (int32). Shapes
        exclude the batch dim.
        """
        spec = []
        for block in self.decoder_blocks:
            for entry in block.attention.state_spec():
                spec.append(entry._replace(name=f"{block.name}/{entry.name}"))
        spec.append(generation.StateSpec("position", (), "int32"))
        return spec

    def block_states(self, state):
        """Splits a flat decode state into one tuple per block (the position, last, is left out)."""
        states, offset = [], 0
        for block in self.decoder_blocks:
            n = len(block.attention.state_spec())
            states.append(tuple(state[offset : offset + n]))
            offset += n
        return states

    def check_state(self, state, batch_size=None, name="state"):
        """Raises ValueError (naming `name`) unless `state` matches `state_spec`."""
        generation.check_state(self.state_spec(), state, batch_size=batch_size, name=name)

    # ----------------------------------------------------------- parallel
    def call(self, inputs, padding_mask=None, training=None):
        token_ids, padding_mask = _unpack_inputs(inputs, padding_mask)
        hidden, _ = self._forward(token_ids, padding_mask, None, training, return_state=False)
        return hidden

    def _forward(self, token_ids, padding_mask, state, training, return_state):
        token_ids = self._check_token_ids(token_ids, "token_ids", 2)
        padding_mask = self._check_padding_mask(padding_mask, token_ids)
        batch = ops.shape(token_ids)[0]
        start = ops.zeros((batch,), "int32") if state is None else ops.cast(state[-1], "int32")
        last_index = start[:, None] + ops.arange(ops.shape(token_ids)[1], dtype="int32")[None, :]  # [B, T]
        token_ids, bad = self._past_limit(
            token_ids,
            last_index,
            "token_ids",
            lambda: f"state position={_max_or_none(start)}, token_ids.shape={tuple(token_ids.shape)}",
        )
        positions, end = self._positions(token_ids, padding_mask, start)
        x = self._embed(token_ids, positions)  # [B, T, dim]
        new_state = []
        block_states = [None] * len(self.decoder_blocks) if state is None else self.block_states(state)
        for block, layer_state in zip(self.decoder_blocks, block_states, strict=True):
            if return_state:
                x, layer_state = block(
                    x,
                    padding_mask=padding_mask,
                    training=training,
                    return_state=True,
                    initial_state=layer_state,
                )  # [B, T, dim]
                new_state += list(layer_state)
            else:
                x = block(x, padding_mask=padding_mask, training=training)  # [B, T, dim]
        if return_state:
            new_state.append(end)
        return self._hidden(x, bad), new_state

    def call_with_state(self, token_ids, state, padding_mask=None, training=None):
        """Runs a piece of a sequence in parallel, continuing from `state`.

        Args:
            token_ids: ``[B, T]`` int token ids.
            state: from `get_initial_state`, `step` or a previous call.
            padding_mask: optional ``[B, T]`` (1 = real token).

        Returns:
            ``(hidden [B, T, dim], new_state)``. Splitting a sequence in pieces
            and chaining the states gives the outputs of one pass.
        """
        batch_size = token_ids.shape[0] if hasattr(token_ids, "shape") else None
        self.check_state(state, batch_size=batch_size)
        return self._forward(token_ids, padding_mask, list(state), training, return_state=True)

    # ---------------------------------------------------------- recurrent
    def get_initial_state(self, batch_size):
        """Empty state (`state_spec`): zeros for every block's attention state and a zero int32 position."""
        return generation.zeros_state(self.state_spec(), batch_size)

    def step(self, token_t, state, training=None):
        """One decoding step in recurrent form (constant time and memory).

        Args:
            token_t: ``[B]`` int token ids.
            state: from `get_initial_state`, `call_with_state` or `step`.

        Returns:
            ``(hidden_t [B, dim], new_state)``.
        """
        token_t = self._check_token_ids(token_t, "token_t", 1)
        self.check_state(state, batch_size=token_t.shape[0])
        position = ops.cast(state[-1], "int32")  # [B]
        token_t, bad = self._past_limit(
            token_t, position, "token_t", lambda: f"state position (state[-1])={_max_or_none(position)}"
        )
        x = self._embed(token_t, position)  # [B, dim]
        new_state = []
        for block, layer_state in zip(self.decoder_blocks, self.block_states(state), strict=True):
            x, layer_state = block.step(x, layer_state, training=training)  # [B, dim]
            new_state += list(layer_state)
        new_state.append(position + 1)
        return self._hidden(x, bad), new_state

    # ------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "num_layers": self.num_layers,
                "hidden_dim": self.hidden_dim,
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "feature_map": self.attention_spec.feature_map,
                "key_dim": self.key_dim,
                "chunk_size": self.chunk_size,
                "dropout": self.dropout,
                "max_sequence_length": self.max_sequence_length,
                "tie_embeddings": self.tie_embeddings,
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "normalization": self.normalization,
                "feedforward": self.feedforward,
                "use_bias": self.use_bias,
                **self.attention_spec.mechanism_config(),
            }
        )
        if self.attention_spec.epsilon != AttentionSpec.epsilon:
            config["epsilon"] = self.attention_spec.epsilon
        from keras_linattn.linearization import lora as lora_lib

        lora = lora_lib._lora_config(self)
        if lora is not None:  # only then: configs without adapters are unchanged
            config["lora"] = lora
        return config


# The constructor settings a backbone (and its task) exposes as attributes.
BACKBONE_SETTINGS = (
    "vocabulary_size", "num_layers", "hidden_dim", "num_heads", "intermediate_dim", "key_dim", "chunk_size",
    "dropout", "max_sequence_length", "tie_embeddings", "activation", "layer_norm_epsilon", "normalization",
    "feedforward", "use_bias", "attention_spec",
)  # fmt: skip


def _layout_patterns(model, data):
    """``{path regex: axes}`` of `LinearBackbone.get_layout_map` (mesh axis names `model`, `data`).

    Each regex starts with ``.*``: `LayoutMap` matches with `re.fullmatch`,
    and a backbone's paths start with its stack's name (``decoder_stack/``).
    """
    block = r".*decoder_block_\d+"
    return {
        r".*token_embedding/embeddings": (model, data),
        r".*token_embedding/reverse_embeddings": (data, model),
        r".*position_embedding/embeddings": (None, data),
        block + r"/self_attention/(query|key|value)/kernel": (data, model, None),
        block + r"/self_attention/attention_output/kernel": (model, None, data),
        block + r"/feedforward_(intermediate|gate)_dense/kernel": (data, model),
        block + r"/feedforward_output_dense/kernel": (model, data),
    }


@keras.saving.register_keras_serializable(package="keras_linattn")
@fill(mechanism_args=MECHANISM_ARGS_DOC)
class LinearBackbone(keras_hub.models.Backbone):
    """Embeddings, `num_layers` causal linear-attention blocks and a final norm: the trunk of `LinearCausalLM`.

        token embedding (+ optional learned positions) -> `num_layers` x
        `LinearTransformerDecoder` -> final LayerNorm -> hidden states. A
        keras-hub `Backbone`: `save_to_preset` / `from_preset` work on local
        directories, and a task (`LinearCausalLM`, or any head of yours) is
        built on top of it. Training runs the chunkwise-parallel causal path;
        `call_with_state` and `step` continue from a decode state of fixed size.

        The state is a flat list: each block's attention state in order
        (`LinearAttention.state_spec`; ``S [B, H, C, M]`` and ``z [B, H, C]``
        float32 for plain linear attention), then ``position [B]`` (int32), the
        number of real tokens consumed per row.
        `state_spec` describes it (names, shapes, dtypes); everything that
        decodes -- `LinearCausalLM.generate`, the exported signatures, the ONNX
        generator -- follows that one description and
        `keras_linattn.models.generation`.

        Positions: with ``max_sequence_length=None`` (default) there is no
        positional embedding. Causal linear attention is order-aware through its
        prefix sums (token t sees exactly the t + 1 tokens before and at it), so
        the model runs at any length, and left-padded prompts give exactly the
        outputs of unpadded ones. With an integer `max_sequence_length`, learned
        absolute position embeddings are added (position = number of real tokens
        before the token, carried in the state), and sequences may not be longer.

        Args:
            vocabulary_size: number of token ids V.
            num_layers: number of decoder blocks.
            hidden_dim: model width.
            num_heads: attention heads per block.
            intermediate_dim: feed-forward width.
            feature_map: feature-map name, config or `FeatureMap` (template; each
                block owns a copy). Default ``"elu"``. A seeded map (``seed=s``)
                gives block 0 seed s and block i a seed derived from (s, i): each
                block draws its own projection or weights, reproducibly.
            key_dim: per-head query/key size; defaults to ``hidden_dim // num_heads``.
            chunk_size: chunk length of the causal algorithm. Default 64.
            dropout: dropout rate inside the blocks.
            max_sequence_length: None, or the length of the learned position table
                (see Positions above).
            tie_embeddings: the task's output projection is the transposed token
                embedding (`token_embedding(x, reverse=True)`); False gives the
                embedding its own output matrix.
            activation: feed-forward activation. Default "gelu";
                ``"gelu_approximate"`` is GPT-2's tanh form.
            layer_norm_epsilon: epsilon of every norm.
            normalization: ``"layer_norm"`` (default) or ``"rms_norm"`` (Llama).
            feedforward: ``"dense"`` (default) or ``"gated"`` (SwiGLU with
                ``activation="silu"``, Llama).
            use_bias: biases in the dense layers and attention projections.
    {mechanism_args}
                Every block's attention gets them (their decode state joins
                `state_spec`; decoding stays constant-cost per token).
            **kwargs: `keras.Model` arguments (`name`, `dtype`).

        Call arguments:
            inputs: ``[B, T]`` int token ids, or keras-hub's dict
                ``{"token_ids": [B, T], "padding_mask": [B, T]}``.
            padding_mask: optional ``[B, T]`` (1 = real token), when `inputs`
                is a tensor. Padded tokens do not enter the attention state.
            training: Python boolean (dropout).

        Returns:
            ``[B, T, hidden_dim]`` hidden states (after the final norm).

        Example:

        >>> backbone = LinearBackbone(vocabulary_size=256, num_layers=2, hidden_dim=64,
        ...                           num_heads=4, intermediate_dim=128)
        >>> backbone({"token_ids": np.ones((2, 16), "int32"),
        ...           "padding_mask": np.ones((2, 16), "int32")}).shape
        TensorShape([2, 16, 64])
    """

    def __init__(self, vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim, **kwargs):
        model_kwargs = {key: kwargs.pop(key) for key in ("name", "trainable") if key in kwargs}
        dtype = kwargs.pop("dtype", None)
        stack = _DecoderStack(
            vocabulary_size,
            num_layers,
            hidden_dim,
            num_heads,
            intermediate_dim,
            dtype=dtype,
            name="decoder_stack",
            **kwargs,
        )
        token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        hidden = stack(token_ids, padding_mask=padding_mask)
        super().__init__(
            inputs={"token_ids": token_ids, "padding_mask": padding_mask}, outputs=hidden, dtype=dtype, **model_kwargs
        )
        self.stack = stack
        self.token_embedding = stack.token_embedding
        # The settings, as plain values (the layers are the stack's; see the properties below).
        for name in BACKBONE_SETTINGS:
            setattr(self, name, getattr(stack, name))
        # `call` takes token ids alone too (then `padding_mask=` is optional).
        self.input_spec = None

    def call(self, inputs, padding_mask=None, training=None):
        token_ids, padding_mask = _unpack_inputs(inputs, padding_mask)
        return self.stack(token_ids, padding_mask=padding_mask, training=training)

    # Presets: stale weight files removed and a sha256 manifest written at save, checked at load
    # (`keras_linattn.models._presets`).
    def save_to_preset(self, preset_dir, max_shard_size=10):
        with _presets.saving(preset_dir):
            super().save_to_preset(preset_dir, max_shard_size=max_shard_size)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        with _presets.loading(preset):
            return super().from_preset(preset, load_weights=load_weights, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        _presets.verify_weights_path(filepath)
        super().load_weights(filepath, *args, **kwargs)
        _presets.check_weights_consumed(self, filepath)

    @staticmethod
    def get_layout_map(device_mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"):
        """A `keras.distribution.LayoutMap` sharding the backbone's kernels, for `ModelParallel` (JAX).

        keras-hub's convention (`LlamaBackbone.get_layout_map`), with the
        Megatron split: attention is sharded by heads and the feed-forward
        by its intermediate units over the model axis, so each device
        computes whole heads; the other dimension of each kernel is sharded
        over the data axis (FSDP-style). Variable paths of this backbone
        (``decoder_stack/...``; the same inside a `LinearCausalLM`):

            token_embedding/embeddings            [V, d]      (model, data)
            token_embedding/reverse_embeddings    [d, V]      (data, model)   untied only
            position_embedding/embeddings         [L, d]      (None, data)    max_sequence_length only
            decoder_block_i/self_attention/
                query|key|value/kernel            [d, H, D]   (data, model, None)
                attention_output/kernel           [H, D, d]   (model, None, data)
            decoder_block_i/
                feedforward_intermediate_dense/kernel, feedforward_gate_dense/kernel
                                                  [d, F]      (data, model)
                feedforward_output_dense/kernel   [F, d]      (model, data)

        Everything else (biases, norms, feature-map and recurrence weights,
        LoRA factors) is replicated. `LayoutMap` matches a path with
        `re.fullmatch`, so each pattern starts with ``.*``. A sharded
        dimension must be divisible by the size of its mesh axis (e.g.
        `num_heads` and `intermediate_dim` by the model axis).

        Example (2 devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=2``):

        ```python
        mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), keras.distribution.list_devices())
        layout_map = LinearBackbone.get_layout_map(mesh)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        lm = LinearCausalLM(vocabulary_size=256, num_layers=2, hidden_dim=64, num_heads=4, intermediate_dim=128)
        ```

        Args:
            device_mesh: a `keras.distribution.DeviceMesh`.
            model_parallel_dim_name: the mesh axis the heads and feed-forward
                units are sharded over.
            data_parallel_dim_name: the mesh axis of the data (the batch).

        Returns:
            `keras.distribution.LayoutMap`.
        """
        if not isinstance(device_mesh, keras.distribution.DeviceMesh):
            raise ValueError(
                "`device_mesh` must be a `keras.distribution.DeviceMesh`. "
                f"Received: device_mesh={type(device_mesh).__name__}"
            )
        for arg, name in (
            ("model_parallel_dim_name", model_parallel_dim_name),
            ("data_parallel_dim_name", data_parallel_dim_name),
        ):
            if name not in device_mesh.axis_names:
                raise ValueError(
                    f"`{arg}` must be an axis of the device mesh {list(device_mesh.axis_names)}. "
                    f"Received: {arg}={name!r}"
                )
        model, data = model_parallel_dim_name, data_parallel_dim_name
        layout_map = keras.distribution.LayoutMap(device_mesh)
        for pattern, axes in _layout_patterns(model, data).items():
            layout_map[pattern] = axes
        return layout_map

    # ------------------------------------------------------- the layers
    @property
    def position_embedding(self):
        """The learned position table (`max_sequence_length`), or None."""
        return self.stack.position_embedding

    @property
    def decoder_blocks(self):
        """The `LinearTransformerDecoder` blocks, in order."""
        return self.stack.decoder_blocks

    @property
    def final_norm(self):
        """The norm after the last block."""
        return self.stack.final_norm

    # ------------------------------------------------------ decode state
    def state_spec(self):
        """The decode state, described once: a list of `generation.StateSpec`.

        Per block, its attention's `LinearAttention.state_spec` with names
        prefixed by the block's (``<block>/S [H, C, M]``, ``<block>/z [H, C]``
        for plain linear attention), then ``position []`` (int32). Shapes
        exclude the batch dim.
        """
        return self.stack.state_spec()

    def get_initial_state(self, batch_size):
        """Empty state (`state_spec`): zeros for every block's attention state and a zero int32 position."""
        return self.stack.get_initial_state(batch_size)

    def check_state(self, state, batch_size=None, name="state"):
        """Raises ValueError (naming `name` and the entry) unless `state` matches `state_spec`."""
        self.stack.check_state(state, batch_size=batch_size, name=name)

    def block_states(self, state):
        """Splits a flat decode state into one tuple per block (the position, last, is left out)."""
        return self.stack.block_states(state)

    def call_with_state(self, token_ids, state, padding_mask=None, training=None):
        """Runs a piece of a sequence in parallel, continuing from `state`.

        Args:
            token_ids: ``[B, T]`` int token ids.
            state: from `get_initial_state`, `step` or a previous call.
            padding_mask: optional ``[B, T]`` (1 = real token).

        Returns:
            ``(hidden [B, T, dim], new_state)``. Splitting a sequence in pieces
            and chaining the states gives the outputs of one pass.
        """
        return self.stack.call_with_state(token_ids, state, padding_mask=padding_mask, training=training)

    def step(self, token_t, state, training=None):
        """One decoding step in recurrent form (constant time and memory).

        Args:
            token_t: ``[B]`` int token ids.
            state: from `get_initial_state`, `call_with_state` or `step`.

        Returns:
            ``(hidden_t [B, dim], new_state)``.
        """
        return self.stack.step(token_t, state, training=training)

    def embed(self, token_ids, positions):
        """Token embeddings plus, with `max_sequence_length`, the learned positions (``[B, T, dim]``)."""
        return self.stack._embed(token_ids, positions)

    def get_config(self):
        config = super().get_config()
        stack_config = self.stack.get_config()
        for key in ("name", "trainable", "dtype"):
            stack_config.pop(key, None)
        config.update(stack_config)
        return config
