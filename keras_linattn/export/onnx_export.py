"""ONNX export through `tf2onnx.convert.from_function`.

`tf2onnx.convert.from_keras` does not work on Keras 3 models; instead the
model's inference call is wrapped in a `tf.function` with a dynamic
(``None``) batch and length input signature and converted from there. The
weights, including frozen random features, become ONNX initializers, so an
export is deterministic.

tf2onnx and onnx are imported inside the functions: importing
`keras_linattn.export` stays cheap.
"""

import contextlib
import json
import logging
import os
import threading
import uuid

import tensorflow as tf

from keras_linattn import _atomic
from keras_linattn.export import _specs

__all__ = ["check_pair", "export_onnx"]

_METADATA_KEY = "keras_linattn"
_DEFAULT_OPSET = 17
# The generate graph's sampler hashes with BitwiseAnd/BitwiseXor (opset 18).
_GENERATE_MIN_OPSET = 18


def _replace_with_sub(ctx, node, minuend, subtrahend):
    """Replaces `node` by ``Sub(minuend, subtrahend)``, keeping its name, outputs and shapes."""
    shapes, dtypes = node.output_shapes, node.output_dtypes
    ctx.remove_node(node.name)
    ctx.make_node(
        "Sub",
        inputs=[minuend, subtrahend],
        name=node.name,
        outputs=node.output,
        shapes=shapes,
        dtypes=dtypes,
    )


def _floor_mod_handler(ctx, node, name, args):
    """FloorMod with Python semantics for integers.

    tf2onnx 1.17 lowers integer FloorMod to ``x - (x / y) * y`` with a
    truncating division, which is wrong for negative ``x``: e.g. the
    ``(-length) % chunk`` padding of chunked causal attention. ONNX ``Mod``
    with ``fmod=0`` has the sign of the divisor, i.e. floor semantics.
    """
    from onnx import TensorProto

    dtype = ctx.get_dtype(node.input[0])
    if dtype in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16):
        div = ctx.make_node("Div", inputs=node.input)
        floor = ctx.make_node("Floor", inputs=div.output)
        mul = ctx.make_node("Mul", inputs=[floor.output[0], node.input[1]])
        _replace_with_sub(ctx, node, node.input[0], mul.output[0])
        return
    node.type = "Mod"
    node.set_attr("fmod", 0)


def _erfc_handler(ctx, node, name, args):
    """``erfc(x) = 1 - erf(x)``: tf2onnx 1.17 has no Erfc, which exact GELU uses."""
    import numpy as np
    from onnx import helper
    from tf2onnx import utils

    dtype = ctx.get_dtype(node.input[0])
    one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype=helper.tensor_dtype_to_np_dtype(dtype)))
    erf = ctx.make_node("Erf", inputs=[node.input[0]])
    _replace_with_sub(ctx, node, one.output[0], erf.output[0])


_CUSTOM_OP_HANDLERS = {"FloorMod": (_floor_mod_handler, []), "Erfc": (_erfc_handler, [])}


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


