"""LoRA on the attention projections of a linearized model, and merging it back before export.

The LoLCATs recipe's second stage: after attention transfer, the query,
key, value and output projections of every `LinearAttention` get low-rank
adapters (rank 8, alpha 16: updates scaled by alpha / rank = 2) and
everything else, feature maps included, is frozen. Keras' own LoRA
(`keras.layers.EinsumDense.enable_lora`) does the work; `merge_lora` gives a
model of the same architecture without adapters, whose kernels are
``W + (alpha / rank) A B``, for export.
"""

import os
import tempfile

from keras_linattn._capture import walk_layers
from keras_linattn._validation import check_positive_int
from keras_linattn.layers.linear_attention import LinearAttention

__all__ = ["PROJECTIONS", "enable_lora", "lora_variables", "merge_lora"]

# The projections of a `LinearAttention` layer that take adapters (their layer names).
PROJECTIONS = ("query", "key", "value", "attention_output")


def _attention_layers(model):
    layers = [layer for layer in walk_layers(model) if isinstance(layer, LinearAttention)]
    if not layers:
        raise ValueError(f"The model has no LinearAttention layer to put LoRA on. Received: {type(model).__name__}")
    return layers


def _projections(layer):
    return [layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense]


def enable_lora(model, rank=8, alpha=16):
    """Freezes `model` and puts LoRA adapters on every `LinearAttention`'s q/k/v/o projections.

    Args:
        model: a model holding `LinearAttention` layers (e.g. from
            `keras_linattn.linearize`), modified in place.
        rank: the adapters' rank r. LoLCATs: 8.
        alpha: the scale numerator: updates are ``(alpha / r) A B``.
            LoLCATs: 16 (alpha / r = 2). keras-hub's
            `Backbone.enable_lora` uses alpha = r.

    Returns:
        The list of the adapters' variables (the model's trainable
        variables from now on).

    Raises:
        ValueError: for a model without `LinearAttention`, a rank that is not
            a positive int, or projections that already have adapters.
    """
    check_positive_int("rank", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"`alpha` must be a positive number. Received: alpha={alpha!r}")
    attention = _attention_layers(model)
    for layer in attention:
        for dense in _projections(layer):
            if dense.lora_enabled:
                raise ValueError(f"LoRA is already enabled on {dense.path}. Received: rank={rank}")
    model.trainable = True
    for layer in walk_layers(model)[1:]:
        layer.trainable = False  # every variable below the model (Keras trains by variable flag)
    for layer in attention:
        for dense in _projections(layer):
            dense.trainable = True  # Keras creates the adapters trainable only in a trainable layer
            dense.enable_lora(rank, lora_alpha=alpha)  # new A, B; the kernel is frozen by Keras
            if dense.bias is not None:
                dense.bias.trainable = False
    adapters = lora_variables(model)
    trainable = {id(v) for v in model.trainable_variables}
    if trainable != {id(v) for v in adapters}:
        raise RuntimeError("LoRA: the trainable variables are not exactly the adapters")
    return adapters


def lora_variables(model):
    """The LoRA adapter variables (``lora_kernel_a``, ``lora_kernel_b``) of the model's attention projections."""
    out = []
    for layer in _attention_layers(model):
        for dense in _projections(layer):
            if dense.lora_enabled:
                out += [dense.lora_kernel_a, dense.lora_kernel_b]
    return out


def merge_lora(model):
    """A new model of the same architecture with the adapters merged into the kernels (for export).

    Keras writes a LoRA projection's weights merged (``W + (alpha / r) A B``)
    when it saves them; the model is saved that way and loaded into a fresh
    model built from its config (which has no adapters). The argument is
    left unchanged.

    Returns:
        A model of the argument's class, all weights trainable, no adapters.
    """
    if not lora_variables(model):
        raise ValueError("The model has no LoRA adapters to merge; call `enable_lora` first.")
    config = model.get_config()
    preprocessor = getattr(model, "preprocessor", None)
    if preprocessor is not None:
        # A keras-hub task: its preprocessor (tokenizer assets included) is shared, not rebuilt from config.
        config = dict(config, preprocessor=None)
    fresh = model.__class__.from_config(config)
    if preprocessor is not None:
        fresh.preprocessor = preprocessor
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "merged.weights.h5")
        model.save_weights(path)
        fresh.load_weights(path)
    return fresh
