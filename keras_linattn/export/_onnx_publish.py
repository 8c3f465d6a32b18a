"""Writing and publishing the graphs of one `export_onnx` call: a set that no reader sees mixed.

Everything is written in full first, in a staging directory beside each
target (`keras_linattn._atomic`):

1. the external data file, one per directory, under a name unique to the
   export (``<model file>.<export id>.data``), with a header naming the
   export; its size and sha256 are computed as it is written;
2. the graphs, each after the files it names: the generate graph, then the
   step graph (which names the generate graph), then the model (which names
   both). Each graph's metadata records the export id, its data file and the
   size and sha256 of the files it names (`_onnx_files`).

Then, holding an exclusive lock on each target directory, the files are
renamed into place in the same order (data, generate, step, model) and the
data files of earlier exports of the same model are removed. So:

- a graph never reads another export's weights: the data name it holds is
  its export's own, and an earlier export's data file stays until the graphs
  that read it are replaced;
- a reader that starts from a newly published graph finds the files it names
  already published; one that pairs an old graph with a new companion is
  refused at load (export ids, `check_companion`);
- two writers into the same place publish one after the other, whole: the
  last one wins.

A killed writer leaves at most an orphaned data file (removed by the next
export) and its staging directory (removed by the next writer there).
"""

import contextlib
import hashlib
import json
import os
import sys

import numpy as np

from keras_linattn import _atomic
from keras_linattn.export import _onnx_files

__all__ = []

# The order graphs are written and published in: each after the graphs it names.
_ORDER = ("generate", "step", "model")
# Which companions each graph names in its metadata (``<kind>_file``).
_NAMES = {"model": ("step", "generate"), "step": ("generate",), "generate": ()}


class _DigestingFile:
    """A binary file that keeps the size and sha256 of what is written to it."""

    def __init__(self, f):
        self._f, self._hash, self.size = f, hashlib.sha256(), 0

    def write(self, data):
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def tell(self):
        return self.size

    def digest(self):
        return {"size": self.size, "sha256": self._hash.hexdigest()}


# The most bytes of one weight held in memory while it is written: a weight is copied out of its
# variable in slices of whole rows up to this size (a 1B model's tied embedding is 1 GiB).
CHUNK_BYTES = 1 << 26


def weight_chunks(variable, limit=None):
    """The values of `variable` as C-contiguous arrays of whole rows, each at most `limit` bytes (`CHUNK_BYTES`).

    A row larger than `limit` is one chunk; a scalar is one chunk. The
    chunks' bytes, in order, are the bytes of ``variable.numpy()``.
    """
    limit = CHUNK_BYTES if limit is None else limit
    shape = tuple(variable.shape)
    if not shape or shape[0] <= 1:
        yield np.ascontiguousarray(variable.numpy())
        return
    row = int(np.prod(shape[1:])) * np.dtype(str(variable.dtype)).itemsize
    step = max(1, limit // max(row, 1))
    if step >= shape[0]:
        yield np.ascontiguousarray(variable.numpy())
        return
    for start in range(0, shape[0], step):
        yield np.ascontiguousarray(np.asarray(variable[start : start + step]))


def _byte_view(chunk):
    return memoryview(chunk.reshape(-1).view(np.uint8))  # the array's own buffer: no second copy


def weight_tensor(variable, name, layout=None):
    """The initializer of one weight: its values, or (`layout`) a pointer into the external data file."""
    from onnx import TensorProto, helper, numpy_helper

    if layout is None:
        return numpy_helper.from_array(np.ascontiguousarray(variable.numpy()), name)
    index_offset, length = layout["__index__"][name]
    tensor = TensorProto(name=name, dims=list(variable.shape))
    tensor.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(str(variable.dtype)))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", layout["__file__"]), ("offset", str(index_offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_header(message, field, length):
    """The wire-format key and length of a length-delimited `field` of `message` (a protobuf class)."""
    number = message.DESCRIPTOR.fields_by_name[field].number
    return _varint(number << 3 | 2) + _varint(length)


def _streamable(variable):
    """Whether `from_array` stores the weight's values as its raw little-endian bytes (no packing, no strings)."""
    from onnx import TensorProto, helper

    if sys.byteorder != "little":
        return False
    packed = {"STRING", "INT4", "UINT4", "FLOAT4E2M1", "UINT2", "INT2", "FLOAT6E2M3", "FLOAT6E3M2"}
    try:
        data_type = helper.np_dtype_to_tensor_dtype(np.dtype(str(variable.dtype)))
    except (KeyError, TypeError, ValueError):
        return False
    return all(data_type != getattr(TensorProto, name, None) for name in packed)


