"""Integer products in exported graphs run onnxruntime's fast uint8 x int8 kernel (`_onnx_graph`).

Keras' int8 layers quantize their inputs to int8 and multiply int8 by int8.
onnxruntime's CPU `MatMulInteger` for int8 x int8 (without AVX-VNNI-INT8) is
its portable kernel, slower than the float32 product; the export shifts the
int8 activations by 128 into uint8 with zero point 128, which multiplies
exactly the same integers. The products' int32 results are compared for
equality (integer arithmetic: no rounding to bound).
"""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_linattn.export import _onnx_graph, onnx_export

pytestmark = [pytest.mark.numeric, pytest.mark.tf_only("ONNX export runs on TensorFlow")]

K, N = 16, 8


def _quantize_nodes(prefix, source, round_values=True):
    """Keras' abs-max quantizer's tail as tf2onnx writes it: Round, Min(127), Max(-127), Cast(int8)."""
    rounded = f"{prefix}_rounded"
    nodes = [helper.make_node("Round" if round_values else "Identity", [source], [rounded])]
    nodes += [
        helper.make_node("Min", [rounded, "c127"], [f"{prefix}_min"]),
        helper.make_node("Max", [f"{prefix}_min", "cm127"], [f"{prefix}_clip"]),
        helper.make_node("Cast", [f"{prefix}_clip"], [f"{prefix}_q"], to=TensorProto.INT8),
    ]
    return nodes, f"{prefix}_q"


def _constants():
    rng = np.random.default_rng(0)
    return [
        numpy_helper.from_array(np.array(127.0, "float32"), "c127"),
        numpy_helper.from_array(np.array(-127.0, "float32"), "cm127"),
        numpy_helper.from_array(np.array(0, "int8"), "zero_i8"),
        numpy_helper.from_array(np.array([-1, K], "int64"), "shape2d"),
        numpy_helper.from_array(rng.integers(-127, 128, (K, N)).astype("int8"), "W"),
    ]


