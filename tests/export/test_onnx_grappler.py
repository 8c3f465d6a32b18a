"""The ONNX conversion gives Grappler no fake copy of the weights (`keras_linattn.export._onnx_grappler`).

Grappler's item builder allocates and fills a fake input tensor for every
``Placeholder`` of the graph it optimizes, at the placeholder's shape (an
unknown dim counts as 1, an unknown rank as a scalar). The conversion traces
each weight as an input; given to Grappler as a fixed-shape ``Placeholder``,
the weights cost one whole copy of their bytes per Grappler call, which
TensorFlow's CPU allocator then kept. The tests count those bytes on every
graph Grappler receives during `export_onnx` (a spy on the function both of
tf2onnx's Grappler calls go through), check that what Grappler returns to
tf2onnx is the same graph, node for node, with and without the weights' shapes
hidden (on a model that reshapes a weight to its own shape: Grappler drops such
a reshape where it trusts the weight's shape, as it would for a weight given
as a ``PlaceholderWithDefault``, and keeps it for a fed placeholder), and, in a
subprocess, that the export's peak resident memory stays under half the
weights' bytes above where it started.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.grappler import tf_optimizer

from keras_linattn import export
from keras_linattn.export import _onnx_graph, _onnx_grappler, onnx_export

pytestmark = pytest.mark.tf_only("ONNX export runs on TensorFlow")

_DIM, _UNITS = 16, 32
_WEIGHT = re.compile(re.escape(_onnx_graph.WEIGHT_INPUT).replace(r"\{\}", r"\d+") + "$")


class _ShapedDense(keras.layers.Layer):
    """A dense layer that reshapes its kernel to the kernel's own shape and scales its bias by a dim of it."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], _UNITS), initializer="glorot_uniform", name="kernel")
        self.bias = self.add_weight(shape=(_UNITS,), initializer="random_normal", name="bias")

    def call(self, x):
        kernel = tf.reshape(self.kernel, tf.shape(self.kernel))
        return tf.matmul(x, kernel) + self.bias * tf.cast(tf.shape(self.kernel)[0], x.dtype)


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((_DIM,), name="features")
    hidden = _ShapedDense()(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))


def _weight_bytes(model):
    return sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in model.weights)


def _fake_input_bytes(graph_def):
    """Bytes of the fake inputs Grappler's item builder makes for `graph_def` (one per top-level Placeholder)."""
    total = 0
    for node in graph_def.node:
        if node.op not in ("Placeholder", "PlaceholderV2"):
            continue
        shape = node.attr["shape"].shape
        count = 1 if shape.unknown_rank else int(np.prod([max(1, d.size) for d in shape.dim]))
        total += count * tf.as_dtype(node.attr["dtype"].type).size
    return total


def _spy_on_grappler(monkeypatch):
    """Records, for every Grappler call, the graph it receives (what the item builder reads)."""
    seen = []
    original = tf_optimizer.OptimizeGraph

    def spy(config_proto, metagraph, *args, **kwargs):
        seen.append(type(metagraph.graph_def)().FromString(metagraph.graph_def.SerializeToString()))
        return original(config_proto, metagraph, *args, **kwargs)

    monkeypatch.setattr(tf_optimizer, "OptimizeGraph", spy)
    return seen


def test_no_weight_reaches_grappler_as_a_fixed_shape_placeholder(monkeypatch, tmp_path):
    model = _model()
    seen = _spy_on_grappler(monkeypatch)
    export.export_onnx(model, tmp_path / "m.onnx")
    assert len(seen) >= 2, "Grappler was not called (both of tf2onnx's passes go through OptimizeGraph)"
    n_weights = len(model.weights)
    # What is left is the model's input (batch dim unknown: one row of _DIM float32) and one scalar per weight
    # (shape hidden: at most 8 bytes, the widest dtype); a weight given with its shape costs its whole size.
    bound = _DIM * 4 + n_weights * 8
    for graph_def in seen:
        fixed = [
            n.name
            for n in graph_def.node
            if n.op == "Placeholder" and _WEIGHT.match(n.name) and not n.attr["shape"].shape.unknown_rank
        ]
        assert not fixed, f"weight inputs given to Grappler as fixed-shape placeholders: {fixed}"
        fake = _fake_input_bytes(graph_def)
        assert fake <= bound, f"{fake} bytes of fake inputs for {_weight_bytes(model)} bytes of weights"


def _frozen_graphs(model, hide):
    """The graph tf2onnx converts (after both Grappler calls) for `model`'s serving function."""
    from tf2onnx import tf_loader

    variables = onnx_export._export_variables(model)
    signature = [tf.TensorSpec((None, _DIM), tf.float32, name="features")]
    fn, signature = onnx_export._with_weights_as_inputs(lambda x: model(x), signature, variables)
    function = tf.function(fn, input_signature=signature, autograph=False).get_concrete_function(*signature)
    inputs = [t.name for t in function.inputs]
    outputs = [t.name for t in function.outputs]
    with _onnx_grappler.weights_without_fake_inputs() if hide else contextlib.nullcontext():
        return tf_loader.from_function(function, inputs, outputs)


def _nodes(graph_def):
    # Grappler's node order varies from call to call (the same call twice gives two orders): compare by name.
    return sorted(n.SerializeToString(deterministic=True) for n in graph_def.node)


