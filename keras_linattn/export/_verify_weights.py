"""The weight checks of `verify`: every weight of the model is stored with exactly its values.

Two kinds of files:

- ONNX files written by this package's `export_onnx` hold each weight once,
  as an initializer named by the weight's Keras path (metadata
  ``"weights": "named"``). Each is compared with its weight by name, bit for
  bit, one weight at a time (a weight in external data is read from the file
  at its offset, not loaded with the rest, and compared one slice of rows at
  a time), so a damaged copy is found wherever it is and memory stays at one
  slice of a weight (a whole weight where it differs, for the detail).
- Other files (SavedModel variables, ONNX files from older exports with
  weights folded into constants) are matched by value: a weight is stored if
  some tensor has its size, dtype and sorted values (a transposed or
  reshaped copy matches). Stored tensors are hashed as they are read and
  dropped; only the weights that match nothing are looked at again.

Each check returns a `WeightCheck`; `check_files` turns those of the files
`verify` was given into report rows.
"""

import hashlib
import os

import numpy as np

from keras_linattn.export import _onnx_publish, onnx_export
from keras_linattn.export._verify_report import _Check


class WeightCheck:
    """The outcome of one file's weight check.

    Attributes:
        total: weights compared.
        missing: ``(path, detail)`` of the weights not stored exactly.
        folded: paths left to the output checks (an older ONNX file stored
            the converter's folded result instead of the weight).
        unused: paths of weights that no graph of the file reads.
        same: paths of the weights stored by name with exactly the model's
            bytes (`check_by_name`; empty for the checks by value).
    """

    def __init__(self, total, missing=(), folded=(), unused=(), same=()):
        self.total = total
        self.missing = list(missing)
        self.folded = list(folded)
        self.unused = list(unused)
        self.same = list(same)

    @property
    def exact(self):
        return self.total - len(self.missing) - len(self.folded) - len(self.unused)

    def detail(self):
        parts = []
        if self.missing:
            path, why = self.missing[0]
            parts.append(f"{path}: {why}" + (f", and {len(self.missing) - 1} more" if len(self.missing) > 1 else ""))
        if self.folded:
            parts.append(
                f"{len(self.folded)} folded by the converter, checked through the outputs ({', '.join(self.folded[:3])}"
                + (", ..." if len(self.folded) > 3 else "")
                + ")"
            )
        if self.unused:
            parts.append(f"{len(self.unused)} not read by this graph")
        return "; ".join(parts)


def model_weights(model, skip_constant=True):
    """``{path: keras.Variable}`` of the model's float weights (read lazily, one at a time).

    With `skip_constant`, weights whose values are all equal are left out: a
    converter may fold them away, so a match by value cannot find them.
    """
    out = {}
    for variable in model.weights:
        if "float" not in str(variable.dtype):
            continue
        if skip_constant:
            value = np.asarray(variable.numpy())
            if value.size == 0 or float(value.max()) == float(value.min()):
                continue
        out[getattr(variable, "path", variable.name)] = variable
    return out


def _is_float(array):
    """Whether `array` holds floats: numpy's kinds, and bfloat16 (an ml_dtypes type numpy files under "V")."""
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


def _value_key(array):
    """Size, dtype and sorted values: equal for a weight stored transposed, reshaped or split nowhere."""
    array = np.asarray(array)
    return array.size, array.dtype.str, hashlib.sha256(np.sort(array, axis=None).tobytes()).hexdigest()


# -------------------------------------------------------------- by value
def saved_model_tensors(version_dir):
    """A callable giving every stored variable of a SavedModel, one at a time."""
    import tensorflow as tf

    def tensors():
        reader = tf.train.load_checkpoint(os.path.join(version_dir, "variables", "variables"))
        for name in reader.get_variable_to_shape_map():
            if "OBJECT_GRAPH" not in name:
                yield reader.get_tensor(name)

    return tensors


