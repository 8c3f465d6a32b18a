"""ONNX export through `tf2onnx.convert.from_function`.

`tf2onnx.convert.from_keras` does not work on Keras 3 models; instead the
model's inference call is wrapped in a `tf.function` with a dynamic
(``None``) batch and length input signature and converted from there.

Weights are converted as *inputs*, not constants: the function takes every
weight as an extra argument and reads it through a `keras.StatelessScope`,
so the converted TensorFlow graph holds no weight values. tf2onnx freezes,
optimizes and folds only the small graph (at GPT-2 base, freezing the
weights into the graph made each conversion pass 17 GB: every pass kept
its own copies, and constant folding stored kernels in two or three
layouts). The weight inputs then become ONNX initializers named by the
weight's Keras path, one tensor per weight, so the file holds exactly one
copy of each weight (`verify` checks each by name) and an export is
deterministic, frozen random features included. onnxruntime folds what
depends on weights alone (a transposed kernel, ``exp`` of a decay
parameter) once, when a session is created.

Models whose weights pass `EXTERNAL_DATA_THRESHOLD` bytes (or
``external_data=True``) keep them in one external data file per directory,
``<model file>.<export id>.data``, shared by the model, step and generate
graphs; a 4 KiB header names the export it belongs to, and each graph
records its name, size and sha256 (`_onnx_publish` writes and publishes the
set; `_onnx_files` checks it at load).

tf2onnx and onnx are imported inside the functions: importing
`keras_linattn.export` stays cheap.
"""

import contextlib
import json
import logging
import os
import threading
import uuid

import numpy as np

from keras_linattn import _atomic, _lazy
from keras_linattn.export import (
    _float_compute,
    _onnx_files,
    _onnx_graph,
    _onnx_grappler,
    _onnx_handlers,
    _onnx_publish,
    _onnx_text,
    _specs,
)

tf = _lazy.module("tensorflow")  # loaded on first use: OnnxGenerator reads `_read_metadata` without it

__all__ = ["check_pair", "export_onnx"]

_METADATA_KEY = _onnx_files.METADATA_KEY
_read_data_header = _onnx_files.read_data_header
_DEFAULT_OPSET = 17
# The generate graph's sampler hashes with BitwiseAnd/BitwiseXor (opset 18).
_GENERATE_MIN_OPSET = 18


def _check_path(path, name="path"):
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"`{name}` must be a file path, not a directory. Received: {name}={path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"The parent of `{name}` is a file. Received: {name}={path!r}")
    return path


# tf2onnx's optimizer deep-copies the whole graph before each of its ~12 passes, on
# every round, so that a pass that raises can be undone ("catch errors"). On this
# package's graphs that copying is ~40% of a conversion (the tiny LM's three graphs:
# 18.7 -> 11.1 s) and no pass raises. tf2onnx turns the copies off when the
# environment variable TF2ONNX_CATCH_ERRORS is set: `_convert` sets it for its own
# call (under a lock: the environment is process-wide; a value the user set is left
# alone) and, if the conversion raises, converts again the careful way, so a pass
# that fails is still skipped as before. Same graphs either way (tested:
# tests/export/test_onnx.py).
_CATCH_ERRORS_ENV = "TF2ONNX_CATCH_ERRORS"
_CONVERT_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_optimizer_copies():
    with _CONVERT_LOCK:
        if _CATCH_ERRORS_ENV in os.environ:
            yield
            return
        os.environ[_CATCH_ERRORS_ENV] = "false"
        try:
            yield
        finally:
            os.environ.pop(_CATCH_ERRORS_ENV, None)


# --------------------------------------------------------------- weights
# Weights larger than this (bytes, all weights together) go to an external data
# file. ONNX files are protobufs, which cannot pass 2 GiB; a margin leaves room
# for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1 << 30
_WEIGHT_INPUT = _onnx_graph.WEIGHT_INPUT


def _export_variables(model):
    """The model's variables, each once (a variable shared by layers is one weight)."""
    seen, out = set(), []
    for variable in model.variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            out.append(variable)
    return out


def _weight_names(variables):
    """ONNX initializer name of each variable: its Keras path (made unique if two paths clash)."""
    names, used = [], set()
    for i, variable in enumerate(variables):
        name = str(getattr(variable, "path", None) or variable.name)
        if name in used:
            name = f"{name}_{i}"
        used.add(name)
        names.append(name)
    return names