def test_grappler_returns_the_same_graph_with_the_weights_hidden():
    model = _model()
    plain, hidden = _frozen_graphs(model, hide=False), _frozen_graphs(model, hide=True)
    assert _nodes(hidden) == _nodes(plain)
    assert hidden.library.SerializeToString(deterministic=True) == plain.library.SerializeToString(deterministic=True)
    # The no-op reshape of the kernel is kept: Grappler does not trust the shape of a fed input, so hiding it
    # takes nothing from what it folds.
    assert "Reshape" in {n.op for n in plain.node}
    assert {n.name for n in plain.node if n.op == "Placeholder"} == {
        "features",
        *(_onnx_graph.WEIGHT_INPUT.format(i) for i in range(len(model.weights))),
    }


def _graph_with_weights():
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.placeholder(tf.float32, (3, 4), name=_onnx_graph.WEIGHT_INPUT.format(0))
        x = tf.compat.v1.placeholder(tf.float32, (None, 3), name="x")
        tf.matmul(x, w, name="y")
    return graph.as_graph_def()


def test_hide_and_restore_give_back_the_graph():
    graph_def = _graph_with_weights()
    original = graph_def.SerializeToString(deterministic=True)
    hidden = _onnx_grappler.hide_weights(graph_def)
    weight = _onnx_graph.WEIGHT_INPUT.format(0)
    assert list(hidden) == [weight]
    nodes = {n.name: n for n in graph_def.node}
    assert nodes[weight].op == "Placeholder" and nodes[weight].attr["shape"].shape.unknown_rank
    assert _fake_input_bytes(graph_def) == 4 * 3 + 4  # x (one row of 3 float32) and the weight, now a scalar
    _onnx_grappler.restore_weights(graph_def, hidden)
    assert graph_def.SerializeToString(deterministic=True) == original


def test_restore_rejects_a_weight_that_grappler_changed():
    graph_def = _graph_with_weights()
    hidden = _onnx_grappler.hide_weights(graph_def)
    weight = _onnx_graph.WEIGHT_INPUT.format(0)
    for node in graph_def.node:
        if node.name == weight:
            node.op = "Identity"
    with pytest.raises(ValueError, match="rewrote the weight input"):
        _onnx_grappler.restore_weights(graph_def, hidden)
    removed = _graph_with_weights()
    hidden = _onnx_grappler.hide_weights(removed)
    kept = [n for n in removed.node if n.name != weight]
    del removed.node[:]
    removed.node.extend(kept)
    with pytest.raises(ValueError, match="removed weight inputs"):
        _onnx_grappler.restore_weights(removed, hidden)


def test_other_graphs_pass_through_grappler_unchanged(monkeypatch):
    seen = _spy_on_grappler(monkeypatch)
    graph_def = _graph_with_weights()
    for node in graph_def.node:
        if node.op == "Placeholder" and node.name != "x":
            node.name = "w"
    for node in graph_def.node:
        node.input[:] = ["w" if i.startswith("kla_weight") else i for i in node.input]
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def)
    meta.collection_def["train_op"].node_list.value.extend(["x:0", "w:0", "y:0"])  # the fetches, as tf2onnx does
    with _onnx_grappler.weights_without_fake_inputs():
        tf_optimizer.OptimizeGraph(tf.compat.v1.ConfigProto(), meta)
    assert seen[0].SerializeToString(deterministic=True) == meta.graph_def.SerializeToString(deterministic=True)
    assert tf_optimizer.OptimizeGraph.__name__ == "spy"  # the patch is undone on exit


_RSS_CHILD = textwrap.dedent(
    """
    import json, os, sys
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    from keras_linattn import export
    from keras_linattn.export import _onnx_publish
    from benchmarks import _common

    _onnx_publish.CHUNK_BYTES = 1 << 22  # the weights are written in 4 MiB slices: the peak is not one whole weight

    def model(units, layers):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((units,), name="features")
        x = inputs
        for _ in range(layers):
            x = keras.layers.Dense(units, use_bias=False)(x)
        return keras.Model(inputs, x)

    out = sys.argv[1]
    export.export_onnx(model(8, 1), os.path.join(out, "warm.onnx"))  # imports and one-time set-up, not measured
    big = model(int(sys.argv[2]), int(sys.argv[3]))
    weight_bytes = sum(v.numpy().nbytes for v in big.weights)
    start = _common.proc_status_bytes("VmRSS")
    assert _common.reset_peak_rss()
    export.export_onnx(big, os.path.join(out, "big.onnx"), external_data=True)
    print(json.dumps({"weight_bytes": weight_bytes, "peak_growth": _common.proc_status_bytes("VmHWM") - start}))
    """
)


@pytest.mark.slow
def test_export_peak_memory_holds_no_copy_of_the_weights(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS mark")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # 4 square float32 kernels of 4096: 256 MiB of weights in 64 MiB tensors (each above the allocators' mmap
    # and small-allocation thresholds, so a fake copy of them is resident until freed).
    result = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(tmp_path), "4096", "4"],
        capture_output=True,
        text=True,
        cwd=root,
        # TensorFlow's default CPU allocator with oneDNN on pools large buffers and reuses what building the model
        # freed, which hides part of a transient copy from the resident size; the plain allocator (oneDNN off,
        # chosen when TensorFlow loads) maps each fake input afresh, so the peak shows all of it.
        env=dict(os.environ, PYTHONPATH=root, TF_ENABLE_ONEDNN_OPTS="0"),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    # A fake copy of the weights is all of their bytes at once; the export's own work (the traced graphs, the
    # weights written in 4 MiB slices) is far below half of them.
    assert row["peak_growth"] < row["weight_bytes"] / 2, row