def onnx_tensors(path):
    """A callable giving every initializer and constant of an ONNX file, subgraphs (Loop bodies) included."""

    def tensors():
        import onnx
        from onnx import numpy_helper

        proto = onnx.load(path)

        def walk(graph):
            for tensor in graph.initializer:
                yield numpy_helper.to_array(tensor)
            for node in graph.node:
                for attribute in node.attribute:
                    if attribute.type == onnx.AttributeProto.TENSOR:
                        yield numpy_helper.to_array(attribute.t)
                    elif attribute.type == onnx.AttributeProto.GRAPH:
                        yield from walk(attribute.g)
                    elif attribute.type == onnx.AttributeProto.GRAPHS:
                        for sub in attribute.graphs:
                            yield from walk(sub)

        yield from walk(proto.graph)

    return tensors


def check_by_value(weights, tensors, allow_folded=False):
    """Every weight must be some stored tensor, up to layout.

    Args:
        weights: ``{path: variable}`` (`model_weights`).
        tensors: a callable returning an iterator over the stored tensors;
            called once, and once more only if some weight matches nothing.
        allow_folded: a weight none of whose values appear in any tensor of
            its size is reported as folded (ONNX files of older exports
            store ``exp(a)`` instead of ``a``) and left to the output checks.
            A tensor holding at least half of a weight's values but not all
            is that weight, damaged: it fails.
    """
    keys = set()
    for tensor in tensors():
        tensor = np.asarray(tensor)
        if _is_float(tensor):
            keys.add(_value_key(tensor))
    unmatched = {}
    for path, variable in weights.items():
        value = np.asarray(variable.numpy())
        if _value_key(value) not in keys:
            unmatched[path] = value
    closest = {path: None for path in unmatched}
    overlap = {path: 0.0 for path in unmatched}
    if unmatched:
        sizes = {value.size for value in unmatched.values()}
        for tensor in tensors():
            tensor = np.asarray(tensor)
            if not _is_float(tensor) or tensor.size not in sizes:
                continue
            for path, value in unmatched.items():
                if value.size != tensor.size:
                    continue
                gap = float(np.max(np.abs(np.sort(tensor.astype(np.float64), axis=None) - np.sort(value, axis=None))))
                closest[path] = gap if closest[path] is None else min(closest[path], gap)
                overlap[path] = max(overlap[path], float(np.mean(np.isin(value.ravel(), tensor.astype(value.dtype)))))
    missing, folded = [], []
    for path in unmatched:
        if allow_folded and overlap[path] < 0.5:
            folded.append(path)
        elif closest[path] is None:
            missing.append((path, "no tensor of its size"))
        else:
            missing.append(
                (path, f"values differ (max {closest[path]:.3g}; {1 - overlap[path]:.2%} of its values changed)")
            )
    return WeightCheck(len(weights), missing, folded)


# --------------------------------------------------------------- by name
def onnx_has_named_weights(path):
    return onnx_export._read_metadata(path).get("weights") == "named"


def _initializer_reader(path):
    """``{name: callable -> array}`` of a file's top-level initializers; external data read at its offset."""
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(path, load_external_data=False)
    base = os.path.dirname(os.path.abspath(path))
    readers = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            location = os.path.join(base, info["location"])
            offset, length = int(info.get("offset", 0)), int(info["length"])
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            shape = tuple(tensor.dims)

            def read(location=location, offset=offset, length=length, dtype=dtype, shape=shape):
                if not os.path.isfile(location) or os.path.getsize(location) < offset + length:
                    return None
                data = np.fromfile(location, dtype=np.uint8, count=length, offset=offset)
                return data.view(dtype).reshape(shape)

            read.external = (location, offset, length, np.dtype(dtype), shape)
            readers[tensor.name] = read
        else:
            readers[tensor.name] = lambda tensor=tensor: numpy_helper.to_array(tensor)
    return readers


