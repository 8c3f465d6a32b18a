"""LoRA on the attention projections of a linearized model, and merging it back before export.

The LoLCATs recipe's second stage: after attention transfer, the query,
key, value and output projections of every `LinearAttention` get low-rank
adapters (rank 8, alpha 16: updates scaled by alpha / rank = 2) and
everything else, feature maps included, is frozen. Keras' own LoRA
(`keras.layers.EinsumDense.enable_lora`) does the work; each `LinearBackbone`
of the model adapts itself (`LinearBackbone.enable_lora`, keras-hub's home
of LoRA), and `LinearAttention` layers outside one get the same adapters
here. `merge_lora` gives a
model of the same architecture without adapters, whose kernels are
``W + (alpha / rank) A B``, for export.

Saving. In a `LinearCausalLM` / `LinearBackbone` the backbone's config
records the adapters (``"lora": {"rank", "alpha"}``): a `.keras` file, a
preset or ``save_weights`` keeps W, A, B, the rank, alpha, the frozen
weights and (`.keras`) the optimizer's state, so training resumes where it
stopped. Any other model (functional, Sequential, subclassed) cannot record
them in its config: saving it with adapters raises, naming `merge_lora`.
"""

import contextlib
import warnings

import keras

from keras_linattn import _compat
from keras_linattn._capture import walk_layers
from keras_linattn.models._lora import (
    PROJECTIONS,
    adapter_variables,
    add_adapters,
    attention_layers,
    check_not_enabled,
    check_rank_alpha,
    freeze,
    lora_hosts,
    merge_adapters,
    projections,
    unfreeze,
)
from keras_linattn.models._sampler_bridge import get_sampler, serialize_sampler

__all__ = ["PROJECTIONS", "enable_lora", "lora_variables", "merge_lora"]


def enable_lora(model, rank=8, alpha=16):
    """Freezes `model` and puts LoRA adapters on every `LinearAttention`'s q/k/v/o projections.

    In a `LinearCausalLM` / `LinearBackbone` the adapters are part of the
    model's config and weights: `.keras` files, presets and ``save_weights``
    keep them (see the module docstring). Other models refuse to be saved
    until `merge_lora`.

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
    check_rank_alpha(rank, alpha)
    attention = attention_layers(model)
    check_not_enabled(attention, rank)
    model.trainable = True
    freeze(walk_layers(model)[1:])
    hosts = lora_hosts(model)
    for host in hosts:  # the backbone's own `enable_lora`: its config records the adapters
        host.enable_lora(rank, alpha=alpha)
    recorded = {id(layer) for host in hosts for layer in walk_layers(host)}
    add_adapters([layer for layer in attention if id(layer) not in recorded], rank, alpha, in_config=False)
    adapters = lora_variables(model)
    trainable = {id(v) for v in model.trainable_variables}
    if trainable != {id(v) for v in adapters}:
        raise RuntimeError("LoRA: the trainable variables are not exactly the adapters")
    return adapters


def lora_variables(model):
    """The LoRA adapter variables (``lora_kernel_a``, ``lora_kernel_b``) of the model's attention projections."""
    return adapter_variables(model)


@contextlib.contextmanager
def _without_lora_record(model):
    """Within: the model's config has no ``"lora"`` entry and its projections save merged kernels."""
    hosts = [(host, host.lora_rank, host.lora_alpha, host.lora_targets) for host in lora_hosts(model)]
    denses = [dense for layer in attention_layers(model) for dense in projections(layer) if dense.lora_enabled]
    try:
        for host, _, _, _ in hosts:
            host.lora_rank = host.lora_alpha = host.lora_targets = None
        for dense in denses:
            dense.lora_save_merged = True
        yield
    finally:
        for host, rank, alpha, targets in hosts:
            host.lora_rank, host.lora_alpha, host.lora_targets = rank, alpha, targets
        for dense in denses:
            dense.lora_save_merged = False


def _compile_like(fresh, model):
    """Compiles `fresh` as `model` is (a fresh optimizer of the same config; loss, metrics, sampler).

    `compile` itself, not `compile_from_config`: the latter builds the
    optimizer's slots at once (Adam's: two more copies of every weight, 9
    GB at 1B parameters, for a model that is about to be exported); they
    are built at the first training step instead.
    """
    if not getattr(model, "compiled", False):
        return
    try:
        # keras.Model's: LinearCausalLM's own would build `model`'s optimizer.
        config = keras.saving.deserialize_keras_object(keras.Model.get_compile_config(model))
        sampler = getattr(model, "sampler", None)
        if sampler is not None and hasattr(type(model), "make_generate_function"):
            config = dict(config, sampler=get_sampler(serialize_sampler(sampler)))  # a copy
        fresh.compile(**config)
    except Exception as error:  # e.g. a loss that Keras cannot serialize
        warnings.warn(
            f"merge_lora: the compile settings could not be copied to the merged model ({error}); "
            f"call `compile` on it. Received: {type(model).__name__} compiled={model.compiled}",
            stacklevel=3,
        )


