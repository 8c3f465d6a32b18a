"""The keras-hub adapter of `linearize`: keras-hub teachers -> `LinearBackbone` / `LinearCausalLM`.

Imported only for a keras-hub teacher (`keras_linattn.linearization.convert`),
so ``import keras_linattn`` never imports keras_hub.

One adapter per keras-hub family: it reads the teacher's config, builds the
`LinearBackbone` with the same architecture (norms, feed-forward, positions,
heads) and linear attention in each attention slot, and copies every weight
by its public variable path (``transformer_layer_<i>/self_attention/query/
kernel``, ...). Weights of the student that the teacher has no counterpart
for (feature maps, the window's gamma) keep their initialization.

Supported families (`FAMILIES`): GPT-2 (`GPT2Backbone`) and Llama
(`LlamaBackbone`, `Llama3Backbone`). Not supported yet, with the reason:
Gemma (its query kernel is laid out ``[H, dim, D]``, logits are soft-capped
and layers alternate with sliding-window attention), Mistral and Qwen
(sliding-window / bias variants not mapped).
"""

import keras
import keras_hub
import numpy as np

from keras_linattn.layers.spec import ARGUMENTS, PRETRAINED_ARGUMENTS
from keras_linattn.models.backbone import LinearBackbone
from keras_linattn.models.causal_lm import LinearCausalLM
from keras_linattn.models.preprocessor import LinearCausalLMPreprocessor

__all__ = ["FAMILIES", "UNSUPPORTED", "linearize", "linearize_keras_hub"]

FAMILIES = ("GPT2Backbone", "LlamaBackbone", "Llama3Backbone")
UNSUPPORTED = {
    "GemmaBackbone": "query kernel laid out [H, dim, D], logit soft caps and sliding-window layers are not mapped",
    "Gemma3Backbone": "query kernel laid out [H, dim, D], logit soft caps and sliding-window layers are not mapped",
    "MistralBackbone": "its sliding-window attention is not mapped",
    "QwenBackbone": "its q/k/v biases with GQA are not mapped",
}


def _weights_by_path(model):
    """``{path relative to the model: variable}``."""
    prefix = model.name + "/"
    out = {}
    for w in model.weights:
        path = w.path[len(prefix) :] if w.path.startswith(prefix) else w.path
        out[path] = w
    return out


class _Copier:
    """Assigns teacher variables to student variables, checking shapes, and records what it copied."""

    def __init__(self, teacher_backbone):
        self.source = _weights_by_path(teacher_backbone)
        self.used = set()

    def __call__(self, target, path):
        if path not in self.source:
            raise ValueError(f"The teacher has no weight '{path}'. Its weights: {sorted(self.source)[:12]} ...")
        value = np.asarray(keras.ops.convert_to_numpy(self.source[path]))
        if tuple(target.shape) != value.shape:
            raise ValueError(
                f"Weight '{path}' has shape {value.shape} in the teacher and {tuple(target.shape)} in the student."
            )
        target.assign(value.astype(target.dtype))
        self.used.add(path)

    def check_all_used(self):
        unused = sorted(set(self.source) - self.used)
        if unused:
            raise ValueError(f"Teacher weights with no place in the linear model (not copied): {unused}")


def _family(backbone):
    name = type(backbone).__name__
    for base in type(backbone).__mro__:
        if base.__name__ in FAMILIES:
            return base.__name__
    reason = UNSUPPORTED.get(name)
    raise TypeError(
        f"keras-hub backbone {name} is not supported by `linearize`"
        + (f": {reason}." if reason else ".")
        + f" Supported families: {FAMILIES}."
    )


def _gpt2_config(config, backbone):
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=config["max_sequence_length"],
        tie_embeddings=True,
        activation="gelu_approximate",
        layer_norm_epsilon=1e-5,
    )


def _llama_config(config, backbone):
    if config.get("rope_frequency_adjustment_factor") is not None:
        raise TypeError(
            "Llama 3.1-style RoPE frequency adjustment (rope_frequency_adjustment_factor) is not supported yet. "
            f"Received: rope_frequency_adjustment_factor={config['rope_frequency_adjustment_factor']}"
        )
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        # keras-hub's Llama `get_config` omits `tie_word_embeddings` (Llama 3.2 ties them): the embedding
        # layer knows.
        tie_embeddings=bool(config.get("tie_word_embeddings", backbone.token_embedding.tie_weights)),
        activation="silu",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        rope_max_wavelength=config.get("rope_max_wavelength", 10000),
        # keras-hub's Llama rotary embedding does not apply `rope_position_scaling_factor`.
        rope_scaling_factor=1.0,
    )


def _copy_attention(copy, attention, prefix, bias):
    for name, dense in (
        ("query", attention.query_dense),
        ("key", attention.key_dense),
        ("value", attention.value_dense),
        ("attention_output", attention.output_dense),
    ):
        copy(dense.kernel, f"{prefix}/{name}/kernel")
        if bias:
            copy(dense.bias, f"{prefix}/{name}/bias")


