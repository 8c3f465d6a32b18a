"""Linearizing a functional or Sequential Keras model built from `keras.layers.MultiHeadAttention`.

The model is rebuilt with `keras.models.clone_model` (``recursive=True``,
so nested functional and Sequential models are rebuilt too):

- ``clone_function`` rebuilds every layer from its config, except a
  `MultiHeadAttention`, which it hands through unchanged as a placeholder;
- ``call_function`` receives each layer with the arguments it is called
  with in the teacher's graph. For a `MultiHeadAttention` it reads
  ``use_causal_mask`` there (a public route to the call's arguments), builds
  the `LinearAttention` that replaces it (the window only where the call is
  causal), and calls that instead: the teacher's layer is never called.

Then every weight is copied: a rebuilt layer's from its teacher layer
(``get_weights`` / ``set_weights``), an attention's q/k/v/o kernels and
biases from the `MultiHeadAttention`'s EinsumDense layers, whose layouts are
the same: ``query/key/value`` kernels ``[dim, H, D]`` (value ``[dim, H, M]``)
with biases ``[H, D]``, the output kernel ``[H, M, out]`` with bias
``[out]``. The teacher is not modified.
"""

import inspect

import keras

from keras_linattn import feature_maps as feature_maps_lib
from keras_linattn._capture import walk_layers
from keras_linattn.layers.linear_attention import LinearAttention

__all__ = []

# The MultiHeadAttention constructor arguments LinearAttention takes as they are.
_SHARED_ARGUMENTS = (
    "num_heads",
    "key_dim",
    "value_dim",
    "dropout",
    "use_bias",
    "output_shape",
    "kernel_initializer",
    "bias_initializer",
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "seed",
)
_PROJECTIONS = ("query_dense", "key_dense", "value_dense", "output_dense")


def is_softmax_attention(layer):
    """Whether `layer` is a `keras.layers.MultiHeadAttention` (softmax attention) to replace."""
    return isinstance(layer, keras.layers.MultiHeadAttention)


def _check_attention_config(layer):
    config = layer.get_config()
    axes = config.get("attention_axes")
    if axes not in (None, 1, (1,), [1]):
        raise ValueError(
            "Only attention over the sequence axis (inputs [B, T, dim]) can be linearized. "
            f"Received: attention_axes={axes!r} in layer {layer.name!r}"
        )
    for name in ("use_gate", "sliding_window"):
        if config.get(name):
            raise ValueError(
                f"`MultiHeadAttention({name}=...)` has no LinearAttention equivalent yet. "
                f"Received: {name}={config[name]!r} in layer {layer.name!r}"
            )
    return config


def _fresh_feature_map(feature_map):
    """A feature-map identifier each attention layer can own (an instance is copied through its config)."""
    if isinstance(feature_map, feature_maps_lib.FeatureMap):
        return feature_maps_lib.serialize(feature_map)
    return feature_map


