"""LinearCausalLM: a decoder-only language model with constant-memory generation."""

import keras
import numpy as np
from keras import ops

from keras_linattn import _validation
from keras_linattn import samplers as samplers_lib
from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers.linear_attention import _get_map, _serialize_map
from keras_linattn.layers.transformer_decoder import LinearTransformerDecoder
from keras_linattn.models import generation
from keras_linattn.recurrences.config import MECHANISM_ARGS_DOC, AttentionConfig

__all__ = ["LinearCausalLM"]


def _is_concrete(x):
    """True for a tensor with values (eager), False inside a traced function."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and not isinstance(x, tf.__internal__.SymbolicTensor)
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


def _max_or_none(x):
    """The largest entry of a concrete tensor (None when empty), for error messages."""
    return int(ops.max(x)) if int(ops.size(x)) else None


def _nan_where(bad, logits):
    """`logits` with NaN at the tokens marked in `bad` (``[B, T]`` or ``[B]``; None: unchanged)."""
    if bad is None:
        return logits
    # A scalar NaN: tf2onnx lowers a where between two full tensors to x * c + y * (1 - c),
    # where NaN * 0 poisons every row.
    return ops.where(bad[..., None], float("nan"), logits)


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


def _block_feature_map(feature_map, index):
    """Config of block `index`'s copy of the template `feature_map`: a seeded map gets `_block_seed`.

    Without it every block of a seeded LM drew the same random projection
    (favor+, favor_trig) or the same initial weights (trainable maps), and
    `RedrawRandomFeatures` redrew them equal.
    """
    seed = getattr(feature_map, "seed", None)
    if feature_map is None or seed is None or index == 0:
        return _serialize_map(feature_map)
    config = dict(feature_map.get_config(), seed=_block_seed(seed, index))
    return _serialize_map(type(feature_map).from_config(config))


class _FunctionCache:
    """Holds compiled functions out of Keras' attribute tracking."""

    def __init__(self):
        self.functions = {}


