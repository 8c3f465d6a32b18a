"""The tf2onnx op handlers of `keras_linattn.export.onnx_export` against TensorFlow.

tf2onnx 1.17 converts integer FloorMod to a truncated Mod, has no Erfc,
and lowers a float SelectV2 to products that let a NaN through; the
handlers must give TensorFlow's results, negative operands and non-finite
values included.
"""

import math

import numpy as np
import onnxruntime as ort
import pytest
import tensorflow as tf

from keras_linattn.export import onnx_export
from tests.tolerance import assert_close


def _run_onnx(tmp_path, fn, signature, feeds):
    path = str(tmp_path / "op.onnx")
    onnx_export._convert_function(fn, signature, path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
def test_floor_mod_matches_tensorflow_with_negative_operands(tmp_path, dtype):
    a = np.array([-7, -6, -1, 0, 1, 5, 7, 13], dtype=dtype)
    b = np.array([3, -3, 4, 5, -2, 3, -4, 5], dtype=dtype)
    signature = [tf.TensorSpec([None], dtype, name="a"), tf.TensorSpec([None], dtype, name="b")]
    got = _run_onnx(tmp_path, lambda a, b: {"out": tf.math.floormod(a, b)}, signature, {"a": a, "b": b})
    expected = tf.math.floormod(a, b).numpy()
    np.testing.assert_array_equal(got, expected)
    # The truncated remainder differs on these operands: the check can fail.
    assert not np.array_equal(np.fmod(a, b), expected)


def test_erfc_matches_float64_oracle(tmp_path):
    x = np.linspace(-4.0, 4.0, 33, dtype="float32")
    signature = [tf.TensorSpec([None], "float32", name="x")]
    got = _run_onnx(tmp_path, lambda x: {"out": tf.math.erfc(x)}, signature, {"x": x})
    expected = np.array([math.erfc(v) for v in x.astype(np.float64)])  # float64 oracle
    # Elementwise (1 - erf(x)): no reduction, n=1; float32 against a float64 oracle: paths=1.
    assert_close(got, expected, n=1, what="erfc")
    # and TensorFlow's own erfc, which exact GELU calls, within the same model
    assert_close(tf.math.erfc(x).numpy(), expected, n=1, what="tf.math.erfc")


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool", "float16", "int8"])
def test_where_keeps_the_branch_not_taken_out_and_broadcasts(tmp_path, dtype):
    import onnx

    cond = np.array([[True], [False], [True]])  # [3, 1], broadcast against [3, 4]
    x = np.arange(12).reshape(3, 4).astype(dtype)
    y = np.ones((1, 4), dtype)
    if dtype.startswith("float"):
        y = np.array([[np.nan, np.inf, -np.inf, 2.0]], dtype)  # never selected in rows 0 and 2
    signature = [
        tf.TensorSpec([None, 1], "bool", name="cond"),
        tf.TensorSpec([None, 4], dtype, name="x"),
        tf.TensorSpec([1, 4], dtype, name="y"),
    ]
    feeds = {"cond": cond, "x": x, "y": y}
    got = _run_onnx(tmp_path, lambda cond, x, y: {"out": tf.where(cond, x, y)}, signature, feeds)
    np.testing.assert_array_equal(got, tf.where(cond, x, y).numpy())  # NaN where TensorFlow has it, nowhere else
    nodes = [n.op_type for n in onnx.load(str(tmp_path / "op.onnx")).graph.node]
    assert nodes.count("Where") == 1 and "Mul" not in nodes, nodes
    assert nodes.count("Cast") == (0 if dtype in ("float32", "int32") else 3), nodes  # through a wider type and back
