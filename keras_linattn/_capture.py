"""Finding layers in a model and capturing their calls, with public Python and Keras API only.

Tools shared by attention distillation (`keras_linattn.distill`) and
attention transfer (`keras_linattn.linearization.transfer`):

- `walk_layers(root)`: every layer reachable from `root`, depth-first, each
  once, in a deterministic order. A `keras.Model`'s children are its public
  ``layers`` (graph order for functional and Sequential models, assignment
  order for subclassed ones); any other layer's children are the layers held
  in its attributes (directly, or in lists, tuples and dicts), in attribute
  order — the layers Keras tracks as its sublayers. This reaches attention
  layers nested in blocks, sub-models and subclassed decoders (e.g. a
  keras-hub ``TransformerDecoder``'s ``_self_attention_layer``).
- `CallHooks(layers, around)`: while active, each listed layer's ``call`` is
  wrapped. Keras' ``Layer.__call__`` runs the layer's ``call`` method (the
  method every Keras layer overrides); the wrapper is an instance attribute
  that shadows the class method, and is deleted on exit (also on error).
  It binds the call's arguments to the ``call`` signature and hands them to
  ``around(index, call, arguments)``, which runs (or changes) the call. It
  works for functional, Sequential and subclassed models alike, as long as
  the layer is invoked as ``layer(...)`` on the forward pass (not from
  inside a ``while_loop`` / RNN cell).
- `layer_names(layers)`: one distinct name per chosen layer, for the logs
  (``kl/<name>``, ``mse/<name>``) and the ``{name: value}`` reports.

Keras may trace a layer in a scratch graph (shape inference while
building): only calls in the graph, or the eager context, that was current
when the hooks were installed reach `around`; others run unchanged.
"""

import inspect

import keras
import tensorflow as tf

__all__ = []


def walk_layers(root):
    """Every `keras.layers.Layer` reachable from `root` (root first), depth-first, each once.

    Args:
        root: a Keras layer or model.

    Returns:
        A list of layers.
    """
    found, seen = [], set()

    def children(value):
        if isinstance(value, keras.layers.Layer):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from children(item)
        elif isinstance(value, dict):
            for item in value.values():
                yield from children(item)

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        found.append(layer)
        if isinstance(layer, keras.Model):
            below = list(layer.layers)
        else:
            below = [child for value in vars(layer).values() for child in children(value)]
        for child in below:
            visit(child)

    visit(root)
    return found


def layer_names(layers):
    """One distinct name per layer of `layers`, in order: the layer's name, suffixed where it repeats one.

    A name already taken by an earlier layer gets ``_<i>`` appended, ``i``
    the layer's index in `layers`, again until the result is new: layers
    ``[a, a, a]`` are named ``[a, a_1, a_2]``, and ``[a_2, a, a]``
    ``[a_2, a, a_2_2]``. Layers from different models can share a name.

    Args:
        layers: a list of Keras layers.

    Returns:
        A list of strings, one per layer, all different.
    """
    names = []
    for layer in layers:
        name = layer.name
        while name in names:
            name = f"{name}_{len(names)}"
        names.append(name)
    return names


def _current_graph():
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class CallHooks:
    """Context manager wrapping the ``call`` of some layers (see the module docstring).

    Args:
        layers: the layers to wrap (distinct).
        around: ``around(index, call, arguments)``: ``index`` is the layer's
            position in `layers`, ``call`` the layer's own ``call``,
            ``arguments`` an `inspect.BoundArguments` of the call (defaults
            applied; it may be changed). It returns the call's output,
            usually ``call(*arguments.args, **arguments.kwargs)``.
    """

    def __init__(self, layers, around):
        self.layers = list(layers)
        self.around = around

    def __enter__(self):
        graph = _current_graph()
        for layer in self.layers:
            if "call" in vars(layer):
                raise ValueError(f"Layer {layer.name!r} is already being captured: a layer is hooked once at a time.")
        for index, layer in enumerate(self.layers):
            original = layer.call
            signature = inspect.signature(original)

            def hook(*args, _index=index, _original=original, _signature=signature, **kwargs):
                if _current_graph() is not graph:
                    return _original(*args, **kwargs)
                arguments = _signature.bind(*args, **kwargs)
                arguments.apply_defaults()
                return self.around(_index, _original, arguments)

            object.__setattr__(layer, "call", hook)
        return self

    def __exit__(self, *exc_info):
        for layer in self.layers:
            vars(layer).pop("call", None)
        return False
