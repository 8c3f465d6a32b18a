"""tools/onnx_fingerprint.py: equal for the same graphs written in another order and with other generated names.

The tool compares the exports of two versions of the code (an export is not
byte-reproducible: tf2onnx's node order and generated names vary from one
conversion to the next). It must see through exactly that, and nothing else:
a different value, attribute, weight name or graph input gives a different
fingerprint.
"""

import importlib.util
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from keras_linattn.export import _onnx_files

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("onnx_fingerprint", _ROOT / "tools" / "onnx_fingerprint.py")
onnx_fingerprint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(onnx_fingerprint)


def _body(prefix, weight):
    """A Loop body that adds the outer `weight` to its carried value, its tensors named with `prefix`."""
    nodes = [
        helper.make_node("Identity", [f"{prefix}cond_in"], [f"{prefix}cond_out"], name=f"{prefix}n0"),
        helper.make_node("Add", [f"{prefix}v_in", weight], [f"{prefix}v_out"], name=f"{prefix}n1"),
    ]
    inputs = [
        helper.make_tensor_value_info(f"{prefix}i", TensorProto.INT64, []),
        helper.make_tensor_value_info(f"{prefix}cond_in", TensorProto.BOOL, []),
        helper.make_tensor_value_info(f"{prefix}v_in", TensorProto.FLOAT, [2]),
    ]
    outputs = [
        helper.make_tensor_value_info(f"{prefix}cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info(f"{prefix}v_out", TensorProto.FLOAT, [2]),
    ]
    return helper.make_graph(nodes, f"{prefix}body", inputs, outputs)


def _model(names, reverse=False, const=(1.0, 2.0), weight="model/kernel", alpha=0.5):
    """``y = Loop(LeakyRelu(x) + c, kernel) ; z = x * kernel`` with generated names taken from `names`.

    tf2onnx's constants are named after a TensorFlow tensor (``...:0``), its nodes and tensors with a counter.
    """
    c, t, n = names
    c, trips, cond = (f"{c}{k}:0" for k in range(3))
    initializers = [
        numpy_helper.from_array(np.array(const, "float32"), c),
        numpy_helper.from_array(np.array([3.0, 4.0], "float32"), weight),
        numpy_helper.from_array(np.array(2, "int64"), trips),
        numpy_helper.from_array(np.array(True), cond),
    ]
    branch_a = [
        helper.make_node("LeakyRelu", ["x"], [f"{t}0"], name=f"{n}0", alpha=alpha),
        helper.make_node("Add", [f"{t}0", c], [f"{t}1"], name=f"{n}1"),
        helper.make_node("Loop", [trips, cond, f"{t}1"], ["y"], name=f"{n}2", body=_body(t, weight)),
    ]
    branch_b = [helper.make_node("Mul", ["x", weight], ["z"], name=f"{n}3")]
    nodes = branch_b + branch_a if reverse else branch_a + branch_b
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [2]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _fingerprint(model, path):
    onnx.save(model, path)
    return onnx_fingerprint.fingerprint(path)


def test_same_graphs_in_another_order_and_with_other_generated_names_match(tmp_path):
    a = _fingerprint(_model(("Const_", "t_", "node_")), tmp_path / "a.onnx")
    b = _fingerprint(_model(("Add/y_", "other__7_", "n__9_"), reverse=True), tmp_path / "b.onnx")
    assert a == b


@pytest.mark.parametrize(
    "change",
    [{"const": (1.0, 2.5)}, {"alpha": 0.25}, {"weight": "model/other_kernel"}],
    ids=["constant value", "attribute", "weight name"],
)
def test_a_different_graph_does_not_match(tmp_path, change):
    names = ("Const_", "t_", "node_")
    assert _fingerprint(_model(names), tmp_path / "a.onnx") != _fingerprint(
        _model(names, **change), tmp_path / "b.onnx"
    )


def test_data_files_are_compared_after_their_header(tmp_path):
    header = onnx_fingerprint._DATA_HEADER
    assert header == _onnx_files.ALIGN  # the header `_onnx_publish` writes before the weights
    (tmp_path / "a.data").write_bytes(b"export_id=1".ljust(header, b"\0") + b"weights")
    (tmp_path / "b.data").write_bytes(b"export_id=2".ljust(header, b"\0") + b"weights")
    (tmp_path / "c.data").write_bytes(b"export_id=2".ljust(header, b"\0") + b"weightz")
    a, b, c = (onnx_fingerprint.fingerprint(tmp_path / f"{k}.data") for k in "abc")
    assert a == b != c
