"""Memory of `export_onnx` and `verify`: no whole copy of a weight while writing, one session at a time in verify.

The write-out is checked with `tracemalloc` (numpy's buffers and Python's bytes
are traced): writing weights of `W` bytes each, in slices of `CHUNK_BYTES`
lowered to `W / 16`, must never hold half a weight. Holding a whole weight at
once (its ``numpy()`` copy, its serialized tensor) passes that bound; the
slices do not come near it. The bytes written are those of the one-shot
serialization (`numpy_helper.from_array`), bit for bit.

`verify` must hold at most one onnxruntime session (one copy of the weights):
the model graph's session is made after the weight checks and is freed before
the step and generate graphs load theirs. On the CPU, those sessions read
every weight the weight check proved equal from the model's own buffers (the
OrtValue given to the session points at the variable's memory: no copy), and a
weight that differs is loaded from the file, so the outputs show what the file
holds.

The generate graph's loop body must compute nothing from weights alone:
onnxruntime folds such work (a reshaped kernel, a transposed tied embedding)
into one more constant for each place it is computed, so it is done once, in
front of the Loop (structural check on the export, and an onnxruntime run of a
hand-made Loop before and after the move).
"""

import gc
import importlib
import io
import os
import tracemalloc
import weakref

import keras
import numpy as np
import onnx
import pytest
from onnx import ModelProto, numpy_helper

from keras_linattn import export
from keras_linattn.export import _onnx_graph, _onnx_publish, _verify_decoding, _verify_sessions, _verify_weights
from tests import _shared_exports
from tests.tolerance import assert_close

pytestmark = pytest.mark.tf_only("ONNX export runs on TensorFlow")

verify_module = importlib.import_module("keras_linattn.export.verify")

_ROWS, _COLS = 512, 1024  # one float32 weight: 2 MiB
_WEIGHT_BYTES = _ROWS * _COLS * 4


def _variables(count=3):
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.normal(size=(_ROWS, _COLS)).astype("float32"), name=f"w{i}") for i in range(count)]


def _peak_traced(fn):
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_onnx_publish, "CHUNK_BYTES", _WEIGHT_BYTES // 16)


def test_external_data_is_written_without_a_whole_weight_in_memory(small_chunks, tmp_path):
    variables = _variables()
    layout = {}

    def write():
        layout["offsets"], _ = _onnx_publish.write_external_data(tmp_path / "w.data", variables, [0, 1, 2], "e")

    peak = _peak_traced(write)
    assert peak < _WEIGHT_BYTES / 2, f"{peak} bytes traced at once writing weights of {_WEIGHT_BYTES} bytes"
    data = (tmp_path / "w.data").read_bytes()
    for i, variable in enumerate(variables):
        offset, length = layout["offsets"][i]
        assert data[offset : offset + length] == variable.numpy().tobytes()


def test_inline_weights_are_written_without_a_whole_weight_in_memory(small_chunks, tmp_path):
    variables = _variables()
    names = [v.name for v in variables]
    proto = ModelProto()
    peak = _peak_traced(
        lambda: _onnx_publish.save_with_weights(proto, tmp_path / "m.onnx", [0, 1, 2], variables, names)
    )
    assert peak < _WEIGHT_BYTES / 2, f"{peak} bytes traced at once writing weights of {_WEIGHT_BYTES} bytes"
    loaded = ModelProto.FromString((tmp_path / "m.onnx").read_bytes())
    for tensor, variable in zip(loaded.graph.initializer, variables, strict=True):
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), variable.numpy())


def _external_file(folder, variables):
    names = [f"layer_{i}/kernel" for i in range(len(variables))]
    used = list(range(len(variables)))
    offsets, _ = _onnx_publish.write_external_data(folder / "m.data", variables, used, "e")
    layout = {"__file__": "m.data", "__index__": {names[i]: offsets[i] for i in used}}
    _onnx_publish.save_with_weights(ModelProto(), folder / "m.onnx", used, variables, names, layout)
    return dict(zip(names, variables, strict=True)), offsets


def test_external_weights_are_checked_without_a_whole_weight_in_memory(small_chunks, tmp_path):
    weights, offsets = _external_file(tmp_path, _variables())
    checks = []
    peak = _peak_traced(lambda: checks.append(_verify_weights.check_by_name(weights, str(tmp_path / "m.onnx"))))
    assert checks[0].exact == 3 and not checks[0].missing, checks[0].detail()
    assert peak < _WEIGHT_BYTES / 2, f"{peak} bytes traced at once checking weights of {_WEIGHT_BYTES} bytes"
    with open(tmp_path / "m.data", "r+b") as f:  # one element of the last slice of the second weight
        f.seek(offsets[1][0] + offsets[1][1] - 4)
        f.write(np.float32(1e30).tobytes())
    check = _verify_weights.check_by_name(weights, str(tmp_path / "m.onnx"))
    assert [name for name, _ in check.missing] == ["layer_1/kernel"], check.detail()