def _with_weights_as_inputs(fn, input_signature, variables):
    """``fn`` as a function of its inputs and then every weight, with that signature.

    The weights are read through a `keras.StatelessScope`, so the traced graph
    captures no variable: tf2onnx converts a graph that holds no weight values.
    """
    import keras

    n = len(input_signature)
    weight_specs = [
        tf.TensorSpec(tuple(v.shape), tf.as_dtype(v.dtype), name=_WEIGHT_INPUT.format(i))
        for i, v in enumerate(variables)
    ]

    def stateless(*args):
        with keras.StatelessScope(state_mapping=list(zip(variables, args[n:], strict=True))):
            return fn(*args[:n])

    return stateless, list(input_signature) + weight_specs


def _from_function(tf_fn, input_signature, opset, fast=True):
    import tf2onnx

    logger = logging.getLogger("tf2onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        # No fake copy of the weights in Grappler (`_onnx_grappler`): the same graph, without a W-sized buffer.
        with (
            _without_optimizer_copies() if fast else contextlib.nullcontext(),
            _onnx_grappler.weights_without_fake_inputs(),
        ):
            proto, _ = tf2onnx.convert.from_function(
                tf_fn,
                input_signature=input_signature,
                opset=opset,
                custom_op_handlers=_onnx_handlers.CUSTOM_OP_HANDLERS,
            )
    finally:
        logger.setLevel(level)
    return proto


def _convert(fn, input_signature, opset, metadata, fast=True, variables=None):
    """The checked ONNX `ModelProto` of a Python function of named tensors.

    With `variables`, the weights are extra inputs of the converted graph
    (`_with_weights_as_inputs`), named ``kla_weight_<i>`` after the index of
    the variable: `_name_weight_inputs` and `_onnx_publish.save_with_weights` turn them into
    initializers. Without, tf2onnx freezes whatever the function reads.

    ``fast=False`` converts with tf2onnx's per-pass graph copies (what a failed fast
    conversion falls back to).
    """
    import onnx

    if variables is not None:
        fn, input_signature = _with_weights_as_inputs(fn, input_signature, variables)
    tf_fn = tf.function(fn, input_signature=input_signature, autograph=False)
    try:
        proto = _from_function(tf_fn, input_signature, opset, fast=fast)
    except Exception:
        if not fast:
            raise
        proto = _from_function(tf_fn, input_signature, opset, fast=False)
    _onnx_graph._hoist_loop_invariants(proto.graph)
    _onnx_graph._hoist_weight_ops(proto.graph)  # one folded copy of a reshaped or transposed weight, not two
    _onnx_graph._unsigned_int8_products(proto.graph)  # onnxruntime's fast integer kernel is uint8 x int8
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise ValueError(
            "The ONNX conversion produced an invalid model (an op tf2onnx cannot convert?). "
            f"Received: opset={opset}. Checker: {str(e).splitlines()[0]}"
        ) from e
    if metadata is not None:
        entry = proto.metadata_props.add()
        entry.key = _METADATA_KEY
        entry.value = json.dumps(metadata)
    return proto


def _convert_function(fn, input_signature, path, opset=_DEFAULT_OPSET, metadata=None):
    """Converts a Python function of named tensors to an ONNX file at `path`.

    The file is written in a staging directory next to `path`, checked with
    `onnx.checker` and renamed into place, so a failure (or a kill) leaves
    no partial file.

    Returns:
        The ONNX `ModelProto`.
    """
    import onnx

    path = _check_path(path)
    proto = _convert(fn, input_signature, opset, metadata)
    with _atomic.staging_dir(os.path.dirname(os.path.abspath(path))) as tmp:
        staged = os.path.join(tmp, os.path.basename(path))
        onnx.save(proto, staged)
        _atomic.publish(staged, path)
    return proto


def _default_step_path(path):
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}_step{ext or '.onnx'}"


def _default_generate_path(path):
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}_generate{ext or '.onnx'}"


