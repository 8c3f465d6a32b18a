"""LinearCausalLM: a decoder-only language model with constant-memory generation, in keras-hub's shape."""

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_linattn import _compat, _sampler_settings, _validation, generation
from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers._mechanism_doc import MECHANISM_ARGS_DOC
from keras_linattn.models import _compile_config, _generate_compile, _presets, _protocol
from keras_linattn.models._sampler_bridge import BUILT_IN_SAMPLERS, HubSampler, get_sampler, is_hub_sampler
from keras_linattn.models._tokens import _unpack_inputs
from keras_linattn.models.backbone import BACKBONE_SETTINGS, UPGRADE_HINT, LinearBackbone
from keras_linattn.models.preprocessor import LinearCausalLMPreprocessor

__all__ = ["LinearCausalLM"]

# `LinearCausalLM._symbolic_build` overrides this Keras hook: fail at import if Keras renamed it.
_compat.check_symbolic_build_hook()


def _is_text(inputs):
    """True for a string prompt, a list of them, or a string array/tensor."""
    if isinstance(inputs, (str, bytes)):
        return True
    if isinstance(inputs, (list, tuple)):
        return len(inputs) > 0 and all(isinstance(x, (str, bytes)) for x in inputs)
    dtype = getattr(inputs, "dtype", None)
    return dtype is not None and (str(dtype) in ("string", "<dtype: 'string'>") or np.dtype(dtype).kind in "OUS")