@keras.saving.register_keras_serializable(package="keras_linattn")
@fill(mechanism_args=MECHANISM_ARGS_DOC)
class LinearCausalLM(CheckpointTracked, keras.Model):
    """Decoder-only language model of causal linear-attention blocks.

        token embedding (+ optional learned positions) -> `num_layers` x
        `LinearTransformerDecoder` -> final LayerNorm -> logits (the transposed
        token embedding when `tie_embeddings`). Training runs the chunkwise-
        parallel causal path; generation prefills the prompt with that path and
        then decodes token by token with the blocks' recurrent `step`, whose
        state has a fixed size: decoding time and memory per token do not grow
        with the context.

        The state is a flat list: each block's attention state in order
        (`LinearAttention.state_spec`; ``S [B, H, C, M]`` and ``z [B, H, C]``
        float32 for plain linear attention), then ``position [B]`` (int32), the
        number of real tokens consumed per row.
        `state_spec` describes it (names, shapes, dtypes); everything that
        decodes -- `generate`, the exported signatures, the ONNX generator --
        follows that one description and `keras_linattn.models.generation`.

        Positions: with ``max_sequence_length=None`` (default) there is no
        positional embedding. Causal linear attention is order-aware through its
        prefix sums (token t sees exactly the t + 1 tokens before and at it), so
        the model runs at any length, and left-padded prompts give exactly the
        logits of unpadded ones. With an integer `max_sequence_length`, learned
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
            tie_embeddings: use the transposed token embedding as output projection.
            activation: feed-forward activation. Default "gelu".
            layer_norm_epsilon: epsilon of every layer norm.
    {mechanism_args}
                Every block's attention gets them (their decode state joins
                `state_spec`; decoding stays constant-cost per token).
            **kwargs: `keras.Model` arguments (`name`, `dtype`).

        Call arguments:
            token_ids: ``[B, T]`` int token ids.
            padding_mask: optional ``[B, T]`` (1 = real token). Padded tokens do
                not enter the attention state (use left padding for prompts).
            training: Python boolean (dropout).

        Returns:
            ``[B, T, V]`` float32 logits.

        Example:

        >>> lm = LinearCausalLM(vocabulary_size=256, num_layers=2, hidden_dim=64,
        ...                     num_heads=4, intermediate_dim=128)
        >>> logits = lm(np.zeros((2, 16), "int32"))                  # [2, 16, 256]
        >>> out = lm.generate(np.ones((2, 4), "int32"), max_length=20)  # [2, 20]
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
        **kwargs,
    ):
        attention_config = AttentionConfig.pop(kwargs, feature_map=feature_map)
        super().__init__(**kwargs)
        self.attention_config = attention_config
        for name, value in (
            ("vocabulary_size", vocabulary_size),
            ("num_layers", num_layers),
            ("hidden_dim", hidden_dim),
            ("num_heads", num_heads),
            ("intermediate_dim", intermediate_dim),
            ("chunk_size", chunk_size),
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
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        # A template (each attention layer owns a copy with the weights): kept
        # out of Keras' layer tracking so it is not listed as an unbuilt sublayer.
        object.__setattr__(self, "feature_map", _get_map(feature_map))
        attention_config.check_heads(num_heads, key_dim if key_dim is not None else hidden_dim // num_heads)
        self.key_dim = key_dim
        self.chunk_size = chunk_size
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.tie_embeddings = tie_embeddings
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon

        self.token_embedding = keras.layers.ReversibleEmbedding(
            vocabulary_size,
            hidden_dim,
            tie_weights=tie_embeddings,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype=self.dtype_policy,
            name="token_embedding",
        )
        self.position_embedding = None
        if max_sequence_length is not None:
            self.position_embedding = keras.layers.Embedding(
                max_sequence_length,
                hidden_dim,
                embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
                dtype=self.dtype_policy,
                name="position_embedding",
            )
        self.decoder_blocks = [
            LinearTransformerDecoder(
                num_heads=num_heads,
                intermediate_dim=intermediate_dim,
                key_dim=key_dim,
                feature_map=_block_feature_map(self.feature_map, i),
                chunk_size=chunk_size,
                dropout=dropout,
                activation=activation,
                layer_norm_epsilon=layer_norm_epsilon,
                **self.attention_config.get_config(),
                dtype=self.dtype_policy,
                name=f"decoder_block_{i}",
            )
            for i in range(num_layers)
        ]
        self.final_norm = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, dtype=self.dtype_policy, name="final_layer_norm"
        )
        self._generation = _FunctionCache()
        self.build(None)

    def build(self, input_shape=None):
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
        logits are NaN, which is what graphs without assertions (XLA, ONNX)
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

    def _logits(self, x):
        x = self.final_norm(x)  # [..., dim]
        return ops.cast(self.token_embedding(x, reverse=True), "float32")  # [..., V]

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

    def _block_states(self, state):
        """Splits a flat LM state into one tuple per block (the position, last, is left out)."""
        states, offset = [], 0
        for block in self.decoder_blocks:
            n = len(block.attention.state_spec())
            states.append(tuple(state[offset : offset + n]))
            offset += n
        return states

    def _check_state(self, state, batch_size=None, name="state"):
        """Raises ValueError (naming `name`) unless `state` matches `state_spec`."""
        generation.check_state(self.state_spec(), state, batch_size=batch_size, name=name)

    # ----------------------------------------------------------- parallel
    def call(self, token_ids, padding_mask=None, training=None):
        logits, _ = self._forward(token_ids, padding_mask, None, training, return_state=False)
        return logits

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
        block_states = [None] * len(self.decoder_blocks) if state is None else self._block_states(state)
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
        return _nan_where(bad, self._logits(x)), new_state

    def call_with_state(self, token_ids, state, padding_mask=None, training=None):
        """Runs a piece of a sequence in parallel, continuing from `state`.

        Args:
            token_ids: ``[B, T]`` int token ids.
            state: from `get_initial_state`, `step` or a previous call.
            padding_mask: optional ``[B, T]`` (1 = real token).

        Returns:
            ``(logits [B, T, V], new_state)``. Splitting a sequence in pieces
            and chaining the states gives the logits of one pass.
        """
        token_ids = self._check_token_ids(token_ids, "token_ids", 2)
        self._check_state(state, batch_size=token_ids.shape[0])
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
            ``(logits_t [B, V] float32, new_state)``.
        """
        token_t = self._check_token_ids(token_t, "token_t", 1)
        self._check_state(state, batch_size=token_t.shape[0])
        position = ops.cast(state[-1], "int32")  # [B]
        token_t, bad = self._past_limit(
            token_t, position, "token_t", lambda: f"state position (state[-1])={_max_or_none(position)}"
        )
        x = self._embed(token_t, position)  # [B, dim]
        new_state = []
        for block, layer_state in zip(self.decoder_blocks, self._block_states(state), strict=True):
            x, layer_state = block.step(x, layer_state, training=training)  # [B, dim]
            new_state += list(layer_state)
        new_state.append(position + 1)
        return _nan_where(bad, self._logits(x)), new_state

    # --------------------------------------------------------- generation
    def compile(self, *args, sampler="greedy", **kwargs):
        """`keras.Model.compile`, plus the default `sampler` of `generate` (as in keras-hub)."""
        super().compile(*args, **kwargs)
        self._sampler = samplers_lib.get(sampler)

    def _compile(self, fn):
        """XLA on TensorFlow; plain calls elsewhere (the loop is a `keras.ops.while_loop`)."""
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            return tf.function(fn, jit_compile=True, reduce_retracing=True, autograph=False)
        return fn

    def make_generate_function(self, sampler, stop_token_ids=None, pad_token_id=0):
        """The compiled ``(prefill, decode)`` pair for one sampler, cached.

        As in keras-hub: `generate` calls this and then the returned
        functions. ``prefill(prompt_ids, padding_mask, state)`` returns the
        last position's logits and the state; ``decode(tokens, logits,
        state, finished, index, end, seed)`` runs
        `generation.decode_loop`.
        """
        key = (repr(sampler), type(sampler).__name__, stop_token_ids, pad_token_id)
        cached = self._generation.functions.get(key)
        if cached is not None:
            return cached
        prefill = self._generation.functions.get("prefill")
        if prefill is None:
            prefill = self._compile(lambda ids, mask, state: generation.prefill(self, ids, mask, state))
            self._generation.functions["prefill"] = prefill
        stop = None if not stop_token_ids else ops.convert_to_tensor(list(stop_token_ids), "int32")

        def decode(tokens, logits, state, finished, index, end, seed):
            return generation.decode_loop(
                self, sampler, tokens, logits, state, finished, index, end, seed, stop, pad_token_id
            )

        cached = (prefill, self._compile(decode))
        self._generation.functions[key] = cached
        return cached

    def generate(
        self,
        prompt_ids,
        max_length,
        sampler=None,
        seed=None,
        stop_token_ids=None,
        padding_mask=None,
        pad_token_id=0,
        verbose=False,
        block_size=None,
    ):
        """Generates tokens after a prompt: parallel prefill, then recurrent decoding.

        The prompt runs through the chunked parallel path (`call_with_state`,
        XLA-compiled); each new token then costs one `step` inside an
        XLA-compiled ``while_loop`` (compiled once per shape and sampler and
        cached), with a state whose size does not depend on the length.

        Args:
            prompt_ids: ``[B, P]`` int token ids, ``P >= 1``. Prompts of
                different lengths in one batch must be left-padded and given
                a `padding_mask`.
            max_length: total length of the output, prompt included (>= P).
            sampler: a `keras_linattn.samplers` name or `Sampler`; default: the
                sampler given to `compile(sampler=...)`, else ``"greedy"``.
            seed: int seed of random samplers (None: a fresh random seed).
            stop_token_ids: optional ids that end a row; once a row emits one,
                its later positions are `pad_token_id`. Generation stops early
                when every row has finished.
            padding_mask: optional ``[B, P]``, 1 for real prompt tokens; each
                row must be left-padded (zeros, then ones) with >= 1 real token.
            pad_token_id: id written after a row's stop token.
            verbose: show a progress bar (decoding then runs in blocks).
            block_size: tokens decoded per compiled call; default: all at once
                (32 when `verbose`).

        Returns:
            ``[B, max_length]`` int32 numpy array of token ids.
        """
        prompt, mask, max_length = generation.check_generate_arguments(
            prompt_ids, max_length, padding_mask, self.vocabulary_size, self.max_sequence_length
        )
        batch, prompt_length = prompt.shape
        if stop_token_ids is not None:
            stop_token_ids = tuple(int(t) for t in np.atleast_1d(stop_token_ids))
        if sampler is None:
            sampler = getattr(self, "_sampler", None) or "greedy"
        sampler = samplers_lib.get(sampler)
        if block_size is None:
            block_size = 32 if verbose else max(max_length - prompt_length, 1)
        block_size = _validation.check_positive_int("block_size", block_size)
        seed = _validation.check_seed("seed", seed)
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        seed_t = ops.convert_to_tensor([int(seed) % (2**31 - 1), 0], "int32")

        tokens_np = np.full((batch, max_length), pad_token_id, dtype="int32")
        tokens_np[:, :prompt_length] = prompt
        if max_length == prompt_length:
            return tokens_np
        prefill, decode = self.make_generate_function(sampler, stop_token_ids, int(pad_token_id))
        state = self.get_initial_state(batch)
        prompt_t = ops.convert_to_tensor(prompt, "int32")
        mask_t = ops.ones_like(prompt_t, "bool") if mask is None else ops.convert_to_tensor(mask)
        logits, state = prefill(prompt_t, mask_t, state)  # [B, V]
        tokens = ops.convert_to_tensor(tokens_np)
        finished = ops.zeros((batch,), "bool")
        index = prompt_length
        progbar = keras.utils.Progbar(max_length - prompt_length) if verbose else None
        while index < max_length:
            end = min(index + block_size, max_length)
            tokens, logits, state, finished, new_index = decode(
                tokens,
                logits,
                state,
                finished,
                ops.convert_to_tensor(index, "int32"),
                ops.convert_to_tensor(end, "int32"),
                seed_t,
            )
            new_index = int(new_index)
            if progbar is not None:
                progbar.update(new_index - prompt_length)
            if new_index < end:  # every row finished
                if progbar is not None:
                    progbar.update(max_length - prompt_length, finalize=True)
                break
            index = new_index
        return np.asarray(ops.convert_to_numpy(tokens))

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
                "feature_map": _serialize_map(self.feature_map),
                "key_dim": self.key_dim,
                "chunk_size": self.chunk_size,
                "dropout": self.dropout,
                "max_sequence_length": self.max_sequence_length,
                "tie_embeddings": self.tie_embeddings,
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                **self.attention_config.get_config(),
            }
        )
        return config