@pytest.mark.parametrize(
    "shape, dtype",
    [((_ROWS, _COLS), "float32"), ((300, 7, 3), "bfloat16"), ((33,), "float16"), ((), "float32"), ((0, 4), "int8")],
)
def test_an_inline_weight_is_the_bytes_of_its_one_shot_serialization(small_chunks, shape, dtype):
    value = np.random.default_rng(1).normal(size=shape) * 10
    variable = keras.Variable(value.astype(np.float32), dtype=dtype, name="w")
    want = ModelProto()
    want.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(variable.numpy()), "dense/kernel"))
    got = io.BytesIO()
    _onnx_publish.write_initializer(got, variable, "dense/kernel")
    assert got.getvalue() == want.SerializeToString()


def _weight_only_body_nodes(proto, weights):
    """The nodes of each Loop body that compute from weights and constants alone (and read a weight)."""
    import onnx

    found = []
    for loop in (node for node in proto.graph.node if node.op_type == "Loop"):
        body = next(a.g for a in loop.attribute if a.name == "body")
        fixed = {init.name for init in body.initializer} | {n.output[0] for n in body.node if n.op_type == "Constant"}
        of_weights = set(weights)
        for node in body.node:
            if node.op_type == "Constant" or any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
                continue
            if all(not name or name in fixed or name in of_weights for name in node.input):
                if any(name in of_weights for name in node.input):
                    found.append(f"{node.op_type}({', '.join(node.input)})")
                    of_weights.update(node.output)
    return found


def test_the_generate_loop_computes_nothing_from_weights_alone():
    """onnxruntime folds work on weights alone into a constant per place it is computed: in the loop body,
    a second reshaped copy of each kernel and a second transposed tied embedding. It belongs in front of the
    Loop, once."""
    model, _, paths = _shared_exports.limited_export()
    proto = onnx.load(paths["generate"])
    weights = {t.name for t in proto.graph.initializer if t.name in {v.path for v in model.weights}}
    assert weights
    found = _weight_only_body_nodes(proto, weights)
    assert not found, found[:5]