def export_onnx(
    model,
    path,
    opset=_DEFAULT_OPSET,
    input_signature=None,
    step_path=None,
    include_step=True,
    generate_path=None,
    external_data="auto",
    overwrite=False,
    progress=None,
):
    """Exports a Keras model to ONNX.

    The main graph is the model's inference call with named inputs and
    outputs (the same names as the SavedModel's ``serving_default``) and
    dynamic batch and length dims. For causal LMs two more graphs are
    written: the decode step (``token_t`` + ``state_<i>`` -> ``logits`` +
    ``new_state_<i>``) to `step_path`, and the whole of generation
    (``prompt_ids``, ``padding_mask``, ``max_length``, ``temperature``,
    ``top_k``, ``top_p``, ``seed`` -> ``output_ids``) to `generate_path`:
    the decode contract of `keras_linattn.generation`, the loop that
    `LinearCausalLM.generate` runs, converted to an ONNX Loop (opset >= 18).
    `keras_linattn.export.OnnxGenerator` runs both. A causal LM with a
    preprocessor also gets its tokenizer beside the step graph, in
    ``<path stem>_tokenizer/`` (keras-hub's assets plus ``tokenizer.json``):
    `OnnxGenerator.generate` then takes and returns text.

    The graphs are published as a set (`_onnx_publish`): all are
    converted and written in full to staging directories first (the
    external data, then the generate, step and model graphs, each
    recording the size and sha256 of the files it names), then renamed
    into place in that order under a lock on each target directory, and
    the data files of earlier exports of the model are removed last. All
    carry the same ``export_id``; the data file's name is unique to the
    export, so an old graph never reads new weights. `check_pair` (and
    ``keras-linattn verify``) and the runtime front ends at load tell a
    complete set from a file that is missing, damaged or left from another
    export (a process killed between the renames). Two exports into the
    same place publish one after the other: the last one wins, whole. A
    killed export never leaves a partial file; its staging directory and
    orphaned data file are removed by the next export into the same place.

    Args:
        model: a built `keras.Model`.
        path: the ``.onnx`` file to write.
        opset: ONNX opset (default 17).
        input_signature: optional named `tf.TensorSpec` list (subclassed
            models).
        step_path: where the step graph goes; default ``<path>_step.onnx``.
        include_step: whether to export the step and generate graphs of
            causal LMs.
        generate_path: where the generate graph goes; default
            ``<path>_generate.onnx``.
        external_data: ``"auto"`` (default) keeps the weights inside each
            file unless they pass `EXTERNAL_DATA_THRESHOLD` bytes (1 GiB;
            a protobuf cannot pass 2 GiB), ``True`` always writes them to
            ``<file>.<export id>.data`` beside the graphs (one file per directory,
            shared by the graphs there), ``False`` never does.
        overwrite: replace files that already exist at the paths; without
            it an existing file is an error, as for `export_saved_model`.
        progress: optional ``callable(str)`` called before each long step
            (each graph's conversion, the weights' write-out); the CLI
            prints these lines.

    Every weight is stored once per file, as an initializer named by its
    Keras path (``variable.path``); the graphs read no weight that is not
    one of these (module docstring).

    Raises:
        ValueError: on a Keras backend other than TensorFlow, for a path
            that exists (without `overwrite`) or graphs that would share a path.

    Returns:
        dict: ``{"model": path}`` plus ``"step"`` and ``"generate"`` for
        causal LMs, and ``"data"`` (a list of external data files) when the
        weights are stored outside the graphs.
    """

    _specs.require_tensorflow_backend()
    path = _check_path(path)
    if external_data not in ("auto", True, False):
        raise ValueError(f"`external_data` must be 'auto', True or False. Received: external_data={external_data!r}")
    say = progress or (lambda message: None)
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    if step_path is not None:
        _check_path(step_path, "step_path")
    if generate_path is not None:
        _check_path(generate_path, "generate_path")
    description = specs.describe()
    tokenizer_dir = _onnx_text.tokenizer_dir_name(model, path) if specs.causal_lm and include_step else None
    if tokenizer_dir:
        description["tokenizer"] = tokenizer_dir  # beside the step graph: OnnxGenerator takes text
    export_id = uuid.uuid4().hex
    companions = {}  # kind -> path
    if specs.causal_lm and include_step:
        companions["step"] = os.fspath(step_path or _default_step_path(path))
        companions["generate"] = os.fspath(generate_path or _default_generate_path(path))
    targets = _check_targets(path, companions, overwrite)
    variables = _export_variables(model)
    names = _weight_names(variables)
    weight_bytes = sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables)
    external = weight_bytes > EXTERNAL_DATA_THRESHOLD if external_data == "auto" else bool(external_data)
    int8_bytes = sum(int(np.prod(v.shape)) for v in variables if str(v.dtype) == "int8")
    weights_meta = {"weights": "named", "weight_bytes": weight_bytes, "external_data": external}
    weights_meta["int8_weight_bytes"] = int8_bytes  # `OnnxGenerator` keeps int8 weights repacked (`prepacking`)
    protos, used = {}, {}
    # 16-bit float weights: stored as they are, computed in float32 (`_float_compute`).
    with _float_compute.float32_compute(model):
        for kind, fn, signature, graph_opset, meta in _graph_jobs(
            specs, path, companions, opset, description, export_id, weights_meta
        ):
            say(f"converting the {kind} graph to ONNX (opset {graph_opset})")
            protos[kind] = _convert(fn, signature, graph_opset, meta, variables=variables)
            used[kind] = _onnx_graph._name_weight_inputs(protos[kind], names)
    if tokenizer_dir:
        say(f"writing the tokenizer ({tokenizer_dir})")
        _onnx_text.write_tokenizer(model, os.path.join(_parent(targets["step"]), tokenizer_dir))
    return _onnx_publish.publish(protos, used, targets, variables, names, external, export_id, say)