def write_initializer(f, variable, name):
    """Writes one ``ModelProto`` holding the weight as an initializer, its values one slice at a time.

    The bytes are those of ``SerializeToString()`` of a ``ModelProto`` whose
    graph holds ``numpy_helper.from_array(variable.numpy(), name)``: the
    tensor's other fields (dims, data type, name; field numbers below
    ``raw_data``'s) and then ``raw_data``, written from `weight_chunks`, so
    no whole copy of the weight (or of its serialized form) is made.
    """
    from onnx import GraphProto, ModelProto, TensorProto, helper

    if not _streamable(variable):
        piece = ModelProto()
        piece.graph.initializer.append(weight_tensor(variable, name))
        f.write(piece.SerializeToString())
        return
    header = TensorProto(dims=list(variable.shape) or [1])  # as `from_array(np.ascontiguousarray(...))`: ndim >= 1
    if name:
        header.name = name
    header.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(str(variable.dtype)))
    nbytes = int(np.prod(variable.shape)) * np.dtype(str(variable.dtype)).itemsize
    tensor = header.SerializeToString() + _field_header(TensorProto, "raw_data", nbytes)
    graph = _field_header(GraphProto, "initializer", len(tensor) + nbytes)
    f.write(_field_header(ModelProto, "graph", len(graph) + len(tensor) + nbytes) + graph + tensor)
    for chunk in weight_chunks(variable):
        f.write(_byte_view(chunk))
        del chunk


def save_with_weights(proto, path, used, variables, names, layout=None):
    """Writes `proto` with the used weights as initializers, one slice of one weight in memory at a time.

    The weight inputs leave the graph's inputs. The file is the serialized
    graph followed by one serialized ``ModelProto`` per weight holding just
    that initializer: protobuf parses concatenated messages as one merged
    message (repeated fields append), so this is the same model as one
    `onnx.save` of the graph with every initializer, without ever holding
    the whole serialized model (GPT-2 base: 0.47 GB of weights, twice, per
    graph) in memory. Inline values are written slice by slice
    (`write_initializer`); with `layout`, each initializer points into the
    external data file.

    Returns:
        ``{"size": bytes, "sha256": hex}`` of the file.
    """
    from onnx import ModelProto

    weight_set = {names[i] for i in used}
    kept = [graph_input for graph_input in proto.graph.input if graph_input.name not in weight_set]
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    with open(path, "wb") as raw:
        f = _DigestingFile(raw)
        f.write(proto.SerializeToString())
        for i in used:
            if layout is None:
                write_initializer(f, variables[i], names[i])
                continue
            piece = ModelProto()
            piece.graph.initializer.append(weight_tensor(variables[i], names[i], layout))
            f.write(piece.SerializeToString())
            del piece
        raw.flush()
        os.fsync(raw.fileno())
    return f.digest()


def write_external_data(path, variables, used, export_id):
    """Writes the used weights, aligned, after a header naming the export, one slice of one weight at a time.

    Returns:
        ``({index: (offset, length)}, {"size": bytes, "sha256": hex})``.
    """
    layout = {}
    align = _onnx_files.ALIGN
    with open(path, "wb") as raw:
        f = _DigestingFile(raw)
        header = _onnx_files.DATA_MAGIC + f"export_id={export_id}\n".encode()
        f.write(header.ljust(align, b"\0"))
        for i in used:
            offset = f.tell()
            for chunk in weight_chunks(variables[i]):
                f.write(_byte_view(chunk))
                del chunk
            layout[i] = (offset, f.tell() - offset)
            f.write(b"\0" * (-f.tell() % align))
        raw.flush()
        os.fsync(raw.fileno())
    return layout, f.digest()


def _set_metadata(proto, **updates):
    for entry in proto.metadata_props:
        if entry.key == _onnx_files.METADATA_KEY:
            meta = json.loads(entry.value)
            meta.update(updates)
            entry.value = json.dumps(meta)
            return


def _parent(path):
    return os.path.dirname(os.path.abspath(path))


def _relative(target, origin):
    return os.path.relpath(os.path.abspath(target), _parent(origin)).replace(os.sep, "/")


