"""LinearBackbone: embeddings, causal linear-attention blocks and the final norm, with a decode state."""

import keras
import keras_hub
from keras import ops

from keras_linattn import _validation, generation
from keras_linattn._docstrings import fill
from keras_linattn._tracking import CheckpointTracked
from keras_linattn.layers._mechanism_doc import MECHANISM_ARGS_DOC
from keras_linattn.layers.spec import AttentionSpec
from keras_linattn.layers.transformer import _make_norm, _step_norm
from keras_linattn.layers.transformer_decoder import LinearTransformerDecoder
from keras_linattn.models import _layout_map, _presets, _saving
from keras_linattn.models._block_config import (
    _check_layer_attention,
    _check_layer_moe,
    _check_sizes,
    _layer_spec,
)
from keras_linattn.models._lora import LoraBackbone
from keras_linattn.models._tokens import (
    _check_ids_form,
    _check_token_ids,
    _embed,
    _is_concrete,
    _MarkInvalid,
    _max_or_none,
    _nan_where,
    _past_limit,
    _prepare,
    _TokenCheck,
    _unpack_inputs,
)

__all__ = ["LinearBackbone"]


def _make_layers(settings, spec, dtype):
    """``(token_embedding, position_embedding or None, blocks, final_norm)`` of a backbone, built."""
    token_embedding = keras.layers.ReversibleEmbedding(
        settings["vocabulary_size"],
        settings["hidden_dim"],
        tie_weights=settings["tie_embeddings"],
        embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
        logit_soft_cap=settings.get("final_logit_soft_cap"),  # the head's (reverse=True) logits only
        dtype=dtype,
        name="token_embedding",
    )
    token_embedding.build((None, None))
    position_embedding = None
    if settings["max_sequence_length"] is not None:
        position_embedding = keras.layers.Embedding(
            settings["max_sequence_length"],
            settings["hidden_dim"],
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.02),
            dtype=dtype,
            name="position_embedding",
        )
        position_embedding.build((None, None))
    seq_shape = (None, None, settings["hidden_dim"])
    blocks = []
    for i in range(settings["num_layers"]):
        block = LinearTransformerDecoder(
            num_heads=settings["num_heads"],
            intermediate_dim=settings["intermediate_dim"],
            key_dim=settings["key_dim"],
            spec=_layer_spec(spec, i, settings.get("layer_attention")),
            dropout=settings["dropout"],
            activation=settings["activation"],
            layer_norm_epsilon=settings["layer_norm_epsilon"],
            normalization=settings["normalization"],
            feedforward=settings["feedforward"],
            use_bias=settings["use_bias"],
            post_norms=settings.get("post_norms", False),
            parallel_residual=settings.get("parallel_residual", False),
            moe=None if settings.get("moe") is None else settings["moe"][i],
            dtype=dtype,
            name=f"decoder_block_{i}",
        )
        block.build(seq_shape)
        blocks.append(block)
    final_norm = _make_norm(settings["normalization"], settings["layer_norm_epsilon"], dtype, "final_layer_norm")
    final_norm.build(seq_shape)
    return token_embedding, position_embedding, blocks, final_norm


def _build_graph(settings, spec, dtype):
    """A backbone's layers and functional graph: ``(layers by attribute name, inputs, hidden states)``."""
    token_embedding, position_embedding, decoder_blocks, final_norm = _make_layers(settings, spec, dtype)
    token_check = _TokenCheck(
        settings["vocabulary_size"], settings["max_sequence_length"], dtype=dtype, name="token_check"
    )
    mark_invalid = _MarkInvalid(dtype=dtype, name="mark_invalid")
    token_ids = keras.Input(shape=(None,), dtype="int32", name="token_ids")
    padding_mask = keras.Input(shape=(None,), dtype="int32", name="padding_mask", optional=True)
    checked_ids, positions, invalid = token_check(token_ids, padding_mask=padding_mask)
    x = _embed(
        token_embedding, position_embedding, checked_ids, positions, settings.get("embedding_scale")
    )  # [B, T, dim]
    for block in decoder_blocks:
        x = block(x, padding_mask=padding_mask)  # [B, T, dim]
    hidden = mark_invalid(final_norm(x), invalid)  # [B, T, dim]
    layers = {
        "token_check": token_check,
        "token_embedding": token_embedding,
        "position_embedding": position_embedding,
        "decoder_blocks": decoder_blocks,
        "final_norm": final_norm,
        "mark_invalid": mark_invalid,
    }
    return layers, {"token_ids": token_ids, "padding_mask": padding_mask}, hidden


# The weight layout current configs record (``"layout"``): the blocks are the backbone's own layers,
# keras-hub's layout. Files of keras_linattn < 0.3 have no such key (or the flat LM's config); they are
# refused with the converter's name (`keras_linattn.upgrade`, which the package never imports).
CURRENT_LAYOUT = "blocks"
UPGRADE_HINT = "convert it once with `python -m keras_linattn.upgrade OLD NEW` (keras_linattn.upgrade)"

