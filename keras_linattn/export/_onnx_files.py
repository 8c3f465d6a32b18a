"""What an exported ONNX graph names and proves: its metadata, its external data file, its companions.

`export_onnx` records, in each graph's ``keras_linattn`` metadata, the
export id, the external data file the graph reads (``data_file``: a name
unique to the export) and the size and sha256 of every file the graph
names (``digests``: the data file, and for the model and the step graph the
companion graphs written before them). The runtime front ends check these
at load (`check_graph`, `check_companion`):

- ``verify="fast"`` (default): the data file exists, its 4 KiB header
  names the graph's export and its size is the one recorded; a companion
  graph carries the same export id. A few small reads.
- ``verify="full"``: also the sha256 of the data file and of the companion
  graphs (one read of each file).

Exports written before the digests (no ``data_file`` in the metadata) are
checked by header and by the extent of their external tensors.

This module imports no TensorFlow or Keras: `OnnxPredictor` and
`OnnxGenerator` load through it.
"""

import json
import os
import re

from keras_linattn import _atomic

__all__ = []

METADATA_KEY = "keras_linattn"
# External data: a header of ALIGN bytes naming the export, then each tensor at a multiple of ALIGN.
DATA_MAGIC = b"keras_linattn external data\n"
ALIGN = 4096
VERIFY_MODES = ("fast", "full")
_ID_CHARS = 16  # export id characters in a data file's name
_CHUNK = 1 << 20
# ModelProto.metadata_props is field 14; StringStringEntryProto has key = 1, value = 2.
_METADATA_FIELD = 14


def check_verify(verify):
    """`verify` checked: ``"fast"`` or ``"full"``."""
    if not isinstance(verify, str) or verify not in VERIFY_MODES:
        raise ValueError(f"`verify` must be one of {VERIFY_MODES}. Received: verify={verify!r}")
    return verify


def data_file_name(owner, export_id):
    """The external data file of the graphs beside `owner` (a graph's file name): unique to the export."""
    return f"{owner}.{export_id[:_ID_CHARS]}.data"


def is_data_file_of(name, owner):
    """Whether `name` is an external data file `export_onnx` writes for `owner` (this or an earlier version)."""
    return name == f"{owner}.data" or bool(re.fullmatch(re.escape(owner) + r"\.[0-9a-f]{%d}\.data" % _ID_CHARS, name))


# ------------------------------------------------------------------ metadata
def _varint(f, end, path):
    shift = result = 0
    while True:
        if f.tell() >= end:
            raise _truncated(path, "graph")
        byte = f.read(1)[0]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError(f"`path` is not a valid ONNX file (a malformed field). Received: path={path!r}")


def _truncated(path, what):
    return ValueError(
        f"The ONNX {what} file {path!r} is truncated (it ends inside a field): a partial copy or an interrupted "
        f"write; copy or export it again. Received: path={path!r}"
    )


def _entry(raw):
    """``(key, value)`` of a serialized StringStringEntryProto."""
    out, i = {}, 0
    while i < len(raw):
        tag, i = _decode_varint(raw, i)
        length, i = _decode_varint(raw, i)
        out[tag >> 3] = raw[i : i + length].decode("utf-8", errors="replace")
        i += length
    return out.get(1), out.get(2)


