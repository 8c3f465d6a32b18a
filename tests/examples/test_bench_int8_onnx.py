"""`benchmarks._int8_fusion`: the int8 products rewritten to onnxruntime's `MatMulIntegerToFloat` fusion pattern
(the ``fused`` variant of `benchmarks.bench_int8_onnx`) are fused by onnxruntime and keep Keras' values.

Bounds: the integer sums are exact on both sides; Keras rounds twice after them (the scales' product, the
division), the rewritten graph four times (`benchmarks._int8_fusion`): at most 6 float32 epsilons of the
rescaled product, then one rounding of the bias addition on each side.
"""

import numpy as np
import onnx
import pytest

from benchmarks import _int8_fusion
from tests.export.test_onnx_int8_products import converted_projection

pytestmark = [pytest.mark.numeric, pytest.mark.tf_only("ONNX export runs on TensorFlow")]

EPS = float(np.finfo("float32").eps)


def _with_weights_inside(proto, feeds):
    """The graph with its weight inputs as initializers, as `export_onnx` writes it (onnxruntime fuses a bias
    only when it is a constant initializer)."""
    from onnx import numpy_helper

    del proto.graph.input[1:]
    proto.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in feeds.items())
    return proto


def _optimized(proto, tmp_path):
    """(session, op types of the graph onnxruntime runs after its optimizations)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def _dense_graph():
    """Keras' own int8 `Dense` (bias 1-D: the pattern onnxruntime would fuse with the product), converted."""
    import keras
    import tensorflow as tf

    from keras_linattn.export import onnx_export

    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(24)
    dense.build((None, 32))
    dense.bias.assign(np.random.default_rng(3).normal(size=24).astype("float32"))
    dense.quantize("int8")
    variables = list(dense.variables)
    signature = [tf.TensorSpec((None, 32), tf.float32, name="x")]
    proto = onnx_export._convert(lambda t: {"y": dense(t)}, signature, 17, None, variables=variables)
    feeds = {i.name: np.asarray(variables[int(i.name.rsplit("_", 1)[1])]) for i in proto.graph.input[1:]}
    return dense, proto, feeds, np.random.default_rng(2).normal(size=(6, 32)).astype("float32")


def _bound(dense, x, want):
    """6 eps of the rescaled product (``want`` less the bias) plus a rounding of the addition on each side."""
    bias = np.asarray(dense.bias, np.float64)
    return 6 * EPS * np.abs(want - bias) + 2 * EPS * np.abs(want)


@pytest.mark.parametrize("layer", ["btd,dhk->bthk", "bthk,hkd->btd", "dense"])
def test_rewritten_products_run_fused_with_keras_values(layer, tmp_path):
    if layer == "dense":
        dense, proto, feeds, x = _dense_graph()
    else:
        dense, proto, feeds, x = converted_projection(layer, bias=True)
    proto = _with_weights_inside(proto, feeds)
    assert _int8_fusion.integer_to_float_products(proto.graph) == 1
    onnx.checker.check_model(proto)
    session, ops = _optimized(proto, tmp_path)
    assert ops.count("MatMulIntegerToFloat") == 1 and "MatMulInteger" not in ops, ops
    got = session.run(None, {"x": x})[0].astype(np.float64)
    want = np.asarray(dense(x), np.float64)
    assert (np.abs(got - want) <= _bound(dense, x, want)).all(), np.abs(got - want).max()


def test_the_bias_stays_out_of_the_fused_kernel(tmp_path):
    """onnxruntime's fused kernel scales a fused bias by a per-row ``a_scale`` too: the bias is added apart."""
    _, proto, feeds, _ = _dense_graph()
    proto = _with_weights_inside(proto, feeds)
    _int8_fusion.integer_to_float_products(proto.graph)
    _, ops = _optimized(proto, tmp_path)
    assert "Sub" in ops  # ``y - (-bias)``, the addition bit for bit


def _product_nodes(prefix, a):
    """uint8 ``a`` times the int8 ``W`` (zero point 128), cast and divided by ``Mul(s_<prefix>, v)``."""
    from onnx import TensorProto, helper

    return [
        helper.make_node("MatMulInteger", [a, "W", "zp"], [f"{prefix}_p"]),
        helper.make_node("Cast", [f"{prefix}_p"], [f"{prefix}_pf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", [f"{prefix}_s", "v"], [f"{prefix}_scale"]),
        helper.make_node("Div", [f"{prefix}_pf", f"{prefix}_scale"], [f"{prefix}_y"]),
    ]


def test_products_in_a_loop_body_and_outside_get_names_of_their_own():
    """The generate graph: the prompt's product and the Loop body's read the same outer scale ``v``; each scope's
    reciprocal of it is a new name (ONNX values are defined once across scopes)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    body = helper.make_graph(
        _product_nodes("b", "a") + [helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond_in", 9, [])],
        [helper.make_tensor_value_info("cond_out", 9, []), helper.make_tensor_value_info("b_y", 1, [1, 4])],
    )
    graph = helper.make_graph(
        _product_nodes("o", "a") + [helper.make_node("Loop", ["n", "true"], ["ys"], body=body)],
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 8]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("o_y", 1, [1, 4]), helper.make_tensor_value_info("ys", 1, [None, 1, 4])],
        [
            numpy_helper.from_array(rng.integers(-127, 128, (8, 4)).astype("int8"), "W"),
            numpy_helper.from_array(np.array(128, "uint8"), "zp"),
            numpy_helper.from_array(np.array(True), "true"),
            numpy_helper.from_array(np.array([0.5, 2.0, 4.0, 0.25], "float32"), "v"),
            numpy_helper.from_array(np.array([[8.0]], "float32"), "o_s"),
            numpy_helper.from_array(np.array([[8.0]], "float32"), "b_s"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    assert _int8_fusion.integer_to_float_products(model.graph) == 2
    onnx.checker.check_model(model)  # SSA across scopes
