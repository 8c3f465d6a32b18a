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