def _decode_varint(raw, i):
    shift = result = 0
    while True:
        byte = raw[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def read_metadata(path):
    """The keras_linattn metadata of an ONNX file ({} for other files), without parsing the graph.

    The top-level fields of the ``ModelProto`` are walked and skipped by
    length (a graph with its weights inside is not read), to its end: a
    file cut inside a field is named as truncated.

    Raises:
        ValueError: naming the file, when it is missing, truncated or not
            an ONNX file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be an existing .onnx file. Received: path={path!r}")
    found = None
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        while f.tell() < end:
            tag = _varint(f, end, path)
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                _varint(f, end, path)
            elif wire in (1, 5):
                f.seek(8 if wire == 1 else 4, 1)
            elif wire == 2:
                length = _varint(f, end, path)
                if f.tell() + length > end:
                    raise _truncated(path, "graph")
                if field == _METADATA_FIELD and found is None:
                    key, value = _entry(f.read(length))
                    if key == METADATA_KEY:
                        found = value
                else:
                    f.seek(length, 1)
            else:
                raise ValueError(f"`path` is not a valid ONNX file (wire type {wire}). Received: path={path!r}")
        if f.tell() > end:
            raise _truncated(path, "graph")
    if found is None:
        return {}
    try:
        return json.loads(found)
    except ValueError as e:
        raise ValueError(
            f"The ONNX file's {METADATA_KEY} metadata is not valid JSON ({e}). Received: path={path!r}"
        ) from e


def read_data_header(path):
    """The export id in an external data file's header, or None if it has none."""
    with open(path, "rb") as f:
        head = f.read(ALIGN)
    if not head.startswith(DATA_MAGIC):
        return None
    line = head[len(DATA_MAGIC) :].split(b"\n", 1)[0].decode(errors="replace")
    return line.split("=", 1)[1] if line.startswith("export_id=") else None


def sha256(path):
    """The sha256 hex digest of a file."""
    return _atomic.file_sha256(path, _CHUNK)


# ------------------------------------------------------------------ checks
def _external_extents(path):
    """``{location: bytes needed}`` of the external tensors of a graph (exports without recorded digests)."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    extents = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        extents[info["location"]] = max(extents.get(info["location"], 0), end)
    return extents


def check_graph(path, verify="fast", metadata=None):
    """Checks the external data a graph written by `export_onnx` reads; returns the graph's metadata.

    Args:
        path: the ``.onnx`` file.
        verify: ``"fast"`` (header and size) or ``"full"`` (also sha256).
        metadata: the graph's metadata when already read.

    Raises:
        ValueError: naming the data file, when it is missing, from another
            export, truncated, longer than written or (``"full"``) altered.
    """
    path = os.fspath(path)
    verify = check_verify(verify)
    meta = read_metadata(path) if metadata is None else metadata
    if not meta.get("external_data"):
        return meta
    export_id = meta.get("export_id")
    directory = os.path.dirname(os.path.abspath(path))
    if meta.get("data_file"):
        name = meta["data_file"]
        expected = meta.get("digests", {}).get(name, {})
        needed = {name: expected.get("size")}
    else:
        expected, needed = {}, _external_extents(path)
    for name, size in sorted(needed.items()):
        data = os.path.join(directory, *name.split("/"))
        _check_data_file(path, data, export_id, size, exact=bool(meta.get("data_file")))
        if verify == "full" and expected.get("sha256") and sha256(data) != expected["sha256"]:
            raise ValueError(
                f"The external data {data!r} of the ONNX graph {path!r} is corrupted: its sha256 differs from the "
                f"one recorded at export (a flipped bit, or an edited file). Export again or restore the file. "
                f"Received: path={path!r}"
            )
    return meta


def _check_data_file(graph, data, export_id, size, exact):
    if not os.path.isfile(data):
        raise ValueError(
            f"The ONNX graph {graph!r} keeps its weights in {os.path.basename(data)!r}, which is missing (a killed "
            f"or partly copied export, or a newer export replaced it while this one loaded): load again, export "
            f"again, or copy the .data file beside the graph. Received: path={graph!r}"
        )
    found = read_data_header(data)
    if found != export_id:
        raise ValueError(
            f"The external data {data!r} comes from another export than the graph {graph!r} (export ids {found} "
            f"and {export_id}): files of two exports were mixed; export again. Received: path={graph!r}"
        )
    got = os.path.getsize(data)
    if size is not None and (got < size or (exact and got != size)):
        kind = "truncated (incomplete)" if got < size else "longer than written"
        raise ValueError(
            f"The external data {data!r} of the ONNX graph {graph!r} is {kind}: {got} of {size} bytes (a partial "
            f"copy or an interrupted write); copy or export it again. Received: path={graph!r}"
        )


def check_companion(path, meta, kind, companion, verify="fast"):
    """Checks that the `kind` graph at `companion` comes from the export of the graph at `path`.

    Args:
        path: the graph that names the companion (its metadata is `meta`).
        kind: ``"step"`` or ``"generate"``.
        companion: the companion's path.
        verify: ``"full"`` also compares its sha256 with the one `meta` recorded.

    Returns:
        The companion's metadata.

    Raises:
        ValueError: naming the companion, when it is missing, from another
            export, or (``"full"``) not the file that was exported.
    """
    relative = meta.get(f"{kind}_file")
    if not os.path.isfile(companion):
        raise ValueError(
            f"The ONNX {kind} graph is missing: {path!r} was exported with its {kind} graph "
            f"{relative or os.path.basename(companion)!r}, which is not there (a killed export?); "
            f"export again. Received: path={companion!r}"
        )
    companion_meta = read_metadata(companion)
    own, other = meta.get("export_id"), companion_meta.get("export_id")
    if own != other:
        raise ValueError(
            f"The ONNX {kind} graph {companion!r} comes from another export than {path!r} (export ids {other} "
            f"and {own}): an export was interrupted between the files, or another export replaced one of them; "
            f"export (or load) again. Received: path={companion!r}"
        )
    expected = meta.get("digests", {}).get(relative) if relative else None
    named = relative and os.path.abspath(companion) == os.path.join(
        os.path.dirname(os.path.abspath(path)), *relative.split("/")
    )
    if verify == "full" and expected and named:
        got = os.path.getsize(companion)
        if got != expected["size"] or sha256(companion) != expected["sha256"]:
            raise ValueError(
                f"The ONNX {kind} graph {companion!r} is not the file exported with {path!r}: its size or sha256 "
                f"differs from the one recorded ({got} of {expected['size']} bytes). Export again or restore it. "
                f"Received: path={companion!r}"
            )
    return companion_meta