@keras.saving.register_keras_serializable(package="keras_linattn")
@fill(mechanism_args=MECHANISM_ARGS_DOC)
class LinearCausalLM(CheckpointTracked, _protocol.CausalLMProtocol, keras_hub.models.CausalLM):
    """Decoder-only language model of causal linear-attention blocks, in keras-hub's shape.

        A `LinearBackbone` (embeddings, blocks, final norm) with the language
        model head (the transposed token embedding when `tie_embeddings`), an
        optional `LinearCausalLMPreprocessor` for string inputs, and
        `generate`. Training runs the chunkwise-parallel causal path;
        generation prefills the prompt with that path and then decodes token by
        token with the blocks' recurrent `step`, whose state has a fixed size:
        decoding time and memory per token do not grow with the context.

        It is a keras-hub `CausalLM`: `compile(sampler=...)` takes a
        `keras_linattn.samplers` name or sampler or a keras-hub sampler,
        `save_to_preset(dir)` writes a preset that
        `keras_hub.models.CausalLM.from_preset(dir)` loads back as a
        `LinearCausalLM`, and `fit` takes ``{"token_ids", "padding_mask"}``
        dicts (or strings, through the preprocessor).

        Two ways to build one:

        - ``LinearCausalLM(backbone, preprocessor=None)``, as in keras-hub;
        - ``LinearCausalLM(vocabulary_size=..., num_layers=..., ...)``: the
          `LinearBackbone` arguments, by keyword (the backbone is built
          for you).

        The decode state (`state_spec`, `get_initial_state`, `call_with_state`,
        `step`) is the backbone's; everything that decodes -- `generate`, the
        exported signatures, the ONNX generator -- follows it and
        `keras_linattn.generation`. keras-hub's own `CausalLM.generate` runs
        on it too (`generate_step`, with the decode state as keras-hub's
        cache: `_build_cache`, `call_with_cache`), and `score` is
        keras-hub's (`keras_linattn.models._protocol`).

        Args:
            backbone: a `LinearBackbone` (None: built from `**kwargs`).
            preprocessor: a `LinearCausalLMPreprocessor` or None (inputs are
                token ids).
            **kwargs: with `backbone`, `keras.Model` arguments (`name`);
                without it, the `LinearBackbone` arguments:
                `vocabulary_size`, `num_layers`, `hidden_dim`, `num_heads`,
                `intermediate_dim`, `feature_map`, `key_dim`, `chunk_size`,
                `dropout`, `max_sequence_length`, `tie_embeddings`,
                `activation`, `layer_norm_epsilon`, `dtype`, and
    {mechanism_args}

        Call arguments:
            inputs: ``[B, T]`` int token ids, or ``{"token_ids": [B, T],
                "padding_mask": [B, T]}``.
            padding_mask: optional ``[B, T]`` (1 = real token), when `inputs`
                is a tensor. Padded tokens do not enter the attention state
                (use left padding for prompts).
            training: Python boolean (dropout).

        Returns:
            ``[B, T, V]`` float32 logits.

        Example:

        >>> lm = LinearCausalLM(vocabulary_size=256, num_layers=2, hidden_dim=64,
        ...                     num_heads=4, intermediate_dim=128)
        >>> logits = lm(np.zeros((2, 16), "int32"))                  # [2, 16, 256]
        >>> out = lm.generate(np.ones((2, 4), "int32"), max_length=20)  # [2, 20]
    """

    backbone_cls = LinearBackbone
    preprocessor_cls = LinearCausalLMPreprocessor

    def __init__(self, backbone=None, preprocessor=None, *, compile=True, **kwargs):
        if backbone is None:
            model_kwargs = {key: kwargs.pop(key) for key in ("name", "trainable") if key in kwargs}
            backbone = LinearBackbone(**kwargs)
            kwargs = model_kwargs
        elif not isinstance(backbone, LinearBackbone):
            raise ValueError(
                f"`backbone` must be a `LinearBackbone`. Received: backbone={type(backbone).__name__}; "
                "convert a softmax model with `keras_linattn.linearize`."
            )
        elif set(kwargs) - {"name", "trainable", "dtype"}:
            raise ValueError(
                "With a `backbone`, the model arguments live in the backbone; pass only `name`. "
                f"Received: {sorted(set(kwargs) - {'name', 'trainable', 'dtype'})}"
            )
        kwargs.pop("dtype", None)  # the backbone's policy is the task's (keras-hub's Task sets it)
        if preprocessor is not None and not isinstance(preprocessor, keras_hub.models.CausalLMPreprocessor):
            raise ValueError(
                "`preprocessor` must be a keras-hub `CausalLMPreprocessor` (e.g. `LinearCausalLMPreprocessor`) "
                f"or None. Received: preprocessor={type(preprocessor).__name__}"
            )
        self.backbone = backbone
        self.preprocessor = preprocessor
        inputs = backbone.input
        hidden = backbone(inputs)
        logits = backbone.token_embedding(hidden, reverse=True)
        # float32 logits under any dtype policy (mixed precision).
        logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
        super().__init__(inputs=inputs, outputs=logits, compile=compile, **kwargs)
        self.input_spec = None  # `call` takes token ids alone too (then `padding_mask=` is optional)
        # The backbone's settings, as plain values (`lm.num_layers`, `lm.attention_spec`, ...).
        for name in BACKBONE_SETTINGS:
            setattr(self, name, getattr(backbone, name))
        self._generation = _generate_compile.FunctionCache()
        # XLA or a plain tf.function for `generate` (`_generate_compile.generate_uses_xla`): True, False or "auto".
        self.generate_jit_compile = "auto"

    # ------------------------------------------------------- the layers
    @property
    def position_embedding(self):
        """The backbone's learned position table, or None."""
        return self.backbone.position_embedding

    @property
    def decoder_blocks(self):
        """The backbone's `LinearTransformerDecoder` blocks, in order."""
        return self.backbone.decoder_blocks

    @property
    def final_norm(self):
        """The backbone's final norm."""
        return self.backbone.final_norm

    @property
    def token_embedding(self):
        return self.backbone.token_embedding

    # Presets: stale weight files removed and a sha256 manifest written at save, checked at load
    # (`keras_linattn.models._presets`); the tokenizer must fit the embedding.
    @property
    def preprocessor(self):
        return getattr(self, "_preprocessor", None)

    @preprocessor.setter
    def preprocessor(self, value):
        _presets.check_tokenizer_fits(value, getattr(self, "backbone", None))
        self._preprocessor = value

    def save_to_preset(self, preset_dir, max_shard_size=10):
        with _presets.saving(preset_dir) as target:  # a staging copy, published whole
            super().save_to_preset(target, max_shard_size=max_shard_size)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        with _presets.loading(preset):
            task = super().from_preset(preset, load_weights=load_weights, **kwargs)
        if isinstance(task, LinearCausalLM):  # the tokenizer's vocabulary is loaded by now
            _presets.check_tokenizer_fits(task.preprocessor, task.backbone)
        return task

    # ----------------------------------------------------------- parallel
    def _head(self, hidden):
        return ops.cast(self.backbone.token_embedding(hidden, reverse=True), "float32")  # [..., V]

    def call(self, inputs, padding_mask=None, training=None):
        token_ids, padding_mask = _unpack_inputs(inputs, padding_mask)
        return self._head(self.backbone(token_ids, padding_mask=padding_mask, training=training))

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
        hidden, state = self.backbone.call_with_state(token_ids, state, padding_mask=padding_mask, training=training)
        return self._head(hidden), state

    # ---------------------------------------------------------- recurrent
    def last_logits_with_state(self, token_ids, state, padding_mask=None, training=None):
        """`call_with_state` that returns only the last position's logits: what a prefill needs.

        The vocabulary projection runs on the last position alone. Over a whole
        prompt it would cost ``P x V`` floats (8.4 GB for a 16k prompt at
        Llama 3's vocabulary of 128,256) and a matmul as large as a fifth of a
        1B model's prefill, for logits nobody reads.

        Returns:
            ``(logits [B, V] float32, new_state)``.
        """
        hidden, state = self.backbone.call_with_state(token_ids, state, padding_mask=padding_mask, training=training)
        return self._head(hidden[:, -1]), state

    def state_spec(self):
        """The decode state: `LinearBackbone.state_spec` (a list of `generation.StateSpec`)."""
        return self.backbone.state_spec()

    def get_initial_state(self, batch_size):
        """Empty state (`state_spec`): zeros for every block's attention state and a zero int32 position."""
        return self.backbone.get_initial_state(batch_size)

    def block_states(self, state):
        """Splits a flat decode state into one tuple per block (`LinearBackbone.block_states`)."""
        return self.backbone.block_states(state)

    def check_state(self, state, batch_size=None, name="state"):
        """Raises ValueError unless `state` matches `state_spec` (`LinearBackbone.check_state`)."""
        self.backbone.check_state(state, batch_size=batch_size, name=name)

    def step(self, token_t, state, training=None):
        """One decoding step in recurrent form (constant time and memory).

        Args:
            token_t: ``[B]`` int token ids.
            state: from `get_initial_state`, `call_with_state` or `step`.

        Returns:
            ``(logits_t [B, V] float32, new_state)``.
        """
        hidden, state = self.backbone.step(token_t, state, training=training)
        return self._head(hidden), state

    # ------------------------------------------------------------- LoRA
    def enable_lora(self, rank, target_layer_names=None, *, alpha=None):
        """`LinearBackbone.enable_lora` on the backbone (every weight of the model is the backbone's).

        Args:
            rank, target_layer_names, alpha: as `LinearBackbone.enable_lora`.

        Returns:
            The adapters' variables: the model's trainable variables.
        """
        return self.backbone.enable_lora(rank, target_layer_names, alpha=alpha)

    def merge_lora(self):
        """`LinearBackbone.merge_lora` on the backbone: the adapters folded into the kernels, in place."""
        self.backbone.merge_lora()

    # --------------------------------------------------------- compile
    def compile(self, optimizer="auto", loss="auto", *, weighted_metrics="auto", sampler="greedy", **kwargs):
        """`keras.Model.compile` with keras-hub's defaults, plus the default `sampler` of `generate`.

        Args:
            optimizer: ``"auto"`` is keras-hub's (Adam, learning rate 2e-5).
            loss: ``"auto"`` is sparse categorical cross-entropy on logits.
            weighted_metrics: ``"auto"`` is sparse categorical accuracy.
            sampler: a `keras_linattn.samplers` name, config or `Sampler`,
                or a keras-hub `Sampler` (``keras_hub.samplers.TopKSampler(k=5)``).
                Saved with the model (`.keras`), with the rest of the
                compile settings.
            **kwargs: `keras.Model.compile` arguments.
        """
        sampler = get_sampler(sampler)
        if is_hub_sampler(sampler):
            HubSampler(sampler)  # refuses search samplers now, not at the first generate
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam(2e-5)
        if loss == "auto":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if weighted_metrics == "auto":
            weighted_metrics = [keras.metrics.SparseCategoricalAccuracy()]
        keras.Model.compile(self, optimizer=optimizer, loss=loss, weighted_metrics=weighted_metrics, **kwargs)
        self.sampler = sampler
        self.generate_function = None

    def get_compile_config(self):
        """Keras' compile config, with the sampler and whether the optimizer had run (`_compile_config`)."""
        return _compile_config.compile_config(self, super().get_compile_config())

    def compile_from_config(self, config):
        """Restores `compile` (optimizer, loss, metrics and sampler) when a `.keras` file loads."""
        _compile_config.restore_compile(self, config)

    def _symbolic_build(self, iterator=None, data_batch=None):
        # Under a `tf.distribute` strategy the first batch arrives mean-reduced, token ids as floats: their
        # integer dtype is restored for this symbolic pass only (`_compile_config.integer_inputs` says why).
        if data_batch is not None and _compat.explicit_distribute_strategy(self) is not None:
            data_batch = _compile_config.integer_inputs(data_batch, self.input)
        return _compat.symbolic_build(super(), iterator=iterator, data_batch=data_batch)

    # --------------------------------------------------------- generation
    def _generate_functions(self, sampler=None, stop_token_ids=None, pad_token_id=0):
        """The compiled ``(prefill, decode)`` pair for one sampler, cached: the package's decoding fast path.

        ``prefill(prompt_ids, padding_mask, state)`` returns the last
        position's logits and the state (`generation.prefill`);
        ``decode(tokens, logits, state, finished, index, end, seed)`` runs
        `generation.decode_loop`. `generate` and `generate_step` run these.
        """
        if sampler is None:
            sampler = getattr(self, "sampler", None) or get_sampler("greedy")
        if is_hub_sampler(sampler):
            sampler = HubSampler(sampler)
        key = (repr(sampler), type(sampler).__name__, stop_token_ids, pad_token_id)
        cached = self._generation.functions.get(key)
        if cached is not None:
            return cached
        prefill = self._generation.functions.get("prefill")
        if prefill is None:
            prefill = _generate_compile.compile_function(
                self, lambda ids, mask, state: generation.prefill(self, ids, mask, state)
            )
            self._generation.functions["prefill"] = prefill
        stop = None if not stop_token_ids else ops.convert_to_tensor(list(stop_token_ids), "int32")

        def decode(tokens, logits, state, finished, index, end, seed):
            return generation.decode_loop(
                self, sampler, tokens, logits, state, finished, index, end, seed, stop, pad_token_id
            )

        cached = (prefill, _generate_compile.compile_function(self, decode))
        self._generation.functions[key] = cached
        return cached

    def generate(
        self,
        inputs,
        max_length=None,
        sampler=None,
        seed=None,
        stop_token_ids="auto",
        padding_mask=None,
        pad_token_id=None,
        verbose=False,
        block_size=None,
        strip_prompt=False,
    ):
        """Generates tokens after a prompt: parallel prefill, then recurrent decoding.

        The prompt runs through the chunked parallel path (`call_with_state`,
        XLA-compiled); each new token then costs one `step` inside an
        XLA-compiled ``while_loop`` (compiled once per shape and sampler and
        cached), with a state whose size does not depend on the length.

        Args:
            inputs: ``[B, P]`` int token ids (``P >= 1``; prompts of
                different lengths left-padded, with a `padding_mask`), a dict
                ``{"token_ids", "padding_mask"}``, or, with a `preprocessor`,
                a string or a list of strings.
            max_length: total length of the output, prompt included (>= P).
                Required for token ids; for strings, the default is the
                preprocessor's `sequence_length`.
            sampler: a `keras_linattn.samplers` name or `Sampler`, or a
                keras-hub sampler; default: the sampler given to
                `compile(sampler=...)`, else ``"greedy"``.
            seed: int seed of `keras_linattn.samplers` (None: a fresh random
                seed). keras-hub samplers use their own `seed`.
            stop_token_ids: ids that end a row; once a row emits one, its
                later positions are `pad_token_id`, and generation stops
                early when every row has finished. ``"auto"`` (default): the
                preprocessor tokenizer's end token, none without a
                preprocessor. None: never stop early.
            padding_mask: optional ``[B, P]``, 1 for real prompt tokens; each
                row must be left-padded (zeros, then ones) with >= 1 real token.
            pad_token_id: id written after a row's stop token (default: the
                tokenizer's pad id with a preprocessor, else 0); not -1,
                which marks positions without a token.
            verbose: show a progress bar (decoding then runs in blocks).
            block_size: tokens decoded per compiled call; default: all at once
                (32 when `verbose`).
            strip_prompt: string prompts only: return the completion alone.

        Returns:
            For token ids, a ``[B, max_length]`` int32 numpy array. For
            strings, the prompt and its completion as a string (one prompt)
            or a list of strings.

        Raises:
            generation.NonFiniteLogitsError: (a `FloatingPointError` and a
                `ValueError`) where the logits that predict a position hold
                a NaN or +inf or are all -inf (no token can be drawn: NaN
                weights, a kernel underflow, overflow); the message names
                the row and position. Nothing is returned in that case.
        """
        text = _is_text(inputs)
        if strip_prompt and not text:
            raise ValueError("`strip_prompt=True` applies to string prompts only; slice the token ids instead.")
        tokenizer = None if self.preprocessor is None else self.preprocessor.tokenizer
        if text:
            if self.preprocessor is None:
                raise ValueError(
                    "String prompts need a `preprocessor` (e.g. `LinearCausalLMPreprocessor(tokenizer)`). "
                    f"Received: inputs={inputs!r}"
                )
            if padding_mask is not None:
                raise ValueError("`padding_mask` is computed by the preprocessor for string prompts; leave it None.")
            single = isinstance(inputs, (str, bytes))
            if max_length is None:
                max_length = self.preprocessor.sequence_length
            packed = self.preprocessor.generate_preprocess([inputs] if single else list(inputs))
            inputs, padding_mask = packed["token_ids"], packed["padding_mask"]
            if np.shape(inputs)[1] > max_length:
                raise ValueError(
                    f"A prompt is {np.shape(inputs)[1]} tokens long, more than max_length={max_length}. "
                    f"Received: max_length={max_length}"
                )
        elif isinstance(inputs, dict):
            inputs, padding_mask = _unpack_inputs(inputs, padding_mask)
        if max_length is None:
            raise ValueError("`max_length` is required for token-id prompts.")
        if isinstance(stop_token_ids, str) and stop_token_ids == "auto":
            # A tokenizer without an end or pad token (keras-hub's ByteTokenizer): no stop, pad 0.
            end = getattr(tokenizer, "end_token_id", None)
            stop_token_ids = None if end is None else [end]
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None) or 0
        tokens = self._generate_ids(
            inputs, max_length, sampler, seed, stop_token_ids, padding_mask, pad_token_id, verbose, block_size
        )
        if not text:
            return tokens
        prompt_mask = np.asarray(padding_mask).astype(bool)
        mask = np.zeros(tokens.shape, bool)
        mask[:, : prompt_mask.shape[1]] = prompt_mask
        mask[:, prompt_mask.shape[1] :] = _protocol.generated_mask(tokens[:, prompt_mask.shape[1] :], stop_token_ids)
        if strip_prompt:
            mask[:, : prompt_mask.shape[1]] = False
        out = self.preprocessor.generate_postprocess({"token_ids": tokens, "padding_mask": mask})
        out = [x.decode("utf-8") if isinstance(x, bytes) else x for x in np.asarray(out).reshape(-1).tolist()]
        return out[0] if single else out

    def _generate_ids(
        self, prompt_ids, max_length, sampler, seed, stop_token_ids, padding_mask, pad_token_id, verbose, block_size
    ):
        prompt, mask, max_length = generation.check_generate_arguments(
            prompt_ids, max_length, padding_mask, self.vocabulary_size, self.max_sequence_length
        )
        batch, prompt_length = prompt.shape
        if stop_token_ids is not None:
            stop_token_ids = tuple(int(t) for t in np.atleast_1d(stop_token_ids))
        if int(pad_token_id) == generation.INVALID_TOKEN:
            raise ValueError(
                f"`pad_token_id` must not be {generation.INVALID_TOKEN}: generate marks positions without a token "
                f"(non-finite logits) with it. Received: pad_token_id={pad_token_id!r}"
            )
        if sampler is None:
            sampler = getattr(self, "sampler", None) or "greedy"
        sampler = get_sampler(sampler)
        if block_size is None:
            block_size = 32 if verbose else max(max_length - prompt_length, 1)
        block_size = _validation.check_positive_int("block_size", block_size)
        seed = _sampler_settings.check_seed(seed)  # the sampler settings' rule table: an int64 seed
        if seed is None:
            seed = int(np.random.randint(0, 2**31 - 1))
        seed_t = ops.convert_to_tensor([int(seed) % (2**31 - 1), 0], "int32")

        tokens_np = np.full((batch, max_length), pad_token_id, dtype="int32")
        tokens_np[:, :prompt_length] = prompt
        if max_length == prompt_length:
            return tokens_np
        prefill, decode = self._generate_functions(sampler, stop_token_ids, int(pad_token_id))
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
        custom = type(sampler) not in BUILT_IN_SAMPLERS
        return generation.check_output_tokens(np.asarray(ops.convert_to_numpy(tokens)), custom_sampler=custom)

    # ------------------------------------------------------------- config
    def get_config(self):
        return {
            "backbone": keras.layers.serialize(self.backbone),
            "preprocessor": keras.layers.serialize(self.preprocessor) if self.preprocessor is not None else None,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if "backbone" not in config:
            raise ValueError(
                f"This LinearCausalLM config has no backbone: it was written by keras_linattn 0.1; {UPGRADE_HINT}."
            )
        return super().from_config(config)
