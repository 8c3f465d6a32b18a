"""ONNX export through `tf2onnx.convert.from_function`.

`tf2onnx.convert.from_keras` does not work on Keras 3 models; instead the
model's inference call is wrapped in a `tf.function` with a dynamic
(``None``) batch and length input signature and converted from there. The
weights, including frozen random features, become ONNX initializers, so an
export is deterministic.

tf2onnx and onnx are imported inside the functions: importing
`keras_linattn.export` stays cheap.
"""

import json
import logging
import os
import tempfile

import tensorflow as tf

from keras_linattn.export import _specs

METADATA_KEY = "keras_linattn"
DEFAULT_OPSET = 17


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
    one = ctx.make_const(
        utils.make_name(f"{node.name}_one"), np.array(1, dtype=helper.tensor_dtype_to_np_dtype(dtype))
    )
    erf = ctx.make_node("Erf", inputs=[node.input[0]])
    _replace_with_sub(ctx, node, one.output[0], erf.output[0])


CUSTOM_OP_HANDLERS = {"FloorMod": (_floor_mod_handler, []), "Erfc": (_erfc_handler, [])}


def _check_path(path, name="path"):
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"`{name}` must be a file path, not a directory. Received: {name}={path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"The parent of `{name}` is a file. Received: {name}={path!r}")
    return path


def convert_function(fn, input_signature, path, opset=DEFAULT_OPSET, metadata=None):
    """Converts a Python function of named tensors to an ONNX file at `path`.

    The file is written next to `path` under a temporary name, checked with
    `onnx.checker` and renamed into place, so a failure leaves no file.

    Returns:
        The ONNX `ModelProto`.
    """
    import onnx
    import tf2onnx

    path = _check_path(path)
    tf_fn = tf.function(fn, input_signature=input_signature, autograph=False)
    logger = logging.getLogger("tf2onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        proto, _ = tf2onnx.convert.from_function(
            tf_fn,
            input_signature=input_signature,
            opset=opset,
            custom_op_handlers=CUSTOM_OP_HANDLERS,
        )
    finally:
        logger.setLevel(level)
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise ValueError(
            "The ONNX conversion produced an invalid model (an op tf2onnx cannot convert?). "
            f"Received: opset={opset}. Checker: {str(e).splitlines()[0]}"
        ) from e
    if metadata is not None:
        entry = proto.metadata_props.add()
        entry.key = METADATA_KEY
        entry.value = json.dumps(metadata)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".onnx", dir=parent)
    os.close(fd)
    try:
        onnx.save(proto, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return proto


def default_step_path(path):
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}_step{ext or '.onnx'}"


def export_onnx(model, path, opset=DEFAULT_OPSET, input_signature=None, step_path=None, include_step=True):
    """Exports a Keras model to ONNX.

    The main graph is the model's inference call with named inputs and
    outputs (the same names as the SavedModel's ``serving_default``) and
    dynamic batch and length dims. For causal LMs a second graph, the decode
    step (``token_t`` + ``state_<i>`` -> ``logits`` + ``new_state_<i>``), is
    written to `step_path`; `keras_linattn.export.OnnxGenerator` drives it.

    Args:
        model: a built `keras.Model`.
        path: the ``.onnx`` file to write.
        opset: ONNX opset (default 17).
        input_signature: optional named `tf.TensorSpec` list (subclassed
            models).
        step_path: where the step graph goes; default ``<path>_step.onnx``.
        include_step: whether to export the step graph of causal LMs.

    Returns:
        dict: ``{"model": path}`` plus ``"step"`` for causal LMs.
    """
    path = _check_path(path)
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    if step_path is not None:
        _check_path(step_path, "step_path")
    description = specs.describe()
    written = {}
    try:
        convert_function(
            specs.serving_fn(),
            specs.input_specs,
            path,
            opset=opset,
            metadata=dict(description, graph=_specs.SERVING_DEFAULT),
        )
        written["model"] = path
        if specs.causal_lm and include_step:
            step_path = step_path or default_step_path(path)
            convert_function(
                specs.step_fn(),
                specs.step_signature(),
                step_path,
                opset=opset,
                metadata=dict(description, graph=_specs.STEP),
            )
            written["step"] = step_path
    except BaseException:
        for p in written.values():
            if os.path.exists(p):
                os.remove(p)
        raise
    return written


def read_metadata(path):
    """The keras_linattn description stored in an exported ONNX file (or {})."""
    import onnx

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"`path` must be an existing .onnx file. Received: path={path!r}")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf DecodeError and friends
        raise ValueError(f"`path` is not a valid ONNX file ({type(e).__name__}: {e}). Received: path={path!r}") from e
    for entry in proto.metadata_props:
        if entry.key == METADATA_KEY:
            return json.loads(entry.value)
    return {}
