"""ONNX weights: one copy of each weight, named by its path; external data; verify finds any damaged copy.

`export_onnx` converts graphs that take the weights as inputs and stores each
weight once, as an initializer named by its Keras path. Checked here on the
shared limited LM export (`tests._shared_exports.limited_export`) and on one
export of the same model with its weights in external data (the path every
model past `EXTERNAL_DATA_THRESHOLD` takes, triggered here by the argument and
by a lowered threshold).
"""

import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from keras_linattn import export
from keras_linattn.export import _onnx_graph, _specs, _verify_weights, onnx_export
from tests import _shared_exports

pytestmark = pytest.mark.tf_only("ONNX export runs on TensorFlow")


def _all_tensors(graph, where="graph"):
    """``(name, array, where)`` of every initializer and Constant value, subgraphs included (inline data only)."""
    for tensor in graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            yield tensor.name, numpy_helper.to_array(tensor), where
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                yield node.name, numpy_helper.to_array(attribute.t), where
            elif attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_tensors(attribute.g, f"{where}/{node.name}")
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _all_tensors(sub, f"{where}/{node.name}")


def _weights(model):
    variables = onnx_export._export_variables(model)
    names = onnx_export._weight_names(variables)
    return {name: np.asarray(v.numpy()) for name, v in zip(names, variables, strict=True)}


def test_each_weight_is_stored_once_under_its_name():
    model, _, paths = _shared_exports.limited_export()
    weights = _weights(model)
    read_by_some_graph = set()
    for kind, path in paths.items():
        proto = onnx.load(path)
        stored = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
        for name, value in weights.items():
            if name in stored:
                read_by_some_graph.add(name)
                np.testing.assert_array_equal(stored[name], value, err_msg=f"{kind}: {name}")
        # No other tensor anywhere in the graph is a copy of a weight (transposed, reshaped or not).
        keys = {(v.size, np.sort(v, axis=None).tobytes()): n for n, v in weights.items() if v.size > 1 and v.std() > 0}
        for name, array, where in _all_tensors(proto.graph):
            if name in weights or array.dtype.kind != "f" or array.size <= 1:
                continue
            key = (array.size, np.sort(array.astype(np.float32), axis=None).tobytes())
            assert key not in keys, f"{kind}: {where} holds a copy of {keys[key]} as {name!r}"
    trainable = {n for n, v in weights.items() if v.size > 1}
    assert trainable <= read_by_some_graph, sorted(trainable - read_by_some_graph)
    assert onnx_export._read_metadata(paths["model"])["weights"] == "named"


@pytest.fixture(scope="module")
def external_export(tmp_path_factory):
    model = _shared_exports.built_limited_lm()
    out = tmp_path_factory.mktemp("external")
    paths = export.export_onnx(model, out / "lm.onnx", external_data=True)
    return model, out, paths


def test_external_data_keeps_the_weights_in_one_file_beside_the_graphs(external_export):
    model, out, paths = external_export
    export_id = onnx_export._read_metadata(paths["model"])["export_id"]
    data_name = f"lm.onnx.{export_id[:16]}.data"  # a name per export: an old graph never reads new weights
    assert paths["data"] == [str(out / data_name)]
    assert sorted(os.listdir(out)) == ["lm.onnx", data_name, "lm_generate.onnx", "lm_step.onnx"]
    weight_bytes = sum(v.nbytes for v in _weights(model).values())
    assert os.path.getsize(out / data_name) >= weight_bytes
    for kind in ("model", "step", "generate"):
        proto = onnx.load(paths[kind], load_external_data=False)
        external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert external and all(t.name in _weights(model) for t in external), kind
        assert not any(name in _weights(model) for name, _, _ in _all_tensors(proto.graph)), kind
    assert onnx_export._read_data_header(out / data_name) == export_id


def test_external_data_computes_what_inline_weights_compute(external_export):
    model, out, paths = external_export
    _, _, inline = _shared_exports.limited_export()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, _shared_exports.LIMITED_VOCAB, size=(2, 9)).astype("int32")
    got = export.OnnxPredictor(paths["model"], device="cpu").predict({"token_ids": ids})
    want = export.OnnxPredictor(inline["model"], device="cpu").predict({"token_ids": ids})
    np.testing.assert_array_equal(got["logits"], want["logits"])
    prompt = ids[:, :4]
    tokens = export.OnnxGenerator(paths["step"], device="cpu").generate(prompt, max_length=12)
    keras_tokens = np.asarray(model.generate(prompt, max_length=12, stop_token_ids=None))
    np.testing.assert_array_equal(tokens, keras_tokens)


def test_verify_passes_on_external_data(external_export):
    model, out, paths = external_export
    report = export.verify(model, onnx_path=paths["model"], shapes=[(1, 5)], decode_steps=4)
    weight_rows = [r for r in report.rows if r.signature.endswith(":weights")]
    assert len(weight_rows) == 3 and all(r.ok for r in weight_rows)