def _check_targets(path, companions, overwrite):
    """``{kind: path}`` of every graph to write: distinct paths, none existing unless `overwrite`."""
    targets = {"model": path, **companions}
    if len({os.path.abspath(p) for p in targets.values()}) != len(targets):
        raise ValueError(f"The exported graphs need distinct paths. Received: {targets}")
    if not overwrite:
        existing = [p for p in targets.values() if os.path.exists(p)]
        if existing:
            raise ValueError(
                f"{existing[0]!r} already exists: pass `overwrite=True` (CLI: --overwrite) to replace it, "
                f"or choose another path. Received: path={path!r}"
            )
    return targets


def _graph_jobs(specs, path, companions, opset, description, export_id, weights_meta):
    """``(kind, fn, input_signature, opset, metadata)`` of each graph to convert: the model, then its companions.

    Each graph's metadata holds the model's `description`, its graph, the
    `export_id`, the relative paths of the files it links to and
    `weights_meta` (how the weights are stored).
    """
    model_meta = dict(description, graph=_specs.SERVING_DEFAULT, export_id=export_id, **weights_meta)
    for kind, companion in companions.items():
        model_meta[f"{kind}_file"] = _relative(companion, path)
    jobs = [("model", specs.serving_fn(), specs.input_specs, opset, model_meta)]
    if companions:
        links = {f"{kind}_file": _relative(p, companions["step"]) for kind, p in companions.items() if kind != "step"}
        step_meta = dict(description, graph=_specs.STEP, export_id=export_id, **links, **weights_meta)
        jobs.append(("step", specs.step_fn(), specs.step_signature(), opset, step_meta))
        generate_meta = dict(description, graph=_specs.GENERATE_SAMPLED, export_id=export_id, **weights_meta)
        jobs.append(
            (
                "generate",
                specs.generate_fn(sampled=True, check_lengths=False),
                specs.generate_signature(sampled=True),
                max(opset, _GENERATE_MIN_OPSET),
                generate_meta,
            )
        )
    return jobs


def _relative(target, origin):
    """`target`'s path relative to the directory of `origin`, with forward slashes."""
    return os.path.relpath(os.path.abspath(target), _parent(origin)).replace(os.sep, "/")


def _parent(path):
    return os.path.dirname(os.path.abspath(path))


def check_pair(model_path, step_path=None, verify="full"):
    """Checks that an exported ONNX model, its companion graphs and its external data belong together.

    The companions are the step graph and the generate graph that the
    model's metadata names (``step_file``, ``generate_file``); the external
    data is the ``data_file`` each graph names (`_onnx_files`).

    Args:
        model_path: the model ``.onnx`` file.
        step_path: its step graph; default: the ``step_file`` the model's
            metadata names (models without a step graph need none).
        verify: ``"full"`` (default) also compares the sha256 of the data
            file and of the companions with the ones recorded at export;
            ``"fast"`` checks export ids, headers and sizes only.

    Returns:
        The step path that was checked, or None for a model without a step graph.

    Raises:
        ValueError: naming the file, when the model, a companion or a data
            file is unreadable, missing, truncated or altered, or when they
            carry different export ids (one of them is left from another
            export).
    """
    verify = _onnx_files.check_verify(verify)
    model_meta = _read_metadata(model_path)
    checked = {}
    for kind in ("step", "generate"):
        expected = model_meta.get(f"{kind}_file")
        path = step_path if kind == "step" else None
        if path is None:
            if expected is None:
                continue
            path = os.path.join(_parent(model_path), *expected.split("/"))
        path = os.fspath(path)
        checked[kind] = (path, _onnx_files.check_companion(model_path, model_meta, kind, path, verify))
    _onnx_files.check_graph(model_path, verify, model_meta)
    for path, meta in checked.values():
        _onnx_files.check_graph(path, verify, meta)
    return checked["step"][0] if "step" in checked else None


def _read_metadata(path):
    """The keras_linattn description stored in an exported ONNX file (or {})."""
    import onnx

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be an existing .onnx file. Received: path={path!r}")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ValueError(
            f"`path` is not a valid ONNX file ({type(e).__name__}: {_first_line(e)}). Received: path={path!r}"
        ) from e
    for entry in proto.metadata_props:
        if entry.key == _METADATA_KEY:
            try:
                return json.loads(entry.value)
            except ValueError as e:
                raise ValueError(
                    f"The ONNX file's {_METADATA_KEY} metadata is not valid JSON ({e}). Received: path={path!r}"
                ) from e
    return {}


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
