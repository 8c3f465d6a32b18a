"""Grappler without a fake copy of the weights, for the ONNX conversion.

`onnx_export._convert` traces every weight as a ``Placeholder`` of fixed
shape named ``kla_weight_<i>`` (the converted graph holds no weight values).
tf2onnx's `from_function` runs Grappler on that graph twice (the function
inlining of ``convert_variables_to_constants_v2``, then its own
``tf_optimize``), and Grappler's item builder (``grappler_item_builder.cc``)
allocates and fills a fake input tensor of the placeholder's shape for every
``Placeholder`` it finds, whether or not anything reads it. For this graph
that is one whole copy of the weights per Grappler call. The optimizers run
here (constant folding, function inlining, dependency) never read a fed
value.

Where the memory goes, not only how much: with oneDNN on (TensorFlow's
default on x86), TensorFlow's CPU allocator is ``MklCPUAllocator``, which
serves large buffers from a BFC pool that grows and is never returned to the
system, so the fake weights' memory stayed in the process after the export
(the weights' bytes again, reused only by later TensorFlow allocations).

`weights_without_fake_inputs` hides the weights' shapes from the item builder
for the duration of a conversion: in the graph handed to Grappler, each
weight placeholder's ``shape`` attribute is unknown (rank included), so its
fake input is a scalar; in what Grappler returns, each gets its shape back,
so the rest of tf2onnx's pipeline sees the graph it always saw. Grappler
optimizes the same graph either way: a placeholder is fed, and the constant
folding run here (not in its aggressive mode) infers shapes without trusting
fed inputs (``assume_valid_feeds=false``: a fed port's shape is unknown, in
``graph_properties.cc``), so the shape attribute it no longer sees was never
used. (A weight given as a ``PlaceholderWithDefault``, which the item builder
also skips, is not fed: its shape is trusted and more gets folded, a
different graph.) The graph tf2onnx converts is the same, node for node,
with and without (tested).

tensorflow is imported inside the functions (importing `keras_linattn.export`
stays cheap).
"""

import contextlib
import re
import threading

from keras_linattn import _compat
from keras_linattn.export import _onnx_graph

__all__ = ["weights_without_fake_inputs"]

_WEIGHT = re.compile(re.escape(_onnx_graph.WEIGHT_INPUT).replace(r"\{\}", r"\d+") + "$")
_PATCH_LOCK = threading.RLock()  # re-entrant: a nested use wraps the wrapper, which is harmless


def hide_weights(graph_def):
    """Rewrites `graph_def` in place: each weight ``Placeholder`` gets an unknown-rank ``shape`` attribute.

    Args:
        graph_def: a `GraphDef` whose weight inputs are ``Placeholder`` nodes
            named ``kla_weight_<i>``.

    Returns:
        dict: ``{weight node name: its original shape attribute}``, what
        `restore_weights` puts back.
    """
    hidden = {}
    for node in graph_def.node:
        if node.op == "Placeholder" and _WEIGHT.match(node.name) and "shape" in node.attr:
            shape = node.attr["shape"]
            hidden[node.name] = type(shape)()
            hidden[node.name].CopyFrom(shape)
            shape.shape.Clear()
            shape.shape.unknown_rank = True
    return hidden


def restore_weights(graph_def, hidden):
    """Undoes `hide_weights` on a graph that Grappler returned (in place).

    Args:
        graph_def: the optimized `GraphDef`.
        hidden: what `hide_weights` returned for its input.

    Raises:
        ValueError: when a hidden weight is missing from `graph_def` or is no
            longer a ``Placeholder``.
    """
    found = set()
    for node in graph_def.node:
        if node.name in hidden:
            if node.op != "Placeholder":
                raise ValueError(f"Grappler rewrote the weight input {node.name!r}. Received: op={node.op!r}")
            node.attr["shape"].CopyFrom(hidden[node.name])
            found.add(node.name)
    missing = set(hidden) - found
    if missing:
        raise ValueError(f"Grappler removed weight inputs of the graph. Received: missing={sorted(missing)}")


@contextlib.contextmanager
def weights_without_fake_inputs():
    """Within: Grappler's optimizer call sees no weight placeholder (module docstring).

    Replaces ``tensorflow.python.grappler.tf_optimizer.OptimizeGraph`` (what
    both of tf2onnx's Grappler calls go through) by a wrapper that applies
    `hide_weights` to a copy of the meta graph, calls the original and
    `restore_weights` on its result. Graphs without weight placeholders pass
    through unchanged, so a Grappler call of another thread meanwhile is
    unaffected. Where TensorFlow has no such function, nothing is replaced
    (the conversion is the same, with its fake inputs).
    """
    tf_optimizer = _compat.grappler_tf_optimizer()
    if tf_optimizer is None:  # another layout of TensorFlow's internals: convert as before
        yield
        return
    with _PATCH_LOCK:
        original = tf_optimizer.OptimizeGraph

        def optimize_graph(config_proto, metagraph, *args, **kwargs):
            copy = type(metagraph)()  # a MetaGraphDef
            copy.CopyFrom(metagraph)
            hidden = hide_weights(copy.graph_def)
            if not hidden:
                return original(config_proto, metagraph, *args, **kwargs)
            graph_def = original(config_proto, copy, *args, **kwargs)
            restore_weights(graph_def, hidden)
            return graph_def

        tf_optimizer.OptimizeGraph = optimize_graph
        try:
            yield
        finally:
            tf_optimizer.OptimizeGraph = original