def test_a_missing_or_foreign_data_file_is_named(external_export, tmp_path):
    _, out, paths = external_export
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = copy / os.path.basename(paths["data"][0])
    raw = bytearray(data.read_bytes())
    raw[40:72] = b"0" * 32  # another export id in the header
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="another export"):
        onnx_export.check_pair(copy / "lm.onnx")
    os.remove(data)
    with pytest.raises(ValueError, match="missing"):
        onnx_export.check_pair(copy / "lm.onnx")


def _damage_inline(path, name, index, factor):
    proto = onnx.load(path)
    for tensor in proto.graph.initializer:
        if tensor.name == name:
            array = numpy_helper.to_array(tensor).copy()
            array.flat[index] *= factor
            tensor.CopyFrom(numpy_helper.from_array(array, name))
            break
    else:
        raise AssertionError(f"{name} not in {path}")
    onnx.save(proto, path)


def _embedding_name(model):
    return next(n for n in _weights(model) if n.endswith("token_embedding/embeddings"))


@pytest.mark.parametrize("kind", ["model", "step", "generate"])
def test_one_damaged_element_of_any_graph_is_found_by_name(kind, tmp_path):
    model, _, paths = _shared_exports.limited_export()
    path = str(tmp_path / os.path.basename(paths[kind]))
    shutil.copy(paths[kind], path)
    name = _embedding_name(model)
    # The last row of the embedding, which no verify input needs to reach, by one part in 10^4.
    _damage_inline(path, name, -1, 1 + 1e-4)
    check = _verify_weights.check_by_name(_verify_weights.model_weights(model, skip_constant=False), path)
    assert [m[0] for m in check.missing] == [name], check.detail()
    assert "values differ" in check.detail()


def test_verify_fails_on_a_damaged_step_graph(tmp_path):
    model, _, paths = _shared_exports.limited_export()
    copy = tmp_path / "onnx"
    shutil.copytree(os.path.dirname(paths["model"]), copy)
    step = str(copy / os.path.basename(paths["step"]))
    name = _embedding_name(model)
    _damage_inline(step, name, -1, 1 + 1e-4)
    model_path = str(copy / os.path.basename(paths["model"]))
    report = export.verify(model, onnx_path=model_path, shapes=[(1, 5)], decode_steps=2, raise_on_failure=False)
    failed = [r for r in report.failed if r.signature.endswith(":weights")]
    assert len(failed) == 1 and name in failed[0].detail, [(r.signature, r.detail) for r in report.rows]
    assert os.path.basename(step) in failed[0].signature


def test_verify_fails_on_damaged_external_data(external_export, tmp_path):
    model, out, paths = external_export
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    name = _embedding_name(model)
    proto = onnx.load(copy / "lm.onnx", load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    info = {e.key: e.value for e in tensor.external_data}
    with open(copy / os.path.basename(paths["data"][0]), "r+b") as f:
        f.seek(int(info["offset"]) + 4)
        value = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(int(info["offset"]) + 4)
        f.write(np.float32(value * 100).tobytes())
    report = export.verify(
        model, onnx_path=str(copy / "lm.onnx"), shapes=[(1, 3)], decode_steps=2, raise_on_failure=False
    )
    failed = [r for r in report.failed if r.signature.endswith(":weights")]
    assert len(failed) == 3 and all(name in r.detail for r in failed)  # one data file, read by the three graphs


def test_the_size_threshold_picks_external_data(monkeypatch, tmp_path):
    model = _shared_exports.built_limited_lm()
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 100)
    paths = export.export_onnx(model, tmp_path / "m.onnx", include_step=False)
    export_id = onnx_export._read_metadata(paths["model"])["export_id"]
    assert paths["data"] == [str(tmp_path / f"m.onnx.{export_id[:16]}.data")]
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1 << 40)
    paths = export.export_onnx(model, tmp_path / "n.onnx", include_step=False)
    assert "data" not in paths and not [n for n in os.listdir(tmp_path) if n.startswith("n.onnx.")]
    with pytest.raises(ValueError, match="external_data"):
        export.export_onnx(model, tmp_path / "o.onnx", external_data="yes")


def test_an_existing_file_is_not_overwritten_without_overwrite(tmp_path):
    model = _shared_exports.built_limited_lm()
    path = tmp_path / "m.onnx"
    export.export_onnx(model, path, include_step=False)
    first = path.read_bytes()
    with pytest.raises(ValueError, match="overwrite=True"):
        export.export_onnx(model, path, include_step=False)
    assert path.read_bytes() == first
    first_id = onnx_export._read_metadata(path)["export_id"]
    export.export_onnx(model, path, include_step=False, overwrite=True)
    assert onnx_export._read_metadata(path)["export_id"] != first_id