def _copy_gpt2(copy, student):
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    copy(student.position_embedding.embeddings, "position_embedding/embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        _copy_attention(copy, block.attention, f"{p}/self_attention", bias=True)
        for ours, theirs in (
            (block._attention_norm, "self_attention_layer_norm"),
            (block._ffn_norm, "feedforward_layer_norm"),
        ):
            copy(ours.gamma, f"{p}/{theirs}/gamma")
            copy(ours.beta, f"{p}/{theirs}/beta")
        for ours, theirs in (
            (block._ffn_intermediate, "feedforward_intermediate_dense"),
            (block._ffn_output, "feedforward_output_dense"),
        ):
            copy(ours.kernel, f"{p}/{theirs}/kernel")
            copy(ours.bias, f"{p}/{theirs}/bias")
    copy(student.final_norm.gamma, "layer_norm/gamma")
    copy(student.final_norm.beta, "layer_norm/beta")


def _copy_llama(copy, student):
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        _copy_attention(copy, block.attention, f"{p}/self_attention", bias=False)
        copy(block._attention_norm.scale, f"{p}/self_attention_layernorm/scale")
        copy(block._ffn_norm.scale, f"{p}/feedforward_layernorm/scale")
        for ours, theirs in (
            (block._ffn_gate, "feedforward_gate_dense"),
            (block._ffn_intermediate, "feedforward_intermediate_dense"),
            (block._ffn_output, "feedforward_output_dense"),
        ):
            copy(ours.kernel, f"{p}/{theirs}/kernel")
    copy(student.final_norm.scale, "sequence_output_layernorm/scale")


def _attention_own(path):
    """True for a weight of the new attention itself (feature map, gamma, decay, ...), not of a projection."""
    if "/self_attention/" not in path:
        return False
    projection = path.split("/self_attention/", 1)[1].split("/", 1)[0]
    return projection not in ("query", "key", "value", "attention_output")


def _relinearize(backbone, feature_map, window_size, attention_kwargs):
    """The package's own LM with another attention (feature map, window, ...): every other weight copied.

    The attention settings of the teacher are replaced as a whole by
    `feature_map`, `window_size` and `attention_kwargs`; weights the two
    attentions share (projections, short convolutions) are copied where the
    paths and shapes match, the new attention's own weights keep their
    initialization.
    """
    config = backbone.get_config()
    for key in ARGUMENTS:
        if key not in PRETRAINED_ARGUMENTS:  # RoPE and GQA are the architecture's: kept
            config.pop(key, None)
    config.pop("name", None)
    config.pop("layout", None)  # a record of the config, not a constructor argument
    config.update(attention_kwargs)
    config["window_size"] = window_size
    config["feature_map"] = feature_map
    student = LinearBackbone(**config)
    source = _weights_by_path(backbone)
    target = _weights_by_path(student)
    maps = (
        {id(w) for block in student.decoder_blocks for w in block.attention.feature_map.weights}
        if any(block.attention.feature_map is not None for block in student.decoder_blocks)
        else set()
    )
    missing = []
    for path, w in target.items():
        if id(w) in maps:
            continue
        if path in source and tuple(source[path].shape) == tuple(w.shape):
            w.assign(source[path])
        elif not _attention_own(path):
            missing.append(path)
    if missing:
        raise ValueError(f"The teacher has no weight for these student weights (shapes or paths differ): {missing}")
    return student


_ADAPTERS = {
    "GPT2Backbone": (_gpt2_config, _copy_gpt2),
    "LlamaBackbone": (_llama_config, _copy_llama),
    "Llama3Backbone": (_llama_config, _copy_llama),
}


def linearize_keras_hub(teacher, *, feature_map="hedgehog", window_size=64, **attention_kwargs):
    """A keras-hub GPT-2 / Llama `CausalLM` or `Backbone` -> `LinearCausalLM` / `LinearBackbone`.

    The student has the teacher's architecture and weights, with linear
    attention (`feature_map`, a softmax window of `window_size` tokens and
    `attention_kwargs`) in each attention slot. A `CausalLM` teacher gives a
    `LinearCausalLM` whose preprocessor is a `LinearCausalLMPreprocessor`
    over the teacher's tokenizer. The teacher is not changed. A ``dtype``
    in `attention_kwargs` is the student's dtype policy (default: the
    teacher's).

    Raises:
        TypeError: for a keras-hub family that is not supported (named,
            with the reason).
        ValueError: if a teacher weight has no place in the student or a
            shape differs (nothing is copied silently in part).
    """
    is_task = isinstance(teacher, keras_hub.models.CausalLM)
    backbone = teacher.backbone if is_task else teacher
    if not isinstance(backbone, keras_hub.models.Backbone):
        raise TypeError(f"Expected a keras-hub CausalLM or Backbone. Received: {type(teacher).__name__}")
    if isinstance(backbone, LinearBackbone):
        student = _relinearize(backbone, feature_map, window_size, attention_kwargs)
    else:
        family = _family(backbone)
        make_config, copy_weights = _ADAPTERS[family]
        config = make_config(backbone.get_config(), backbone)
        config["dtype"] = backbone.dtype_policy.name
        config.update(attention_kwargs)  # a `dtype` there is the student's policy
        config.setdefault("window_size", window_size)
        student = LinearBackbone(feature_map=feature_map, **config)
        copier = _Copier(backbone)
        copy_weights(copier, student)
        copier.check_all_used()
    if not is_task:
        return student
    preprocessor = None
    if teacher.preprocessor is not None:
        preprocessor = LinearCausalLMPreprocessor(
            teacher.preprocessor.tokenizer, sequence_length=teacher.preprocessor.sequence_length
        )
    return LinearCausalLM(student, preprocessor=preprocessor)


def linearize(teacher, *, feature_map, window_size, **attention_kwargs):
    """`keras_linattn.linearize` for a keras-hub teacher (`linearize_keras_hub`)."""
    return linearize_keras_hub(teacher, feature_map=feature_map, window_size=window_size, **attention_kwargs)
