"""OnnxPredictor: an onnxruntime session with input checks and GPU I/O binding."""

import json
import os

import numpy as np

from keras_linattn import _validation
from keras_linattn._validation import check_non_negative_int
from keras_linattn.export import _onnx_files, _providers

__all__ = ["OnnxPredictor"]

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _kind(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return "integer"
    if dtype.kind == "f":
        return "floating"
    if dtype.kind == "b":
        return "bool"
    return dtype.kind


class OnnxPredictor:
    """Runs an exported ONNX graph with onnxruntime on the best device.

    The session asks for the CUDA provider (and TensorRT if
    ``use_tensorrt``) only when a GPU is visible and the provider's CUDA
    libraries load, so a CPU-only machine gets the CPU provider without
    error logs. On GPU, inputs and outputs go through I/O binding; decoding
    state can stay on the device between calls (`run_bound`).

    Args:
        path: an ``.onnx`` file (from `keras_linattn.export.export_onnx`).
        device: ``"auto"`` (default), ``"cpu"`` or ``"gpu"``.
        use_tensorrt: put the TensorRT provider first when usable.
        use_io_binding: bind inputs/outputs explicitly; default: on GPU only.
        intra_op_num_threads: threads of one op (default: onnxruntime's,
            one per physical core).
        allow_spinning: let idle worker threads spin-wait. Off by default:
            spinning shaves microseconds on a dedicated host but costs far
            more when cores are shared (2x slower in our measurements on a
            loaded machine). Ignored when `session_options` is given.
        prepacking: let onnxruntime's CPU kernels keep a repacked copy of
            the constant weights (its default). False sets
            ``session.disable_prepacking``: one copy of the weights instead
            of two where onnxruntime keeps both (a 1B model's step and
            generate sessions in one process: an 11.0 instead of a 17.3 GiB
            peak, at the same decode speed). Ignored when
            `session_options` is given.
        session_options: optional `onnxruntime.SessionOptions` (used as is).
        verify: what is checked at load, for graphs written by
            `export_onnx` with external data: ``"fast"`` (default) the data
            file exists, its header names the graph's export and its size
            is the one recorded; ``"full"`` also its sha256 (one read of
            the file). A mismatch is a ValueError naming the file.

    Call arguments:
        inputs: a dict of input name -> array, a list in input order, or a
            single array for single-input graphs. Arrays are checked against
            the graph's rank, fixed dims and dtype kind (an integer input
            refuses floats and vice versa; float64 is cast to float32, int64
            to int32, after a check that the integers fit: ids >= 2**31 are
            refused, not wrapped). A model graph's sequence inputs must
            hold at least one token per row.

    Returns:
        dict of output name -> numpy array.

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> from keras_linattn import export, layers
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((None, 16), name="features")
    >>> model = keras.Model(inputs, layers.LinearAttention(2, 8, name="head")(inputs, inputs))
    >>> paths = export.export_onnx(model, os.path.join(tempfile.mkdtemp(), "encoder.onnx"))
    >>> predictor = OnnxPredictor(paths["model"], device="cpu")
    >>> predictor.provider
    'CPUExecutionProvider'
    >>> x = np.random.default_rng(0).normal(size=(2, 100, 16)).astype("float32")  # [B, T, width]
    >>> y = predictor({"features": x})["head"]
    >>> y.shape, bool(np.allclose(y, model.predict(x, verbose=0), atol=1e-4))
    ((2, 100, 16), True)
    """

    def __init__(
        self,
        path,
        device="auto",
        use_tensorrt=False,
        use_io_binding=None,
        intra_op_num_threads=None,
        allow_spinning=False,
        session_options=None,
        prepacking=True,
        verify="fast",
    ):
        import onnxruntime as ort

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"`path` must be an existing .onnx file. Received: path={path!r}")
        self.path = path
        self.verify = _onnx_files.check_verify(verify)
        self._metadata = _onnx_files.check_graph(path, self.verify)  # before the session: its errors are cryptic
        self.device = device
        self.use_tensorrt = use_tensorrt
        self.requested_providers = _providers.select_providers(device, use_tensorrt=use_tensorrt)
        if intra_op_num_threads is not None:  # 0 = onnxruntime's default
            intra_op_num_threads = check_non_negative_int("intra_op_num_threads", intra_op_num_threads)
        self.intra_op_num_threads = intra_op_num_threads
        self.allow_spinning = bool(allow_spinning)
        self.prepacking = _validation.check_bool("prepacking", prepacking)
        options = session_options
        if options is None:
            options = ort.SessionOptions()
            if intra_op_num_threads:
                options.intra_op_num_threads = intra_op_num_threads
            spin = "1" if allow_spinning else "0"
            options.add_session_config_entry("session.intra_op.allow_spinning", spin)
            options.add_session_config_entry("session.inter_op.allow_spinning", spin)
            if not self.prepacking:
                options.add_session_config_entry("session.disable_prepacking", "1")
        try:
            self.session = ort.InferenceSession(path, sess_options=options, providers=self.requested_providers)
        except Exception as e:  # onnxruntime raises its own classes (InvalidProtobuf, Fail, ...)
            _onnx_files.check_graph(path, "fast")  # a data file replaced while loading is named
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"`path` is not a loadable ONNX model ({type(e).__name__}: {reason}). Received: path={path!r}"
            ) from e
        _check_loaded(self.session, self._metadata, path)
        self.providers = self.session.get_providers()
        self.on_gpu = self.providers[0] in (_providers.CUDA, _providers.TENSORRT)
        self.use_io_binding = self.on_gpu if use_io_binding is None else bool(use_io_binding)
        self.ort_device = "cuda" if self.on_gpu else "cpu"
        self.inputs = {i.name: (_ORT_TO_NUMPY.get(i.type), list(i.shape)) for i in self.session.get_inputs()}
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._model_inputs = _model_graph_inputs(self.session)

    @property
    def provider(self):
        """The provider that runs the graph (first of the session's list)."""
        return self.providers[0]

    @property
    def metadata(self):
        """The keras_linattn description stored in the graph by `export_onnx` ({} for other graphs)."""
        return self._metadata

    # --------------------------------------------------------- validation
    def _as_dict(self, inputs):
        if isinstance(inputs, dict):
            return inputs
        if isinstance(inputs, (list, tuple)):
            if len(inputs) != len(self.input_names):
                raise ValueError(
                    f"Expected {len(self.input_names)} inputs {self.input_names}. Received: {len(inputs)} inputs"
                )
            return dict(zip(self.input_names, inputs, strict=True))
        if len(self.input_names) != 1:
            raise ValueError(
                f"This graph takes several inputs {self.input_names}: pass a dict. "
                f"Received: inputs of type {type(inputs).__name__}"
            )
        return {self.input_names[0]: inputs}

    def check_inputs(self, inputs):
        """Validates and converts inputs; returns a dict of numpy arrays."""
        inputs = self._as_dict(inputs)
        missing = [n for n in self.input_names if n not in inputs]
        unexpected = sorted(set(inputs) - set(self.input_names))
        if missing or unexpected:
            raise ValueError(
                f"The graph takes inputs {self.input_names}. Received: missing={missing}, unexpected={unexpected}"
            )
        feeds = {}
        for name in self.input_names:
            dtype, shape = self.inputs[name]
            value = inputs[name]
            if _is_ort_value(value):
                feeds[name] = value
                continue
            value = np.asarray(value)
            expected = "[" + ", ".join(str(d) if isinstance(d, int) else "?" for d in shape) + "]"
            if value.ndim != len(shape):
                raise ValueError(
                    f"Input {name!r} must have rank {len(shape)} (shape {expected}). "
                    f"Received: {name}.shape={value.shape}"
                )
            for axis, (got, want) in enumerate(zip(value.shape, shape, strict=True)):
                if isinstance(want, int) and got != want:
                    raise ValueError(
                        f"Input {name!r} must have shape {expected}; axis {axis} must be {want}. "
                        f"Received: {name}.shape={value.shape}"
                    )
            if self._model_inputs is not None and name in self._model_inputs and 0 in value.shape[1:]:
                raise ValueError(
                    f"Input {name!r} of the model graph must hold at least one element per row "
                    f"(a sequence of length >= 1). Received: {name}.shape={value.shape}"
                )
            if dtype is not None:
                if _kind(value.dtype) != _kind(dtype):
                    raise ValueError(
                        f"Input {name!r} must be {_kind(dtype)} ({np.dtype(dtype).name}). "
                        f"Received: {name}.dtype={value.dtype}"
                    )
                _check_fits(name, value, dtype)
                value = value.astype(dtype, copy=False)
            feeds[name] = value
        return feeds

    # --------------------------------------------------------------- run
    def __call__(self, inputs):
        return self.predict(inputs)

    def predict(self, inputs):
        feeds = self.check_inputs(inputs)
        if not self.use_io_binding:
            outputs = self.session.run(self.output_names, feeds)
            return dict(zip(self.output_names, outputs, strict=True))
        outputs = self.run_bound(feeds)
        return {name: value.numpy() for name, value in outputs.items()}

    def run_bound(self, inputs):
        """Runs with I/O binding; returns outputs as `onnxruntime.OrtValue`s.

        Inputs may be numpy arrays (copied to the device) or `OrtValue`s
        already on the device (e.g. the state outputs of the previous call),
        which are bound without a copy. Outputs stay on the session's device.
        """
        import onnxruntime as ort

        feeds = self.check_inputs(inputs)
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if not _is_ort_value(value):
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), self.ort_device, 0)
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, self.ort_device)
        self.session.run_with_iobinding(binding)
        return dict(zip(self.output_names, binding.get_outputs(), strict=True))

    def __repr__(self):
        return f"OnnxPredictor(path={self.path!r}, provider={self.provider!r}, io_binding={self.use_io_binding})"