def _loop_reading_a_transposed_weight():
    """``y = x @ W^T`` before the Loop; the Loop body computes ``y = y @ reshape(W^T)`` n times."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Transpose", ["W"], ["wt_body"], perm=[1, 0]),
            helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([3, 3], "int64"))),
            helper.make_node("Reshape", ["wt_body", "shape"], ["wt_flat"]),
            helper.make_node("MatMul", ["y_in", "wt_flat"], ["y_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_in", TensorProto.FLOAT, [1, 3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [1, 3]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "wt"], ["y0"]),
            helper.make_node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
            helper.make_node("Loop", ["n", "true", "y0"], ["y"], body=body),
        ],
        "loop",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("kla_weight_0", TensorProto.FLOAT, [3, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    _onnx_graph._rename_inputs(model.graph, {"W": "kla_weight_0"})
    return model


def test_weight_only_loop_work_moves_in_front_of_the_loop_and_merges():
    import onnxruntime as ort

    model = _loop_reading_a_transposed_weight()
    w = (np.random.default_rng(0).normal(size=(3, 3)) * 0.5).astype("float32")
    feeds = {"n": np.array(4, "int64"), "x": np.array([[1.0, -2.0, 0.5]], "float32"), "kla_weight_0": w}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    want = run(model)
    assert _onnx_graph._hoist_weight_ops(model.graph) == 2  # the Transpose (merged) and the Reshape (moved)
    onnx.checker.check_model(model)
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Transpose") == 1 and "Reshape" in ops[: ops.index("Loop")]
    body = next(a.g for a in model.graph.node[-1].attribute if a.name == "body")
    assert [node.op_type for node in body.node if node.op_type != "Constant"] == ["Identity", "MatMul"]
    np.testing.assert_array_equal(run(model)[0], want[0])


def _two_loops_defining_the_same_names():
    """Two Loops whose bodies each compute ``t`` (a transpose, then a reshape, of the weight): valid ONNX, since
    sibling bodies may define the same name."""
    from onnx import TensorProto, helper

    def body(second):
        work = [helper.make_node("Transpose", ["kla_weight_0"], ["t"], perm=[1, 0])]
        initializers = []
        if second:
            initializers = [numpy_helper.from_array(np.array([4, 4], "int64"), "s")]
            work = [helper.make_node("Reshape", ["kla_weight_0", "s"], ["t"])]
        return helper.make_graph(
            [
                helper.make_node("Identity", ["c_in"], ["c_out"]),
                *work,
                helper.make_node("MatMul", ["v", "t"], ["v_out"]),
            ],
            "body",
            [
                helper.make_tensor_value_info("i", TensorProto.INT64, []),
                helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 4]),
            ],
            [
                helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4]),
            ],
            initializer=initializers,
        )

    graph = helper.make_graph(
        [
            helper.make_node("Loop", ["n", "", "x"], ["y1"], body=body(False)),
            helper.make_node("Loop", ["n", "", "y1"], ["y2"], body=body(True)),
        ],
        "loops",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("kla_weight_0", TensorProto.FLOAT, [4, 4]),
        ],
        [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_work_moved_out_of_two_loops_that_define_the_same_name_keeps_the_graph_valid():
    import onnxruntime as ort

    model = _two_loops_defining_the_same_names()
    onnx.checker.check_model(model)
    w = (np.random.default_rng(0).normal(size=(4, 4)) * 0.5).astype("float32")
    feeds = {"n": np.array(3, "int64"), "x": np.array([[1.0, -2.0, 0.5, 3.0]], "float32"), "kla_weight_0": w}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    want = run(model)
    assert _onnx_graph._hoist_weight_ops(model.graph) == 2  # the Transpose and the Reshape, each in front of its Loop
    onnx.checker.check_model(model)  # SSA: the two moved values have different names in the outer scope
    assert [node.op_type for node in model.graph.node] == ["Transpose", "Loop", "Constant", "Reshape", "Loop"]
    np.testing.assert_array_equal(run(model)[0], want[0])


def test_an_omitted_optional_output_before_the_loop_is_not_read_for_the_bodys_value():
    """The graph splits the weight keeping only the first half (second output ""); the body reads the second half
    of the same Split: it must keep computing it, not read the omitted name."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c_in"], ["c_out"]),
            helper.make_node("Split", ["kla_weight_0"], ["b1", "b2"], axis=0, num_outputs=2),
            helper.make_node("MatMul", ["v", "b2"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, 4]),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Split", ["kla_weight_0"], ["a", ""], axis=0, num_outputs=2),
            helper.make_node("MatMul", ["x", "a"], ["x1"]),
            helper.make_node("Loop", ["n", "", "x1"], ["y"], body=body),
        ],
        "split",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("kla_weight_0", TensorProto.FLOAT, [8, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    # Small integers: every product and sum is exact in float32, so the expected value is exact (onnxruntime
    # crashes running the graph as it is before the move, so it is computed here).
    w = np.random.default_rng(0).integers(-2, 3, size=(8, 4)).astype("float32")
    x = np.array([[1.0, -2.0, 0.0, 3.0]], "float32")
    want = x @ w[:4] @ w[4:] @ w[4:] @ w[4:]
    assert _onnx_graph._hoist_weight_ops(model.graph) == 1  # the body's Split, moved in front of the Loop
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"n": np.array(3, "int64"), "x": x, "kla_weight_0": w})[0]
    np.testing.assert_array_equal(got, want)


def test_verify_holds_one_onnx_session_at_a_time(monkeypatch):
    model, _, paths = _shared_exports.limited_export()
    sessions = []

    class Recorded(verify_module.OnnxPredictor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.append(weakref.ref(self))

    def alive():
        gc.collect()
        return [ref() for ref in sessions if ref() is not None]

    seen = {}

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = len(alive())
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(verify_module, "OnnxPredictor", Recorded)
    monkeypatch.setattr(_verify_weights, "check_files", recording("weights", _verify_weights.check_files))
    monkeypatch.setattr(_verify_decoding, "check_decoding", recording("decoding", _verify_decoding.check_decoding))
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=3)
    assert report.ok, report
    assert len(sessions) == 1  # the model graph's session was made
    assert seen == {"weights": 0, "decoding": 0}, f"model graph sessions alive when each check began: {seen}"


def _recorded_sessions(monkeypatch):
    """The ``(names, shared OrtValues)`` of each `_verify_sessions.session_options` call of verify."""
    calls = []
    made = _verify_sessions.session_options

    def recording(model, names, device):
        options, shared = made(model, names, device)
        calls.append((list(names or ()), list(shared)))
        return options, shared

    monkeypatch.setattr(_verify_sessions, "session_options", recording)
    return calls


def _file_weights(model, path):
    """The model's float weights stored in `path` by name."""
    stored = {t.name for t in onnx.load(path, load_external_data=False).graph.initializer}
    return {v.path: v for v in model.weights if v.path in stored and "float" in str(v.dtype)}