@contextlib.contextmanager
def _locked(parents):
    """Exclusive locks on the target directories, taken in one order (two writers cannot deadlock)."""
    with contextlib.ExitStack() as stack:
        for parent in sorted(parents):
            stack.enter_context(_atomic.locked_dir(parent))
        yield


def publish(protos, used, targets, variables, names, external, export_id, say):
    """Stages every graph (and its external data) beside its target, then publishes the set under a lock.

    Returns:
        `targets`, plus ``"data"`` (the external data files) with `external`.
    """
    written = dict(targets)
    with contextlib.ExitStack() as stack:
        staging = {}  # parent directory -> staging directory
        for kind in targets:
            parent = _parent(targets[kind])
            if parent not in staging:
                staging[parent] = stack.enter_context(_atomic.staging_dir(parent))
        data_files = _stage_external_data(staging, targets, used, variables, names, export_id, say) if external else {}
        staged = _stage_graphs(protos, used, targets, staging, data_files, variables, names)
        owners = {parent: os.path.basename(targets[_owner(targets, used, parent)]) for parent in staging}
        with _locked(staging):
            for entry in data_files.values():
                _atomic.publish(entry["staged"], entry["target"])
                _atomic.fault_point("onnx:data_published")
            for kind in _ORDER:
                if kind in staged:
                    _atomic.publish(staged[kind], targets[kind])
                    _atomic.fault_point(f"onnx:{kind}_published")
            for parent, owner in owners.items():
                keep = data_files[parent]["name"] if parent in data_files else None
                _remove_old_data(parent, owner, keep)
            _atomic.fault_point("onnx:old_data_removed")
    if external:
        written["data"] = [entry["target"] for entry in data_files.values()]
    return written


def _owner(targets, used, parent):
    kinds = [kind for kind in used if _parent(targets[kind]) == parent]
    return "model" if "model" in kinds else kinds[0]


def _stage_external_data(staging, targets, used, variables, names, export_id, say):
    """Writes one external data file per directory (the weights its graphs use) into its staging directory.

    Returns:
        ``{directory: {"name", "staged", "target", "layout", "digest"}}``.
    """
    data_files = {}
    for parent, tmp in staging.items():
        kinds = [kind for kind in used if _parent(targets[kind]) == parent]
        name = _onnx_files.data_file_name(os.path.basename(targets[_owner(targets, used, parent)]), export_id)
        union = sorted(set().union(*(used[kind] for kind in kinds)))
        say(f"writing {len(union)} weights to {os.path.join(parent, name)}")
        staged = os.path.join(tmp, name)
        offsets, digest = write_external_data(staged, variables, union, export_id)
        layout = {"__file__": name, "__index__": {names[i]: offsets[i] for i in union}}
        data_files[parent] = {
            "name": name,
            "staged": staged,
            "target": os.path.join(parent, name),
            "layout": layout,
            "digest": digest,
        }
        _atomic.fault_point("onnx:data_staged")
    return data_files


def _stage_graphs(protos, used, targets, staging, data_files, variables, names):
    """Writes each graph into its staging directory, after the graphs it names; returns ``{kind: staged file}``."""
    staged, digests = {}, {}
    for kind in _ORDER:
        if kind not in protos:
            continue
        parent = _parent(targets[kind])
        entry = data_files.get(parent)
        recorded = {}
        if entry is not None:
            recorded[entry["name"]] = entry["digest"]
        for companion in _NAMES[kind]:
            if companion in digests:
                recorded[_relative(targets[companion], targets[kind])] = digests[companion]
        updates = {"digests": recorded}
        if entry is not None:
            updates["data_file"] = entry["name"]
        _set_metadata(protos[kind], **updates)
        staged[kind] = os.path.join(staging[parent], f"{kind}.onnx")
        layout = entry["layout"] if entry is not None else None
        digests[kind] = save_with_weights(protos[kind], staged[kind], used[kind], variables, names, layout)
        protos[kind] = None  # the graph is on disk: free it before the next one is serialized
        _atomic.fault_point(f"onnx:{kind}_staged")
    return staged


def _remove_old_data(parent, owner, keep):
    """Removes the external data files that earlier exports of `owner` left in `parent` (not `keep`)."""
    for name in os.listdir(parent):
        if name == keep or not _onnx_files.is_data_file_of(name, owner):
            continue
        path = os.path.join(parent, name)
        try:
            if _onnx_files.read_data_header(path) is not None:  # only files this package wrote
                os.remove(path)
        except (FileNotFoundError, IsADirectoryError):
            continue
    _atomic.fsync_dir(parent)