def _product_model(round_values=True, extra_reader=False):
    """x [B, 1, K] float -> quantized, Reshape [B, K] (and its Shape read) -> MatMulInteger with W -> y int32."""
    nodes, q = _quantize_nodes("x", "x", round_values)
    nodes += [
        helper.make_node("Shape", [q], ["q_shape"]),
        helper.make_node("Reshape", [q, "shape2d"], ["q2d"]),
        helper.make_node("MatMulInteger", ["q2d", "W", "zero_i8", "zero_i8"], ["y"]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.INT32, [None, N]),
        helper.make_tensor_value_info("q_shape", TensorProto.INT64, [3]),
    ]
    if extra_reader:  # the int8 values themselves leave the graph: their type may not change
        outputs.append(helper.make_tensor_value_info(q, TensorProto.INT8, [None, 1, K]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1, K])], outputs, _constants()
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _loop_model():
    """The same product inside a Loop body, reading its constants from the outer scope (the generate graph)."""
    nodes, q = _quantize_nodes("b", "x")
    nodes += [
        helper.make_node("Reshape", [q, "shape2d"], ["q2d"]),
        helper.make_node("MatMulInteger", ["q2d", "W", "zero_i8", "zero_i8"], ["y_step"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_step", TensorProto.INT32, [None, N]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
            helper.make_node("Loop", ["n", "true"], ["ys"], body=body),
        ],
        "loop",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1, K]),
        ],
        [helper.make_tensor_value_info("ys", TensorProto.INT32, [None, None, N])],
        _constants(),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _session(model, optimized_path=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _inputs():
    # Values that reach the clip on both sides, and halves (Round: to even).
    x = np.random.default_rng(1).normal(scale=60.0, size=(3, 1, K)).astype("float32")
    x[0, 0, :4] = [200.0, -200.0, 2.5, -3.5]
    return x


def _a_zero_points(graph):
    """``(A's producer op, a_zero_point constant)`` of every MatMulInteger of `graph` and its subgraphs."""
    constants = _onnx_graph._constants(graph, {})
    producer = {output: node for node in graph.node for output in node.output}
    found = []
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found += _a_zero_points(attribute.g)
        if node.op_type == "MatMulInteger":
            zero_point = constants.get(node.input[2]) if len(node.input) > 2 else None
            found.append((producer[node.input[0]].op_type if node.input[0] in producer else None, zero_point))
    return found


def test_int8_activations_become_uint8_and_the_products_are_unchanged(tmp_path):
    model = _product_model()
    x = _inputs()
    want = _session(model).run(None, {"x": x})
    assert _onnx_graph._unsigned_int8_products(model.graph) == 1
    onnx.checker.check_model(model)
    got = _session(model, tmp_path / "optimized.onnx").run(None, {"x": x})
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    # The graph onnxruntime runs (after its own optimizations): a uint8 A with zero point 128.
    optimized = onnx.load(tmp_path / "optimized.onnx")
    zero_points = [z for _, z in _a_zero_points(optimized.graph)]
    assert len(zero_points) == 1 and zero_points[0].data_type == TensorProto.UINT8
    assert numpy_helper.to_array(zero_points[0]) == 128
    # The int8 zero point no node reads any more is not left as an initializer (onnxruntime warns).
    read = _onnx_graph._names_read(model.graph)
    assert all(init.name in read for init in model.graph.initializer)


@pytest.mark.parametrize("round_values, extra_reader", [(False, False), (True, True)])
def test_casts_that_are_not_quantized_products_stay_int8(round_values, extra_reader):
    """Values not rounded (a cast would truncate them) or read elsewhere than as a product's A keep their type."""
    model = _product_model(round_values=round_values, extra_reader=extra_reader)
    before = model.SerializeToString()
    assert _onnx_graph._unsigned_int8_products(model.graph) == 0
    assert model.SerializeToString() == before


def test_products_inside_a_loop_body_become_uint8():
    model = _loop_model()
    feeds = {"n": np.array(2, "int64"), "x": _inputs()}
    want = _session(model).run(None, feeds)
    assert _onnx_graph._unsigned_int8_products(model.graph) == 1
    onnx.checker.check_model(model)
    np.testing.assert_array_equal(_session(model).run(None, feeds)[0], want[0])
    ((_, zero_point),) = _a_zero_points(model.graph)
    assert zero_point.data_type == TensorProto.UINT8


def converted_projection(equation, bias=False):
    """An int8 `_ProjectionDense` of `equation` and its graph as the export converts it.

    Returns ``(dense, proto, feeds, x)``: ``feeds`` holds the weight inputs, ``x`` an input ``[3, 5, ...]``
    (15 tokens: one input scale each). ``bias``: a random bias instead of zeros.
    """
    import keras
    import tensorflow as tf

    from keras_linattn.layers._attention_base import _ProjectionDense

    keras.utils.set_random_seed(0)
    shape, output_shape, bias_axes = {
        "btd,dhk->bthk": ((1, 1, 32), (None, 2, 8), "hk"),
        "bthk,hkd->btd": ((1, 1, 2, 8), (None, 32), "d"),
    }[equation]
    dense = _ProjectionDense(equation, output_shape=output_shape, bias_axes=bias_axes)
    dense.build(shape)
    if bias:
        dense.bias.assign(np.random.default_rng(3).normal(size=dense.bias.shape).astype("float32"))
    dense.quantize("int8")
    signature = [tf.TensorSpec((None, None) + shape[2:], tf.float32, name="x")]
    variables = list(dense.variables)
    proto = onnx_export._convert(lambda t: {"y": dense(t)}, signature, 17, None, variables=variables)
    feeds = {}
    for graph_input in proto.graph.input[1:]:
        feeds[graph_input.name] = np.asarray(variables[int(graph_input.name.rsplit("_", 1)[1])])
    x = np.random.default_rng(2).normal(size=(3, 5) + shape[2:]).astype("float32")
    return dense, proto, feeds, x


@pytest.mark.parametrize("equation", ["btd,dhk->bthk", "bthk,hkd->btd"])
def test_a_converted_int8_projection_multiplies_uint8_by_int8(equation, tmp_path):
    """The package's int8 projection (`_quantized_projection.int8_call`) through the export's conversion."""
    dense, proto, feeds, x = converted_projection(equation)
    products = _a_zero_points(proto.graph)
    assert products and all(z is not None and z.data_type == TensorProto.UINT8 for _, z in products), products
    got = _session(proto).run(None, {"x": x, **feeds})[0]
    # The same integers multiplied and the same float rescale as the layer's own call.
    np.testing.assert_allclose(got, np.asarray(dense(x)), rtol=4 * np.finfo("float32").eps, atol=0)


@pytest.mark.parametrize("equation", ["btd,dhk->bthk", "bthk,hkd->btd"])
def test_an_int8_projection_rescales_the_product_itself(equation):
    """``MatMulInteger -> Cast -> Div``, nothing between: the projection's rescale reads the 2-D product, as
    Keras' int8 `Dense` does (the reshape to heads comes after), so every integer product of an export has one
    pattern, the one onnxruntime's integer-to-float fusion matches."""
    _, proto, _, _ = converted_projection(equation)
    producer = {output: node for node in proto.graph.node for output in node.output}
    readers = collections.defaultdict(list)
    for node in proto.graph.node:
        for name in node.input:
            readers[name].append(node.op_type)
    products = [node for node in proto.graph.node if node.op_type == "MatMulInteger"]
    assert len(products) == 1
    (cast,) = [node for node in proto.graph.node if products[0].output[0] in node.input]
    assert cast.op_type == "Cast" and readers[cast.output[0]] == ["Div"]
    (div,) = [node for node in proto.graph.node if cast.output[0] in node.input]
    assert producer[div.input[1]].op_type == "Mul"  # the product of the two scales, as Keras writes it