def test_verify_sessions_read_every_weight_from_the_models_buffers(monkeypatch):
    model, _, paths = _shared_exports.limited_export()
    calls = _recorded_sessions(monkeypatch)
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=3)
    assert report.ok, report
    assert len(calls) == 2  # the model graph's session, then the step and generate graphs'
    for path, (names, shared) in zip([paths["model"], paths["step"]], calls, strict=True):
        weights = _file_weights(model, path)
        assert weights and sorted(names) == sorted(weights), f"{path}: {sorted(set(weights) - set(names))[:3]}"
        assert len(shared) == len(names)
        for name, value in zip(names, shared, strict=True):  # the session reads the variable's memory
            assert value.data_ptr() == _verify_sessions.buffer_view(weights[name]).ctypes.data, name


def test_verify_without_the_weight_check_loads_the_files_weights(monkeypatch):
    model, _, paths = _shared_exports.limited_export()
    calls = _recorded_sessions(monkeypatch)
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=3, check_weights=False)
    assert report.ok, report
    assert calls and all(not shared for _, shared in calls)


def test_a_weight_view_is_the_variables_memory_and_bfloat16_is_not_shared():
    variable = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4), name="w")
    first, second = _verify_sessions.buffer_view(variable), _verify_sessions.buffer_view(variable)
    assert not first.flags.owndata and not first.flags.writeable
    assert first.ctypes.data == second.ctypes.data  # one buffer, not a copy per call
    np.testing.assert_array_equal(first, variable.numpy())
    assert _verify_sessions.buffer_view(keras.Variable(np.ones((2, 2), "float32"), dtype="bfloat16")) is None


@pytest.fixture(scope="module")
def external_export(tmp_path_factory):
    model, _, _ = _shared_exports.limited_export()
    folder = tmp_path_factory.mktemp("external")
    return model, export.export_onnx(model, str(folder / "lm.onnx"), external_data=True)


def test_a_damaged_external_weight_is_run_from_the_file_not_the_model(external_export, monkeypatch):
    """Only weights proven equal are shared: a damaged one fails its weight row and the outputs it reaches."""
    model, paths = external_export
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=2, raise_on_failure=False)
    assert report.ok, report
    name = "token_embedding/embeddings"
    tensor = next(t for t in onnx.load(paths["model"], load_external_data=False).graph.initializer if t.name == name)
    info = {entry.key: entry.value for entry in tensor.external_data}
    data = os.path.join(os.path.dirname(paths["model"]), info["location"])
    original = open(data, "rb").read()
    try:
        with open(data, "r+b") as f:  # every value of the embedding scaled by 2: all rows, every token reached
            f.seek(int(info["offset"]))
            stored = np.frombuffer(f.read(int(info["length"])), "float32")
            f.seek(int(info["offset"]))
            f.write((stored * 2).astype("float32").tobytes())
        calls = _recorded_sessions(monkeypatch)
        report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=2, raise_on_failure=False)
    finally:
        with open(data, "wb") as f:
            f.write(original)
    failed = {row.signature for row in report.failed}
    assert "lm.onnx:weights" in failed and "serving_default:logits" in failed, failed
    assert calls and all(name not in names for names, _ in calls)


def _transposed_weight_graph(path, rows, cols):
    """``y = x @ transpose(w)`` with ``w [rows, cols]`` an initializer: a weight-sized constant expression."""
    from onnx import TensorProto, helper

    w = np.random.default_rng(0).normal(size=(rows, cols)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
        "transposed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, cols])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, rows])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # one every onnxruntime of the supported range loads
    onnx.save(model, path)


def _optimized_ops(path, options, tmp_path):
    """The initializers of the graph an onnxruntime session runs with `options`, and its output for a fixed input."""
    import onnxruntime as ort

    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).normal(size=(2, session.get_inputs()[0].shape[1])).astype("float32")
    y = session.run(None, {"x": x})[0]
    return [t.name for t in onnx.load(options.optimized_model_filepath).graph.initializer], y


def test_verify_sessions_fold_no_weight_sized_constant(tmp_path):
    import onnxruntime as ort

    rows = _verify_sessions.FOLD_LIMIT_BYTES // (4 * 256) + 16  # w^T is a little over the limit
    path = str(tmp_path / "transposed.onnx")
    _transposed_weight_graph(path, rows, 256)
    defaults = ort.SessionOptions()
    defaults.log_severity_level = 3
    folded_constants, folded = _optimized_ops(path, defaults, tmp_path)
    assert folded_constants != ["w"]  # onnxruntime's default: w^T becomes a constant the session owns
    options, shared = _verify_sessions.session_options(None, [], "cpu")
    assert shared == []
    kept_constants, kept = _optimized_ops(path, options, tmp_path)
    assert kept_constants == ["w"]  # verify's sessions: the graph reads w itself
    # The same product (onnxruntime may fuse the transpose into the matmul: another summation order).
    assert_close(kept, folded, n=256, paths=2, what="x @ w^T unfolded against folded")