def _equal_in_slices(external, variable):
    """Whether the external data at ``(location, offset, length, dtype, shape)`` holds exactly `variable`'s bytes.

    Read and compared one slice at a time (`_onnx_publish.weight_chunks`): a
    1B model's 1 GiB embedding is never in memory whole, twice. False when
    `external` is None, or when shapes, dtypes or sizes differ.
    """
    if external is None:
        return False
    location, offset, length, dtype, shape = external
    if tuple(shape) != tuple(variable.shape) or dtype != np.dtype(str(variable.dtype)):
        return False
    if not os.path.isfile(location) or os.path.getsize(location) < offset + length:
        return False
    if length != int(np.prod(shape)) * dtype.itemsize:
        return False
    with open(location, "rb") as f:
        f.seek(offset)
        for chunk in _onnx_publish.weight_chunks(variable):
            expected = chunk.reshape(-1).view(np.uint8)
            if not np.array_equal(np.frombuffer(f.read(expected.nbytes), np.uint8), expected):
                return False
    return True


def check_by_name(weights, path):
    """Each weight the file's graph reads, compared bit for bit with the initializer of its name."""
    readers = _initializer_reader(path)
    missing, unused, same = [], [], []
    for name, variable in weights.items():
        read = readers.get(name)
        if read is None:
            unused.append(name)
            continue
        if _equal_in_slices(getattr(read, "external", None), variable):
            same.append(name)
            continue
        stored = read()  # differs, or not external: compared whole, for the detail
        value = np.asarray(variable.numpy())
        if stored is not None and stored.shape == value.shape and stored.dtype == value.dtype:
            if np.array_equal(stored.view(np.uint8), np.ascontiguousarray(value).view(np.uint8)):
                same.append(name)  # an inline weight, stored exactly
                del stored, value
                continue
        if stored is None:
            missing.append((name, "its external data is missing or short"))
        elif stored.shape != value.shape or stored.dtype != value.dtype:
            missing.append(
                (name, f"stored as {stored.dtype}{list(stored.shape)}, not {value.dtype}{list(value.shape)}")
            )
        elif not np.array_equal(stored.view(np.uint8), np.ascontiguousarray(value).view(np.uint8)):
            changed = np.mean(stored != value)
            gap = float(np.nanmax(np.abs(stored.astype(np.float64) - value)))
            missing.append((name, f"values differ (max {gap:.3g}; {changed:.2%} of its values changed)"))
        del stored, value
    return WeightCheck(len(weights), missing, unused=unused, same=same)


# ------------------------------------------------------------ report rows
def _check_weights(report, backend, what, check, say):
    """A report row for a `WeightCheck`."""
    detail = check.detail()
    missing = len(check.missing)
    row = report.add(_Check(backend, f"{what}:weights", (check.total,), missing, missing, 0, exact=True, detail=detail))
    say(
        f"{backend:12s} {what} weights: {check.exact}/{check.total} stored exactly" + (f" ({detail})" if detail else "")
    )
    return row


def _check_onnx_weights(report, model, path, say):
    if onnx_has_named_weights(path):
        check = check_by_name(model_weights(model, skip_constant=False), path)
    else:  # an older export: weights folded into constants, matched by value
        check = check_by_value(model_weights(model), onnx_tensors(path), allow_folded=True)
    _check_weights(report, "onnx", os.path.basename(path), check, say)
    return check


def check_files(run, model, saved_model_dir, onnx_paths):
    """One row per file: the SavedModel's variables (`saved_model_dir`; None: none), then each of `onnx_paths`.

    Returns:
        ``{path: [weight path, ...]}``: for each ONNX file, the weights its
        initializer of that name holds bit for bit (`WeightCheck.same`).
    """
    if saved_model_dir is not None:
        check = check_by_value(model_weights(model), saved_model_tensors(saved_model_dir))
        _check_weights(run.report, "saved_model", "variables", check, run.say)
    same = {}
    for path in onnx_paths:
        if path is not None:
            same[path] = _check_onnx_weights(run.report, model, path, run.say).same
    return same
