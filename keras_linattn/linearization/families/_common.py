"""What family modules share: the weight copier and the copies several families make alike."""

import keras
import numpy as np

from keras_linattn.linearization import _deferred

__all__ = ["Copier", "copy_attention", "copy_rms_decoder", "weights_by_path"]


def weights_by_path(model):
    """``{path relative to the model: variable}``."""
    prefix = model.name + "/"
    out = {}
    for w in model.weights:
        path = w.path[len(prefix) :] if w.path.startswith(prefix) else w.path
        out[path] = w
    return out


class Copier:
    """Assigns teacher variables to student variables, checking shapes, and records what it copied.

    Args:
        teacher_backbone: the keras-hub backbone whose weights are read.
    """

    def __init__(self, teacher_backbone):
        self.source = weights_by_path(teacher_backbone)
        self.weights = list(teacher_backbone.weights)
        self.used = set()  # ids of the teacher variables copied (or declared derived)

    def __call__(self, target, path, transform=None):
        """Copies teacher weight `path` (through ``transform(np.ndarray)`` if given) into `target`.

        Raises:
            ValueError: for a path the teacher lacks, or shapes that differ.
        """
        if path not in self.source:
            raise ValueError(f"The teacher has no weight '{path}'. Its weights: {sorted(self.source)[:12]} ...")
        self.variable(target, self.source[path], transform)

    def variable(self, target, source, transform=None):
        """Copies the teacher variable `source` itself into `target` (for teachers whose paths repeat).

        Raises:
            ValueError: for shapes that differ.
        """
        if transform is None and str(source.dtype) == str(target.dtype) and tuple(source.shape) == tuple(target.shape):
            # Variable to variable: TensorFlow's assign takes the teacher's buffer (copy-on-write: a later write
            # to either model copies it), so a large teacher is not held twice over through numpy copies.
            _deferred.put(target, source)
            self.used.add(id(source))
            return
        value = np.asarray(keras.ops.convert_to_numpy(source))
        if transform is not None:
            value = np.asarray(transform(value))
        if tuple(target.shape) != value.shape:
            raise ValueError(
                f"Weight '{source.path}' has shape {value.shape} in the teacher and {tuple(target.shape)} in the "
                "student."
            )
        _deferred.put(target, value.astype(target.dtype))
        self.used.add(id(source))

    def derived(self, source):
        """Declares a teacher variable the student computes from the config (e.g. RoPE's inverse frequencies)."""
        self.used.add(id(source))

    def zero(self, target):
        """Sets a student weight the teacher has no counterpart for to zero (e.g. a bias it lacks)."""
        _deferred.put(target, np.zeros(tuple(target.shape), target.dtype))

    def check_all_used(self):
        """Raises ValueError naming the teacher weights that were not copied."""
        unused = sorted({w.path for w in self.weights if id(w) not in self.used})
        if unused:
            raise ValueError(f"Teacher weights with no place in the linear model (not copied): {unused}")


def copy_attention(copy, attention, prefix, bias, names=("query", "key", "value", "attention_output")):
    """Copies q/k/v/o kernels from ``<prefix>/<name>/kernel`` (biases too where `bias` says so).

    Args:
        copy: the `Copier`.
        attention: the student's `LinearAttention`.
        prefix: the teacher attention's path.
        bias: True (all four biases), False (none) or ``"qkv"`` (query, key
            and value only; the student's output bias is set to zero).
        names: the teacher's names of the four projections.
    """
    for name, dense in zip(
        names,
        (attention.query_dense, attention.key_dense, attention.value_dense, attention.output_dense),
        strict=True,
    ):
        copy(dense.kernel, f"{prefix}/{name}/kernel")
        if bias is True or (bias == "qkv" and dense is not attention.output_dense):
            copy(dense.bias, f"{prefix}/{name}/bias")
        elif bias == "qkv":
            copy.zero(dense.bias)


def copy_rms_decoder(copy, student, attention_bias=False, zero_feedforward_bias=False):
    """The Llama-layout copy (Llama, Llama 3, Mistral, Qwen): RMSNorm, SwiGLU, q/k/v/o, final norm.

    Teacher paths: ``token_embedding/embeddings`` (+ ``reverse_embeddings``
    when untied), ``transformer_layer_<i>/self_attention/<q,k,v,o>``,
    ``self_attention_layernorm/scale``, ``feedforward_layernorm/scale``,
    ``feedforward_{gate,intermediate,output}_dense/kernel`` and
    ``sequence_output_layernorm/scale``.

    Args:
        copy: the `Copier`.
        student: the `LinearBackbone`.
        attention_bias: passed to `copy_attention` as `bias`.
        zero_feedforward_bias: the student has feed-forward biases (its
            ``use_bias`` covers both) that the teacher lacks: set them to zero.
    """
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        copy_attention(copy, block.attention, f"{p}/self_attention", bias=attention_bias)
        copy(block._attention_norm.scale, f"{p}/self_attention_layernorm/scale")
        copy(block._ffn_norm.scale, f"{p}/feedforward_layernorm/scale")
        for ours, theirs in (
            (block._ffn_gate, "feedforward_gate_dense"),
            (block._ffn_intermediate, "feedforward_intermediate_dense"),
            (block._ffn_output, "feedforward_output_dense"),
        ):
            copy(ours.kernel, f"{p}/{theirs}/kernel")
            if zero_feedforward_bias:
                copy.zero(ours.bias)
    copy(student.final_norm.scale, "sequence_output_layernorm/scale")


def rms_decoder_config(config, backbone, **overrides):
    """The `LinearBackbone` arguments every Llama-layout config shares (RMSNorm, gated SiLU feed-forward, RoPE, GQA).

    keras-hub's Llama-style `get_config` omits `tie_word_embeddings` (Llama 3.2 ties them): the embedding layer
    knows. `overrides` replace or add arguments (biases, head size, RoPE scaling, q/k norms).
    """
    arguments = dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=bool(config.get("tie_word_embeddings", backbone.token_embedding.tie_weights)),
        activation="silu",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        rope_max_wavelength=config.get("rope_max_wavelength", 10000),
        rope_scaling_factor=config.get("rope_scaling_factor", 1.0),
    )
    arguments.update(overrides)
    return arguments
