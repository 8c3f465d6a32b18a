"""`linearize`: a pretrained softmax-attention model, rebuilt with `LinearAttention` in each attention slot.

The teacher's type picks the adapter:

- a keras-hub model (a class from the ``keras_hub`` package): the keras-hub
  adapter, imported only then (``import keras_linattn`` never imports
  keras_hub);
- a functional or Sequential `keras.Model` built from
  `keras.layers.MultiHeadAttention`: the generic adapter
  (`keras_linattn.linearization._generic`);
- anything else: ``TypeError``.
"""

import importlib
import importlib.util

import keras

from keras_linattn import feature_maps
from keras_linattn.linearization import _generic

__all__ = ["linearize"]

# LoLCATs' initial weight of the window's softmax terms: sigmoid(-2.197) = 0.1.
LOLCATS_WINDOW_GAMMA = 0.1

# `linearize`'s initial weight of the window's softmax terms. 0.9 ends better than LoLCATs' 0.1 on both example
# teachers (GPT-2 and Llama; docs/dev/history/linearize.md, "Window gamma"): at 0.1 the window terms start far
# below the linear terms of the older keys, and attention transfer moves gamma only to about 0.2.
DEFAULT_WINDOW_GAMMA = 0.9

# The initial weight of the linear terms beside a sparse cache (LoLA, used without training): small, so that the
# window's and the cache's sharp matches are not averaged away (docs/recurrences.md, "The linear weight").
LOLA_LINEAR_WEIGHT = 0.001

# Adapters for model families, imported only for a teacher of that family:
# (name of the package the teacher's class comes from, module of the adapter).
_FAMILY_ADAPTERS = (("keras_hub", "keras_linattn.linearization._keras_hub"),)


def _families(teacher):
    """The top-level packages of the classes the teacher's class derives from (no import needed)."""
    return {cls.__module__.split(".", 1)[0] for cls in type(teacher).__mro__}


def _adapter(teacher):
    families = _families(teacher)
    for package, module in _FAMILY_ADAPTERS:
        if package in families:
            if importlib.util.find_spec(module) is None:
                raise TypeError(
                    f"{package} teachers are not supported yet. Received: teacher of type {type(teacher).__name__}"
                )
            return importlib.import_module(module).linearize
    if isinstance(teacher, keras.Sequential) or (isinstance(teacher, keras.Model) and hasattr(teacher, "outputs")):
        return _linearize_generic
    raise TypeError(
        "`linearize` takes a functional or Sequential keras.Model built from keras.layers.MultiHeadAttention, "
        "or a supported keras-hub model; a subclassed model's attention cannot be found generically. "
        f"Received: teacher of type {type(teacher).__name__}"
    )


def _linearize_generic(teacher, *, feature_map, window_size, **attention_kwargs):
    return _generic.linearize_functional(teacher, feature_map, window_size, attention_kwargs)


def linearize(teacher, *, feature_map="hedgehog", window_size=64, **attention_kwargs):
    """A copy of a softmax-attention model with linear attention in each attention slot.

    Each `keras.layers.MultiHeadAttention` becomes a
    `keras_linattn.layers.LinearAttention` with the same heads, key/value
    dims, dropout and output shape, its query/key/value/output kernels and
    biases copied (the EinsumDense layouts are the same), called with the
    same ``use_causal_mask`` (read from the teacher's graph). Every other
    layer is rebuilt from its config with its weights copied. The teacher
    is not modified.

    With the default ``feature_map="hedgehog"`` and a sliding window (the
    LoLCATs recipe), each causal attention is exact softmax over the last
    `window_size` tokens plus hedgehog linear attention over older ones:
    for sequences no longer than `window_size` the linearized model
    computes the teacher's function (up to rounding); beyond, the feature
    maps are trained with `keras_linattn.attention_transfer`.

    Args:
        teacher: a functional `keras.Model` built from
            `keras.layers.MultiHeadAttention` (self- or cross-attention,
            nested functional models included). keras-hub models are
            dispatched to their own adapter where one exists.
        feature_map: the feature map of every linearized attention (a
            registered name, a config, or a `FeatureMap` whose config each
            layer copies). Default ``"hedgehog"``: as in LoLCATs, separate
            query and key maps (``share_qk=False``), each the identity at
            start.
        window_size: the softmax window W of causal attention, or None for
            linear attention alone. The window is causal: a non-causal
            attention (encoder self-attention, cross-attention) needs
            ``window_size=None``. Default 64.
        **attention_kwargs: further `LinearAttention` arguments (e.g.
            ``chunk_size``, ``conv_size``, ``epsilon``). ``conv_size``
            defaults to None here (not `LinearAttention`'s 4): a fresh
            random convolution would change the teacher's function, and
            the student must compute it where the window covers the
            sequence. With a window, ``window_gamma`` defaults to
            `DEFAULT_WINDOW_GAMMA` (0.9; LoLCATs starts at 0.1, which ended
            worse on both example teachers: docs/linearize.md, "Window
            gamma"), the learnable per-head weight of the softmax terms; it
            cancels when the window covers the sequence. ``linear_weight`` starts the learned weight
            of the linear terms: default None (1) with the window alone,
            `LOLA_LINEAR_WEIGHT` (0.001) with a ``cache_size`` (LoLA is used
            without training; at weight 1 the linear terms of a long past
            average the window's and the cache's sharp matches away: docs/recurrences.md, "The
            linear weight"). ``dtype=`` is the student's dtype policy
            (every rebuilt layer's, e.g. ``"mixed_bfloat16"``); by default
            each layer keeps its teacher layer's.

    Returns:
        A new Keras model of the teacher's kind.

    Raises:
        TypeError: for a teacher no adapter supports (e.g. a subclassed model).
        ValueError: for a model without MultiHeadAttention (attention held
            inside another layer, e.g. keras-hub's `TransformerDecoder`, is
            named with what is supported), attention this
            layer cannot reproduce (an ``attention_mask``, attention scores
            returned, ``attention_axes`` other than the sequence,
            ``use_gate``, ``sliding_window``), or a window on non-causal
            attention.

    Example:

    >>> import keras
    >>> import numpy as np
    >>> import keras_linattn
    >>> inputs = keras.Input((8, 16))
    >>> attention = keras.layers.MultiHeadAttention(2, 8)
    >>> teacher = keras.Model(inputs, attention(inputs, inputs, use_causal_mask=True))
    >>> student = keras_linattn.linearize(teacher, window_size=8)
    >>> x = np.random.default_rng(0).normal(size=(1, 8, 16)).astype("float32")
    >>> bool(np.allclose(student(x), teacher(x), atol=1e-5))
    True
    """
    if isinstance(feature_map, str) and feature_map == "hedgehog":
        # LoLCATs: separate query and key maps, each the identity at start.
        feature_map = feature_maps.get("hedgehog", share_qk=False)
    # No short convolution unless asked for: a random one would break the copy's exactness (see above).
    attention_kwargs.setdefault("conv_size", None)
    if window_size is not None:
        attention_kwargs.setdefault("window_gamma", DEFAULT_WINDOW_GAMMA)
        if attention_kwargs.get("cache_size") is not None:
            attention_kwargs.setdefault("linear_weight", LOLA_LINEAR_WEIGHT)
    return _adapter(teacher)(teacher, feature_map=feature_map, window_size=window_size, **attention_kwargs)