def _copy_weights(source, target, shared=None):
    """`source`'s weights into `target` (built from its config), layer by layer, without a file.

    The same per-layer ``save_own_variables`` / ``load_own_variables`` that
    ``save_weights`` / ``load_weights`` run, through an in-memory store: one
    layer's values at a time (the merged kernel is computed then), instead of
    a whole ``.weights.h5`` written and read back (at 1B parameters that ran
    out of 24 GB). `shared` (a preprocessor both models hold) is skipped.
    """
    skip = set() if shared is None else {id(layer) for layer in _compat.flatten_layers(shared)}
    sources = [layer for layer in _compat.flatten_layers(source) if id(layer) not in skip]
    targets = [layer for layer in _compat.flatten_layers(target) if id(layer) not in skip]
    if len(sources) != len(targets) or any(type(a) is not type(b) for a, b in zip(sources, targets, strict=False)):
        raise RuntimeError(
            f"merge_lora: the model rebuilt from its config does not have the argument's layers "
            f"({len(targets)} vs {len(sources)}). Received: {type(source).__name__}"
        )
    for a, b in zip(sources, targets, strict=True):
        store = {}
        a.save_own_variables(store)
        if store or _compat.own_variables(b):
            b.load_own_variables(store)


def _merge_in_place(model):
    """Each adapted projection's kernel becomes ``W + (alpha / r) A B`` and its adapters are deleted."""
    hosts = [host for host in lora_hosts(model) if host.lora_rank is not None]
    for host in hosts:
        host.merge_lora()
    merged = {id(layer) for host in hosts for layer in walk_layers(host)}
    merge_adapters([layer for layer in attention_layers(model) if id(layer) not in merged])


def merge_lora(model, in_place=False):
    """The model with the adapters merged into the kernels (for export): a new one, or the argument itself.

    Each projection's kernel becomes ``W + (alpha / r) A B``; everything
    else is copied. By default the argument is left unchanged and a new
    model is built from its config; the weights reach it layer by layer in
    memory (no temporary file). With ``in_place=True`` the argument's own
    kernels are merged and its adapters deleted: no second model, which is
    what fits best at real size (Llama 3.2 1B's shape beside its teacher,
    from 11.8 GiB: no growth in place, a 15.6 GiB peak with a new model;
    docs/linearize.md).

    Compile settings: a compiled argument's loss, metrics, `jit_compile`
    etc. and (`LinearCausalLM`) sampler are kept, with a fresh optimizer of
    the same class and configuration (its state belonged to the adapters).
    An uncompiled `LinearCausalLM` gives one compiled with keras-hub's
    defaults, as `from_config` and `from_preset` do (in place: it stays
    uncompiled); other uncompiled models give uncompiled ones.

    Args:
        model: a model with adapters from `enable_lora` (or keras-hub's
            `Backbone.enable_lora`).
        in_place: merge into `model` and return it.

    Returns:
        A model of the argument's class (with ``in_place=True``, the
        argument), every weight trainable (feature maps and gammas
        included), no adapters; its config records none.

    Raises:
        ValueError: for a model without adapters, or `in_place` not a bool.
    """
    if not isinstance(in_place, bool):
        raise ValueError(f"`in_place` must be True or False. Received: in_place={in_place!r}")
    if not lora_variables(model):
        raise ValueError("The model has no LoRA adapters to merge; call `enable_lora` first.")
    if in_place:
        _merge_in_place(model)
        unfreeze(model)
        _compile_like(model, model)
        return model
    with _without_lora_record(model):
        config = model.get_config()
        preprocessor = getattr(model, "preprocessor", None)
        if preprocessor is not None:
            # A keras-hub task: its preprocessor (tokenizer assets included) is shared, not rebuilt from config.
            config = dict(config, preprocessor=None)
        fresh = model.__class__.from_config(config)
        if preprocessor is not None:
            fresh.preprocessor = preprocessor
        _copy_weights(model, fresh, shared=preprocessor)
    unfreeze(fresh)  # a functional config records the frozen layers
    _compile_like(fresh, model)
    return fresh