def _from_function(tf_fn, input_signature, opset, fast=True):
    import tf2onnx

    logger = logging.getLogger("tf2onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with _without_optimizer_copies() if fast else contextlib.nullcontext():
            proto, _ = tf2onnx.convert.from_function(
                tf_fn,
                input_signature=input_signature,
                opset=opset,
                custom_op_handlers=_CUSTOM_OP_HANDLERS,
            )
    finally:
        logger.setLevel(level)
    return proto


def _convert(fn, input_signature, opset, metadata, fast=True):
    """The checked ONNX `ModelProto` of a Python function of named tensors.

    ``fast=False`` converts with tf2onnx's per-pass graph copies (what a failed fast
    conversion falls back to).
    """
    import onnx

    tf_fn = tf.function(fn, input_signature=input_signature, autograph=False)
    try:
        proto = _from_function(tf_fn, input_signature, opset, fast=fast)
    except Exception:
        if not fast:
            raise
        proto = _from_function(tf_fn, input_signature, opset, fast=False)
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
):
    """Exports a Keras model to ONNX.

    The main graph is the model's inference call with named inputs and
    outputs (the same names as the SavedModel's ``serving_default``) and
    dynamic batch and length dims. For causal LMs two more graphs are
    written: the decode step (``token_t`` + ``state_<i>`` -> ``logits`` +
    ``new_state_<i>``) to `step_path`, and the whole of generation
    (``prompt_ids``, ``padding_mask``, ``max_length``, ``temperature``,
    ``top_k``, ``top_p``, ``seed`` -> ``output_ids``) to `generate_path`:
    the decode contract of `keras_linattn.models.generation`, the loop that
    `LinearCausalLM.generate` runs, converted to an ONNX Loop (opset >= 18).
    `keras_linattn.export.OnnxGenerator` runs both.

    The graphs are published as a set: all are converted and written in
    full to staging directories first, then the step and generate graphs
    are renamed into place and the model last. All carry the same
    ``export_id`` in their metadata, and the model names its companion
    files, so `check_pair` (and ``keras-linattn verify``) tell a complete
    set from a companion that is missing or left from another export (a
    process killed between the renames). A killed export never leaves a
    partial file; its staging directory is removed by the next export into
    the same place.

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

    Returns:
        dict: ``{"model": path}`` plus ``"step"`` and ``"generate"`` for
        causal LMs.
    """
    import onnx

    path = _check_path(path)
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    if step_path is not None:
        _check_path(step_path, "step_path")
    if generate_path is not None:
        _check_path(generate_path, "generate_path")
    description = specs.describe()
    export_id = uuid.uuid4().hex
    with_step = bool(specs.causal_lm and include_step)
    model_meta = dict(description, graph=_specs.SERVING_DEFAULT, export_id=export_id)
    companions = {}  # kind -> path
    if with_step:
        companions["step"] = os.fspath(step_path or _default_step_path(path))
        companions["generate"] = os.fspath(generate_path or _default_generate_path(path))
        for kind, companion in companions.items():
            model_meta[f"{kind}_file"] = _relative(companion, path)
    model_proto = _convert(specs.serving_fn(), specs.input_specs, opset, model_meta)
    protos = {}
    if with_step:
        links = {f"{kind}_file": _relative(p, companions["step"]) for kind, p in companions.items() if kind != "step"}
        step_meta = dict(description, graph=_specs.STEP, export_id=export_id, **links)
        protos["step"] = _convert(specs.step_fn(), specs.step_signature(), opset, step_meta)
        generate_meta = dict(description, graph=_specs.GENERATE_SAMPLED, export_id=export_id)
        protos["generate"] = _convert(
            specs.generate_fn(sampled=True, check_lengths=False),
            specs.generate_signature(sampled=True),
            max(opset, _GENERATE_MIN_OPSET),
            generate_meta,
        )
    with contextlib.ExitStack() as stack:
        staged_model = os.path.join(stack.enter_context(_atomic.staging_dir(_parent(path))), "model.onnx")
        onnx.save(model_proto, staged_model)
        _atomic.fault_point("onnx:model_staged")
        for kind, proto in protos.items():
            target = companions[kind]
            staged = os.path.join(stack.enter_context(_atomic.staging_dir(_parent(target))), f"{kind}.onnx")
            onnx.save(proto, staged)
            _atomic.fault_point(f"onnx:{kind}_staged")
            _atomic.publish(staged, target)
            _atomic.fault_point(f"onnx:{kind}_published")
        _atomic.publish(staged_model, path)
        _atomic.fault_point("onnx:model_published")
    written = {"model": path}
    written.update(companions)
    return written


def _relative(target, origin):
    """`target`'s path relative to the directory of `origin`, with forward slashes."""
    return os.path.relpath(os.path.abspath(target), _parent(origin)).replace(os.sep, "/")


def _parent(path):
    return os.path.dirname(os.path.abspath(path))


def check_pair(model_path, step_path=None):
    """Checks that an exported ONNX model and its companion graphs belong together.

    The companions are the step graph and the generate graph that the
    model's metadata names (``step_file``, ``generate_file``).

    Args:
        model_path: the model ``.onnx`` file.
        step_path: its step graph; default: the ``step_file`` the model's
            metadata names (models without a step graph need none).

    Returns:
        The step path that was checked, or None for a model without a step graph.

    Raises:
        ValueError: naming the file, when the model or a companion is
            unreadable or missing, or when they carry different export ids
            (one of them is left from another export).
    """
    model_meta = _read_metadata(model_path)
    checked = {}
    for kind in ("step", "generate"):
        expected = model_meta.get(f"{kind}_file")
        path = step_path if kind == "step" else None
        if path is None:
            if expected is None:
                continue
            path = os.path.join(_parent(model_path), *expected.split("/"))
        _check_companion(model_path, model_meta, kind, expected, path)
        checked[kind] = path
    return checked.get("step")


def _check_companion(model_path, model_meta, kind, expected, path):
    if not os.path.isfile(path):
        raise ValueError(
            f"The ONNX {kind} graph is missing: the model {model_path!r} was exported with its {kind} graph "
            f"{expected or os.path.basename(path)!r}, which is not there (a killed export?); "
            f"export again. Received: path={path!r}"
        )
    meta = _read_metadata(path)
    model_id, companion_id = model_meta.get("export_id"), meta.get("export_id")
    if model_id != companion_id:
        raise ValueError(
            f"The ONNX {kind} graph {path!r} comes from another export than the model {model_path!r} "
            f"(export ids {companion_id} and {model_id}): an export was interrupted between the files; "
            f"export again. Received: path={path!r}"
        )


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