def _check_loaded(session, metadata, path):
    """The graph the session loaded is the one checked before (not a file another export put there since)."""
    loaded = session.get_modelmeta().custom_metadata_map.get(_onnx_files.METADATA_KEY)
    found = json.loads(loaded).get("export_id") if loaded else None
    if found != metadata.get("export_id"):
        raise ValueError(
            f"{path!r} was replaced while it loaded (export ids {metadata.get('export_id')} checked, {found} "
            f"loaded): another export wrote it; load again. Received: path={path!r}"
        )


def _check_fits(name, value, dtype):
    """Integers that the cast to the graph's `dtype` would wrap (int64 ids >= 2**31 as int32) are refused.

    Raises:
        ValueError: naming the input and the smallest and largest values received.
    """
    if _kind(value.dtype) != "integer" or np.can_cast(value.dtype, dtype, "safe") or not value.size:
        return
    info = np.iinfo(dtype)
    low, high = int(value.min()), int(value.max())
    if low < info.min or high > info.max:
        raise ValueError(
            f"Input {name!r} holds integers outside the graph's {np.dtype(dtype).name} range "
            f"[{info.min}, {info.max}]: a cast would wrap them to other values. "
            f"Received: {name}.dtype={value.dtype}, min={low}, max={high}"
        )


def _model_graph_inputs(session):
    """The input names of a keras_linattn model graph (its ``serving_default``), or None for other graphs.

    Those are sequences: a zero-length one fails inside the runtime (a layer norm's mean over no token).
    The generate graph defines its answer to an empty prompt (-1 ids) and is not one of them.
    """
    import json

    try:
        meta = json.loads(session.get_modelmeta().custom_metadata_map.get("keras_linattn", "{}"))
    except ValueError:  # damaged metadata: `metadata` names it when it is read
        return None
    if not isinstance(meta, dict) or meta.get("graph") != "serving_default":
        return None
    return {entry.get("name") for entry in meta.get("inputs", []) if isinstance(entry, dict)}


def _is_ort_value(value):
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return isinstance(value, ort.OrtValue)
