"""tf2onnx conversion handlers for the ops tf2onnx 1.17 converts wrongly or not at all (FloorMod, Erfc, SelectV2)."""

__all__ = []


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


def _select_v2_handler(ctx, node, name, args):
    """SelectV2 (``where``) as ONNX ``Where``, which broadcasts as SelectV2 does.

    tf2onnx 1.17 lowers a float SelectV2 to ``cond * x + (not cond) * y``
    (two Casts, a Not, two Muls and an Add): six nodes where one does, and
    a NaN or Inf in the branch not taken leaks into the result (``0 * NaN``
    is NaN), which breaks the ``where`` guards that keep a padded position
    out of the real outputs. A decode step runs about 7 of them a layer; as
    ``Where`` the GPT-2 base step graph has about 360 nodes fewer.

    onnxruntime's CPU ``Where`` takes float, double, int32, int64 and
    uint8: other dtypes go through one of those and back (exact: bool and
    small integers as int32/int64, float16/bfloat16 as float).
    """
    from onnx import TensorProto

    dtype = ctx.get_dtype(node.output[0])
    direct = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8)
    if dtype in direct:
        node.type = "Where"
        return
    floats = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    wide = (
        TensorProto.FLOAT if dtype in floats else TensorProto.INT32 if dtype == TensorProto.BOOL else TensorProto.INT64
    )
    branches = [ctx.make_node("Cast", [node.input[i]], attr={"to": wide}).output[0] for i in (1, 2)]
    where = ctx.make_node("Where", [node.input[0]] + branches)
    shapes, dtypes = node.output_shapes, node.output_dtypes
    ctx.remove_node(node.name)
    ctx.make_node(
        "Cast", where.output, attr={"to": dtype}, name=node.name, outputs=node.output, shapes=shapes, dtypes=dtypes
    )


CUSTOM_OP_HANDLERS = {
    "FloorMod": (_floor_mod_handler, []),
    "Erfc": (_erfc_handler, []),
    "SelectV2": (_select_v2_handler, []),
}