# The constructor settings a backbone (and its task) exposes as attributes.
BACKBONE_SETTINGS = (
    "vocabulary_size", "num_layers", "hidden_dim", "num_heads", "intermediate_dim", "key_dim", "chunk_size",
    "dropout", "max_sequence_length", "tie_embeddings", "activation", "layer_norm_epsilon", "normalization",
    "feedforward", "use_bias", "attention_spec", "layer_attention", "embedding_scale",
    "post_norms", "parallel_residual", "moe", "final_logit_soft_cap",
)  # fmt: skip


@keras.saving.register_keras_serializable(package="keras_linattn")
@fill(mechanism_args=MECHANISM_ARGS_DOC)
class LinearBackbone(CheckpointTracked, LoraBackbone, keras_hub.models.Backbone):
    """Embeddings, `num_layers` causal linear-attention blocks and a final norm: the trunk of `LinearCausalLM`.

        token embedding (+ optional learned positions) -> `num_layers` x
        `LinearTransformerDecoder` -> final LayerNorm -> hidden states. A
        keras-hub `Backbone`: `save_to_preset` / `from_preset` work on local
        directories, and a task (`LinearCausalLM`, or any head of yours) is
        built on top of it. Training runs the chunkwise-parallel causal path;
        `call_with_state` and `step` continue from a decode state of fixed size.
        LoRA lives here, as in keras-hub: ``enable_lora(rank,
        target_layer_names=None, alpha=None)`` and `merge_lora`
        (`keras_linattn.models._lora`); the config records the adapters.

        A functional model of its own layers, as keras-hub's backbones are:
        ``token_ids`` and the optional ``padding_mask`` -> `token_check` (the
        ids and mask checked, each token's position) -> `token_embedding`
        (+ `position_embedding`) -> `decoder_blocks` -> `final_norm` ->
        `mark_invalid` (NaN at tokens a traced graph finds invalid; see
        `max_sequence_length`). `call_with_state` and `step` run the same
        layers from a state.

        The state is a flat list: each block's attention state in order
        (`LinearAttention.state_spec`; ``S [B, H, C, M]`` and ``z [B, H, C]``
        float32 for plain linear attention), then ``position [B]`` (int32), the
        number of real tokens consumed per row.
        `state_spec` describes it (names, shapes, dtypes); everything that
        decodes -- `LinearCausalLM.generate`, the exported signatures, the ONNX
        generator -- follows that one description and
        `keras_linattn.generation`.

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
                block owns a copy). Default ``"taylor"`` with the default
                ``conv_size=4``, the recommended attention (docs/results.md,
                "Which attention to pick"); its feature dim is
                ``1 + D + D^2`` for key dim D (273 at 16, 4161 at 64: 65
                times elu's state), so give wide heads ``key_dim=16``.
                ``feature_map="elu", conv_size=None`` is plain linear
                attention. A seeded map (``seed=s``)
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
            parallel_residual: False (default) or True: each block adds its
                attention and its feed-forward, both of the block's input,
                to the residual stream (GPT-NeoX).
            post_norms: False (default) or True: each block normalizes its
                attention's and its feed-forward's output before the
                residual add (Gemma 2 and 3).
            embedding_scale: None (default) or a number the token embeddings
                are multiplied by before the first block (Gemma:
                ``sqrt(hidden_dim)``); a tied head reads the unscaled table.
            final_logit_soft_cap: None (default) or ``c > 0``: the head's
                logits (`token_embedding(x, reverse=True)`) are capped,
                ``c * tanh(logits / c)``, as Gemma 2 caps its final logits.
            layer_attention: None (default: every block's attention takes
                the arguments below), or one dict per layer of the
                pretrained-model attention arguments (``rope_max_wavelength``,
                ``rope_scaling_factor``, ``rope_frequency_adjustment``,
                ``num_key_value_heads``, ``qk_norm_epsilon``) or a
                ``recurrence`` (a serialized recurrence) that replace
                them in that block: e.g. ``{"rope_max_wavelength": None}``
                for a layer without rotary embeddings (SmolLM3), a local
                layer's own window (Gemma 3).
            moe: None (default: dense feed-forwards), a dict of
                `keras_linattn.layers.MixtureOfExperts` arguments (every
                block's feed-forward is a mixture of experts), or a list of
                one such dict or None per layer (Qwen MoE's dense layers).
    {mechanism_args}
                Every block's attention gets them (their decode state joins
                `state_spec`; decoding stays constant-cost per token).
            lora: None, or ``{"rank": r, "alpha": a}`` (and the
                ``"target_layer_names"`` when not all four projections):
                `enable_lora`'s adapters, as configs record them.
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

        >>> import numpy as np
        >>> backbone = LinearBackbone(vocabulary_size=256, num_layers=2, hidden_dim=64,
        ...                           num_heads=4, intermediate_dim=128)
        >>> backbone({"token_ids": np.ones((2, 16), "int32"),
        ...           "padding_mask": np.ones((2, 16), "int32")}).shape
        TensorShape([2, 16, 64])
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        hidden_dim,
        num_heads,
        intermediate_dim,
        feature_map="taylor",
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
        layer_attention=None,
        embedding_scale=None,
        post_norms=False,
        parallel_residual=False,
        lora=None,
        moe=None,
        final_logit_soft_cap=None,
        *,
        spec=None,
        dtype=None,
        **kwargs,
    ):
        model_kwargs = {key: kwargs.pop(key) for key in ("name", "trainable") if key in kwargs}
        spec = AttentionSpec.pop(
            kwargs,
            feature_map,
            spec=spec,
            chunk_size=chunk_size,
            epsilon=kwargs.pop("epsilon", AttentionSpec.epsilon),
        )
        if kwargs:
            raise TypeError(f"LinearBackbone got unexpected keyword arguments: {sorted(kwargs)}")
        _check_sizes(vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim, key_dim, max_sequence_length)
        spec.check_heads(num_heads, key_dim if key_dim is not None else hidden_dim // num_heads)
        settings = {
            "vocabulary_size": vocabulary_size,
            "num_layers": num_layers,
            "hidden_dim": hidden_dim,
            "num_heads": num_heads,
            "intermediate_dim": intermediate_dim,
            "key_dim": key_dim,
            "chunk_size": spec.chunk_size,
            "dropout": dropout,
            "max_sequence_length": max_sequence_length,
            "tie_embeddings": tie_embeddings,
            "activation": activation,
            "layer_norm_epsilon": layer_norm_epsilon,
            "normalization": normalization,
            "feedforward": feedforward,
            "use_bias": use_bias,
            "attention_spec": spec,
            "layer_attention": _check_layer_attention(layer_attention, num_layers),
            "embedding_scale": _validation.check_positive_float("embedding_scale", embedding_scale, allow_none=True),
            "post_norms": _validation.check_bool("post_norms", post_norms),
            "parallel_residual": _validation.check_bool("parallel_residual", parallel_residual),
            "moe": _check_layer_moe(moe, num_layers),
            "final_logit_soft_cap": _validation.check_positive_float(
                "final_logit_soft_cap", final_logit_soft_cap, allow_none=True
            ),
        }

        layers, inputs, hidden = _build_graph(settings, spec, dtype)
        super().__init__(inputs=inputs, outputs=hidden, dtype=dtype, **model_kwargs)
        # The layers are assigned after `Model.__init__`, which starts the
        # records that `tf.train.Checkpoint` follows (`keras_linattn._tracking`).
        for name, layer in layers.items():
            setattr(self, name, layer)

        # === Config ===
        for name, value in settings.items():
            setattr(self, name, value)
        # `call` takes token ids alone too (then `padding_mask=` is optional).
        self.input_spec = None
        # LoRA adapters (`enable_lora`, `keras_linattn.models._lora`, sets these
        # and `get_config` records them, so that saved copies keep them).
        self.lora_rank = self.lora_alpha = self.lora_targets = None
        if lora is not None:
            self._restore_lora(lora)

    def call(self, inputs, padding_mask=None, training=None):
        token_ids, padding_mask = _unpack_inputs(inputs, padding_mask)
        # Checked before the graph converts them (a float id would be cast silently, an int64 id wrapped).
        token_ids = _validation.check_wide_ids(token_ids, "token_ids", self.vocabulary_size, _is_concrete(token_ids))
        token_ids = _check_ids_form(token_ids, "token_ids", 2, self.max_sequence_length)
        if token_ids.shape[1] == 0:  # no token to embed: the layer norms and the head would fail inside
            raise ValueError(
                f"`token_ids` must hold at least one token per row. Received: token_ids.shape={tuple(token_ids.shape)}"
            )
        if padding_mask is not None:
            # Nonzero is real, in any dtype: the graph's int32 input would truncate a float mask (0.5 -> 0).
            padding_mask = ops.cast(ops.cast(ops.convert_to_tensor(padding_mask), "bool"), "int32")
        return super().call({"token_ids": token_ids, "padding_mask": padding_mask}, training=training)

    # Presets: stale weight files removed and a sha256 manifest written at save, checked at load
    # (`keras_linattn.models._presets`).
    def save_to_preset(self, preset_dir, max_shard_size=10):
        with _presets.saving(preset_dir) as target:  # a staging copy, published whole
            super().save_to_preset(target, max_shard_size=max_shard_size)

    @classmethod
    def from_preset(cls, preset, load_weights=True, **kwargs):
        with _presets.loading(preset):
            return super().from_preset(preset, load_weights=load_weights, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Keras' `load_weights`, refusing a file with more layers' weights than the model (Keras skips them)."""
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
        (the same inside a `LinearCausalLM`):

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
        return _layout_map.layout_map(device_mesh, model_parallel_dim_name, data_parallel_dim_name)

    # ------------------------------------------------------ decode state
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

    def get_initial_state(self, batch_size):
        """Empty state (`state_spec`): zeros for every block's attention state and a zero int32 position."""
        return generation.zeros_state(self.state_spec(), batch_size)

    def check_state(self, state, batch_size=None, name="state"):
        """Raises ValueError (naming `name` and the entry) unless `state` matches `state_spec`."""
        generation.check_state(self.state_spec(), state, batch_size=batch_size, name=name)

    def block_states(self, state):
        """Splits a flat decode state into one tuple per block (the position, last, is left out)."""
        states, offset = [], 0
        for block in self.decoder_blocks:
            n = len(block.attention.state_spec())
            states.append(tuple(state[offset : offset + n]))
            offset += n
        return states

    def call_with_state(self, token_ids, state, padding_mask=None, training=None):
        """Runs a piece of a sequence in parallel, continuing from `state`.

        The layers of the graph `call` runs, with each block's attention
        started from its part of `state`.

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
        state = list(state)
        token_ids, padding_mask, positions, end, bad = _prepare(
            token_ids, padding_mask, state, self.vocabulary_size, self.max_sequence_length
        )
        x = self.embed(token_ids, positions)  # [B, T, dim]
        new_state = []
        for block, layer_state in zip(self.decoder_blocks, self.block_states(state), strict=True):
            x, layer_state = block(
                x, padding_mask=padding_mask, training=training, return_state=True, initial_state=layer_state
            )  # [B, T, dim]
            new_state += list(layer_state)
        new_state.append(end)
        return _nan_where(bad, self.final_norm(x)), new_state

    def step(self, token_t, state, training=None):
        """One decoding step in recurrent form (constant time and memory).

        Args:
            token_t: ``[B]`` int token ids.
            state: from `get_initial_state`, `call_with_state` or `step`.

        Returns:
            ``(hidden_t [B, dim], new_state)``.
        """
        token_t = _check_token_ids(token_t, "token_t", 1, self.vocabulary_size, self.max_sequence_length)
        self.check_state(state, batch_size=token_t.shape[0])
        position = ops.cast(state[-1], "int32")  # [B]
        token_t, bad = _past_limit(
            token_t,
            position,
            "token_t",
            lambda: f"state position (state[-1])={_max_or_none(position)}",
            self.vocabulary_size,
            self.max_sequence_length,
        )
        x = self.embed(token_t, position)  # [B, dim]
        new_state = []
        for block, layer_state in zip(self.decoder_blocks, self.block_states(state), strict=True):
            x, layer_state = block.step(x, layer_state, training=training)  # [B, dim]
            new_state += list(layer_state)
        new_state.append(position + 1)
        return _nan_where(bad, _step_norm(self.final_norm, x)), new_state

    def embed(self, token_ids, positions):
        """Token embeddings plus, with `max_sequence_length`, the learned positions (``[B, T, dim]``)."""
        return _embed(self.token_embedding, self.position_embedding, token_ids, positions, self.embedding_scale)

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
        lora = self._lora_entry()
        if lora is not None:  # only then: configs without adapters are unchanged
            config["lora"] = lora
        if self.post_norms:  # only then: configs without them are unchanged
            config["post_norms"] = True
        if self.parallel_residual:  # only then: configs without it are unchanged
            config["parallel_residual"] = True
        if self.embedding_scale is not None:  # only then: configs without it are unchanged
            config["embedding_scale"] = self.embedding_scale
        if self.final_logit_soft_cap is not None:  # only then: configs without it are unchanged
            config["final_logit_soft_cap"] = self.final_logit_soft_cap
        if self.layer_attention is not None:  # only then: configs without it are unchanged
            config["layer_attention"] = [dict(entry) for entry in self.layer_attention]
        if self.moe is not None:  # only then: configs without it are unchanged
            config["moe"] = [None if entry is None else dict(entry) for entry in self.moe]
        config["layout"] = CURRENT_LAYOUT  # what tells a current file from one of keras_linattn < 0.3
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        layout = config.pop("layout", None)
        if layout != CURRENT_LAYOUT:
            raise ValueError(
                f"This {cls.__name__} config was written by keras_linattn < 0.3 (its weights are filed under "
                f"another layout): {UPGRADE_HINT}. Received: layout={layout!r}"
            )
        return super().from_config(config)


# `.keras` save and load of a large LinearBackbone / LinearCausalLM stream the weights through disk.
_saving.install(LinearBackbone)