def test_the_converted_graph_holds_no_weight_values():
    """The weights are inputs of what tf2onnx converts: its memory does not grow with them."""
    model = _shared_exports.built_limited_lm()
    specs = _specs.ModelSpecs(model)
    variables = onnx_export._export_variables(model)
    proto = onnx_export._convert(specs.step_fn(), specs.step_signature(), 17, None, variables=variables)
    weight_elements = sum(int(np.prod(v.shape)) for v in variables)
    constant_elements = sum(array.size for _, array, _ in _all_tensors(proto.graph))
    assert constant_elements < weight_elements / 4, (constant_elements, weight_elements)
    inputs = {i.name for i in proto.graph.input}
    assert sum(name.startswith("kla_weight_") for name in inputs) > 0


def test_verify_reports_nan_in_the_generate_graph_as_failed_rows(tmp_path):
    """A damaged generate graph that decodes NaN is a failed check in the report, not an exception."""
    model, _, paths = _shared_exports.limited_export()
    copy = tmp_path / "onnx"
    shutil.copytree(os.path.dirname(paths["model"]), copy)
    generate = str(copy / os.path.basename(paths["generate"]))
    name = _embedding_name(model)
    proto = onnx.load(generate)
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    array = numpy_helper.to_array(tensor).copy()
    array[:] = np.nan  # every logit NaN: no token can be drawn
    tensor.CopyFrom(numpy_helper.from_array(array, name))
    onnx.save(proto, generate)
    model_path = str(copy / os.path.basename(paths["model"]))
    report = export.verify(model, onnx_path=model_path, shapes=[(1, 5)], decode_steps=2, raise_on_failure=False)
    failed = {r.signature for r in report.failed}
    graph = os.path.basename(generate)
    assert {f"{graph}:weights", f"{graph}:greedy", f"{graph}:sampled"} <= failed, failed


def _loop_model(with_used_final=False):
    """``y = x; repeat n times: y = y @ W + b`` as an ONNX Loop whose W and b are carried unchanged."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["y_in", "w_in"], ["yw"]),
            helper.make_node("Add", ["yw", "b_in"], ["y_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_in", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [3, 3]),
            helper.make_tensor_value_info("b_in", TensorProto.FLOAT, [3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("w_in", TensorProto.FLOAT, [3, 3]),  # passed through
            helper.make_tensor_value_info("b_in", TensorProto.FLOAT, [3]),
        ],
    )
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.normal(size=(3, 3)) * 0.5).astype("float32"), "W")
    b = numpy_helper.from_array(rng.normal(size=(3,)).astype("float32"), "B")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])]
    if with_used_final:
        outputs.append(helper.make_tensor_value_info("b_final", TensorProto.FLOAT, [3]))
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
            helper.make_node("Loop", ["n", "true", "x", "W", "B"], ["y", "w_final", "b_final"], body=body),
        ],
        "loop",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3]),
        ],
        outputs,
        initializer=[w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("with_used_final", [False, True])
def test_loop_invariants_are_read_from_the_outer_scope(with_used_final):
    """onnxruntime copies loop-carried values into the Loop's outputs: a 1B generate graph whose
    weights were all carried unchanged ran past 19 GB. Hoisted, the body reads them from the outer
    scope and computes the same; a carried value whose final output is read stays carried."""
    import onnxruntime as ort

    model = _loop_model(with_used_final)
    feeds = {"n": np.array(4, "int64"), "x": np.array([[1.0, -2.0, 0.5]], "float32")}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    want = run(model)
    removed = _onnx_graph._hoist_loop_invariants(model.graph)
    onnx.checker.check_model(model)
    loop = model.graph.node[1]
    assert removed == (1 if with_used_final else 2)
    assert list(loop.input) == (["n", "true", "x", "B"] if with_used_final else ["n", "true", "x"])
    assert len(loop.output) == len(loop.input) - 2
    got = run(model)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_weight_is_carried_through_the_generate_loop():
    model, _, paths = _shared_exports.limited_export()
    proto = onnx.load(paths["generate"])
    weights = {t.name for t in proto.graph.initializer}
    loops = [node for node in proto.graph.node if node.op_type == "Loop"]
    assert loops
    for loop in loops:
        carried = set(loop.input[2:])
        assert not carried & weights, sorted(carried & weights)[:3]


def test_a_weight_no_node_reads_is_not_stored(tmp_path):
    """Dropout's seed states are variables that no inference graph reads: not initializers (onnxruntime warns)."""
    from keras_linattn.models import LinearCausalLM

    lm = LinearCausalLM(vocabulary_size=11, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, dropout=0.1)
    lm(np.zeros((1, 2), "int32"))
    seeds = [name for name in _weights(lm) if "seed_generator" in name]
    assert seeds  # the model has weights that inference never reads
    paths = export.export_onnx(lm, tmp_path / "lm.onnx")
    for kind, path in paths.items():
        proto = onnx.load(path)
        read = _onnx_graph._names_read(proto.graph)
        stored = {t.name for t in proto.graph.initializer}
        assert not [name for name in stored if name not in read], kind
        assert not stored & set(seeds), kind
        assert {i.name for i in proto.graph.input}.isdisjoint(seeds), kind