class _Converter:
    def __init__(self, feature_map, window_size, attention_kwargs):
        # No random short convolution unless asked for: the student computes the teacher's function
        # where the window covers the sequence.
        attention_kwargs = {"conv_size": None, **attention_kwargs}
        # `dtype` is the student's policy: every rebuilt layer's, not the attention's alone.
        self.dtype = attention_kwargs.pop("dtype", None)
        self.feature_map = feature_map
        self.window_size = window_size
        self.attention_kwargs = attention_kwargs
        self.rebuilt = []  # (teacher layer, new layer)
        self.attention = {}  # id(teacher MHA) -> (teacher MHA, LinearAttention, causal)

    def clone_function(self, layer):
        if is_softmax_attention(layer):
            _check_attention_config(layer)
            return layer  # a placeholder: `call_function` builds its replacement
        config = layer.get_config()
        if self.dtype is not None and "dtype" in config and not isinstance(layer, keras.layers.InputLayer):
            config["dtype"] = self.dtype
        new = layer.__class__.from_config(config)
        if isinstance(layer, keras.layers.Layer):  # not a bare operation (e.g. `x + y` in the graph)
            self.rebuilt.append((layer, new))
        return new

    def call_function(self, layer, *args, **kwargs):
        if not is_softmax_attention(layer):
            return layer(*args, **kwargs)
        arguments = inspect.signature(layer.call).bind(*args, **kwargs)
        arguments.apply_defaults()
        call = dict(arguments.arguments)
        if call.get("attention_mask") is not None:
            raise ValueError(
                f"Attention layer {layer.name!r} is called with an `attention_mask`: a full [B, T, S] mask "
                "has no linear-attention equivalent. Use Keras masks (padding) and `use_causal_mask`. "
                "Received: attention_mask"
            )
        if call.get("return_attention_scores"):
            raise ValueError(
                f"Attention layer {layer.name!r} returns its attention scores: linear attention never "
                "forms them. Received: return_attention_scores=True"
            )
        causal = call.get("use_causal_mask", False)
        if not isinstance(causal, bool):
            raise ValueError(
                f"`use_causal_mask` of attention layer {layer.name!r} is not a Python bool, so the "
                f"linearized layer cannot be configured. Received: use_causal_mask={causal!r}"
            )
        if id(layer) in self.attention:
            _, linear, seen_causal = self.attention[id(layer)]
            if seen_causal != causal:
                raise ValueError(
                    f"Attention layer {layer.name!r} is called both causally and not: one linearized layer "
                    f"cannot be both. Received: use_causal_mask={causal!r} and {seen_causal!r}"
                )
        else:
            linear = self._make(layer, causal)
            self.attention[id(layer)] = (layer, linear, causal)
        return linear(
            call["query"],
            call["value"],
            key=call.get("key"),
            query_mask=call.get("query_mask"),
            value_mask=call.get("value_mask"),
            key_mask=call.get("key_mask"),
            use_causal_mask=causal,
            training=call.get("training"),
        )

    def _make(self, layer, causal):
        config = _check_attention_config(layer)
        kwargs = {name: config[name] for name in _SHARED_ARGUMENTS if name in config}
        mechanism = dict(self.attention_kwargs)
        if self.window_size is not None:
            if not causal:
                raise ValueError(
                    f"Attention layer {layer.name!r} is not causal (use_causal_mask=False): the sliding "
                    "window is a causal recurrence. Pass `window_size=None` to linearize non-causal "
                    f"attention with the feature map alone. Received: window_size={self.window_size!r}"
                )
            mechanism["window_size"] = self.window_size
        return LinearAttention(
            feature_map=_fresh_feature_map(self.feature_map),
            name=layer.name,
            dtype=layer.dtype_policy if self.dtype is None else self.dtype,
            trainable=layer.trainable,
            **kwargs,
            **mechanism,
        )

    def copy_weights(self):
        for old, new in self.rebuilt:
            new.set_weights(old.get_weights())
        for old, linear, _ in self.attention.values():
            for part in _PROJECTIONS:
                source, target = getattr(old, part).weights, getattr(linear, part).weights
                shapes = [tuple(w.shape) for w in source], [tuple(w.shape) for w in target]
                if shapes[0] != shapes[1]:
                    raise ValueError(
                        f"The {part} weights of {old.name!r} do not fit LinearAttention's: "
                        f"Received: shapes {shapes[0]} (teacher) and {shapes[1]} (linear)"
                    )
                for w_source, w_target in zip(source, target, strict=True):
                    w_target.assign(w_source)


def _nested_attention(model):
    """``[(layer of the graph, MultiHeadAttention inside it)]``: attention no graph node exposes."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model) and hasattr(layer, "outputs"):  # a nested functional model
            found.extend(_nested_attention(layer))
        elif not is_softmax_attention(layer):
            found.extend((layer, inner) for inner in walk_layers(layer)[1:] if is_softmax_attention(inner))
    return found


def linearize_functional(teacher, feature_map, window_size, attention_kwargs):
    """`keras_linattn.linearize` for a functional or Sequential model (see the module docstring)."""
    converter = _Converter(feature_map, window_size, attention_kwargs)
    # A Sequential model cannot hold a MultiHeadAttention (it takes two inputs), and
    # clone_model takes no call_function for one: it is rebuilt and found empty.
    call_function = None if isinstance(teacher, keras.Sequential) else converter.call_function
    student = keras.models.clone_model(
        teacher, clone_function=converter.clone_function, call_function=call_function, recursive=True
    )
    if not converter.attention:
        nested = _nested_attention(teacher)
        if nested:
            found = ", ".join(
                f"{outer.name!r} ({type(outer).__name__}) holds {inner.name!r} ({type(inner).__name__})"
                for outer, inner in nested
            )
            raise ValueError(
                "The model calls no keras.layers.MultiHeadAttention in its functional graph; its attention sits "
                f"inside other layers, which `linearize` cannot rewire: {found}. Supported: MultiHeadAttention "
                "layers called as nodes of a functional model, and keras-hub CausalLM or Backbone models of the "
                "families in docs/linearize.md (rebuild the model from MultiHeadAttention layers, or use one). "
                f"Received: teacher={teacher.name!r}"
            )
        raise ValueError(
            "The model has no keras.layers.MultiHeadAttention in its graph to linearize. "
            f"Received: teacher={teacher.name!r}"
        )
    left = [layer for layer in walk_layers(student) if is_softmax_attention(layer)]
    if left:
        raise ValueError(
            "Some MultiHeadAttention layers are not nodes of a functional graph (they sit inside a "
            "subclassed layer or model), so they cannot be replaced generically. "
            f"Received: {[layer.name for layer in left]}"
        )
    converter.copy_weights()
    return student
