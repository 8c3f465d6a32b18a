"""Fingerprints of exported ONNX files that two exports of the same graphs share (to compare two versions).

    python tools/onnx_fingerprint.py DIR_OR_FILE [...]

One line per file: the fingerprint and the path. An export is not byte-reproducible: tf2onnx's node order
and its generated names (nodes, intermediate tensors, the constants it folds or deduplicates) vary from one
conversion of the same graph to the next (docs/dev/history/export.md, "Memory at the 1B shape"). The
fingerprint leaves those out and keeps everything else: every tensor is named by how it is computed (op,
domain, attributes, the fingerprints of its inputs and its output index); graph inputs and outputs by their
names, a Loop body's by their positions; weights by their names and bytes, tf2onnx's own constants by their
bytes. What is unique to one export is left out too: the export id, the names and sha256 digests of the
files a graph links to and the external data's file name (the data file's bytes after its header, where
the export id is, are hashed instead).
"""

import hashlib
import json
import os
import re
import sys

# Metadata fields that name one export rather than the graphs.
_PER_EXPORT = ("export_id", "digests", "data_file")
# tf2onnx names its own constants after a TensorFlow tensor (``...:0``) or with a counter (``...__<n>``); which
# of two equal constants keeps its name varies. A weight's name is its Keras path and has neither.
_GENERATED = re.compile(r"__\d+|:\d+$")
_DATA_HEADER = 4096  # `keras_linattn.export._onnx_files.ALIGN`: the header that names the export


def _h(*parts):
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _tensor(tensor):
    external = sorted((e.key, e.value) for e in tensor.external_data if e.key != "location")
    values = (tensor.raw_data, list(tensor.float_data), list(tensor.int32_data), list(tensor.int64_data))
    return _h(tensor.data_type, list(tensor.dims), values, list(tensor.double_data), list(tensor.string_data), external)


def _attribute(attribute, env):
    from onnx import AttributeProto

    if attribute.type == AttributeProto.GRAPH:
        return attribute.name, _graph(attribute.g, env, body=True)
    if attribute.type == AttributeProto.GRAPHS:
        return attribute.name, [_graph(g, env, body=True) for g in attribute.graphs]
    if attribute.type == AttributeProto.TENSOR:
        return attribute.name, _tensor(attribute.t)
    return attribute.name, attribute.SerializeToString(deterministic=True)


def _graph(graph, outer, body=False):
    """The fingerprint of `graph`; `outer` maps the names of an enclosing graph's tensors to theirs."""
    name = (lambda k, value: k) if body else (lambda k, value: value.name)
    env = dict(outer, **{"": "absent"})
    for k, value in enumerate(graph.input):
        env[value.name] = _h("input", name(k, value), value.type.SerializeToString(deterministic=True))
    for tensor in graph.initializer:
        env[tensor.name] = _h("initializer", _tensor(tensor))
    nodes = []
    for node in graph.node:  # a valid graph lists its nodes in topological order
        key = _h(
            node.op_type, node.domain, sorted(_attribute(a, env) for a in node.attribute), [env[i] for i in node.input]
        )
        nodes.append(key)
        for k, output in enumerate(node.output):
            env[output] = _h(key, k)
    outputs = [
        (name(k, v), env[v.name], v.type.SerializeToString(deterministic=True)) for k, v in enumerate(graph.output)
    ]
    inputs = [(name(k, v), v.type.SerializeToString(deterministic=True)) for k, v in enumerate(graph.input)]
    weights = sorted(("" if _GENERATED.search(t.name) else t.name, _tensor(t)) for t in graph.initializer)
    return _h(sorted(nodes), outputs, inputs, weights)


def fingerprint(path):
    """The fingerprint of one file: an ONNX graph's (module docstring), or a data file's bytes after its header."""
    import onnx

    path = os.fspath(path)
    if not path.endswith(".onnx"):
        with open(path, "rb") as f:
            f.seek(_DATA_HEADER if path.endswith(".data") else 0)
            return hashlib.sha256(f.read()).hexdigest()[:24]
    model = onnx.load(path, load_external_data=False)
    metadata = []
    for entry in sorted(model.metadata_props, key=lambda e: e.key):
        value = entry.value
        try:
            fields = json.loads(value)
            if isinstance(fields, dict):
                value = json.dumps({k: v for k, v in fields.items() if k not in _PER_EXPORT}, sort_keys=True)
        except ValueError:
            pass
        metadata.append((entry.key, value))
    opsets = sorted((o.domain, o.version) for o in model.opset_import)
    return _h(_graph(model.graph, {}), metadata, opsets, model.ir_version, model.producer_name, model.producer_version)


def main(argv=None):
    for root in sys.argv[1:] if argv is None else argv:
        paths = [root] if os.path.isfile(root) else sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
        for path in paths:
            print(fingerprint(path), os.path.relpath(path, root) if path != root else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
