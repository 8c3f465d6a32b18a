"""ONNX exports with external data prove where their files come from, and an overwrite is never seen mixed.

Issue 56, findings 4-6: `OnnxPredictor` / `OnnxGenerator` ran on another
export's ``.data`` placed beside the graphs; an interrupted (or concurrent)
``export_onnx(external_data=True, overwrite=True)`` published the new
``.data`` before the graphs, so old graphs read new weights; a flipped byte in
``.data`` passed `check_pair`; a truncated ``.data`` gave onnxruntime's
"optimizer_execution_frame" error.

Two LMs of one architecture (the shared limited LM, A, and the same network
with other weights, B) are exported into the same place. A graph's weights
are inputs of the converted graph (onnx_export's module docstring), so the
converted graphs do not depend on the weights: after the first conversion of
each graph, the exports here reuse it (`_reuse_conversions`) and each costs a
write of the files only. What is tested is everything after the conversion:
the data file, the metadata, the staging, the publishing order, the lock, the
checks at load.

A kill is observed, as in tests/export/test_atomic_export.py, by copying the
directory at each instrumented point between two writes
(`keras_linattn._atomic.set_fault_hook`): a SIGKILL there leaves exactly
those files.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

from keras_linattn import _atomic, export
from keras_linattn.export import _specs, onnx_export
from tests import _shared_exports

pytestmark = pytest.mark.tf_only("ONNX export runs on TensorFlow")

IDS = np.array([[3, 7, 1, 9, 4], [2, 2, 8, 5, 11]], "int32")
PROMPT, MAX_LENGTH = IDS[:, :3], 9


@pytest.fixture(scope="module")
def _reuse_conversions():
    """`onnx_export._convert` converts each graph once; later exports get a copy with their own metadata."""
    real, cache = onnx_export._convert, {}

    def convert(fn, input_signature, opset, metadata, fast=True, variables=None):
        key = ((metadata or {}).get("graph"), opset, variables is None)
        if key not in cache:
            cache[key] = real(fn, input_signature, opset, None, fast=fast, variables=variables)
        proto = onnx.ModelProto()
        proto.CopyFrom(cache[key])
        if metadata is not None:
            entry = proto.metadata_props.add()
            entry.key, entry.value = onnx_export._METADATA_KEY, json.dumps(metadata)
        return proto

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_export, "_convert", convert)
        yield


@pytest.fixture(scope="module")
def models(_reuse_conversions):
    """(A, B): the limited LM and the same network with other weights."""
    return _shared_exports.built_limited_lm(), model_b()


def model_b():
    """The limited LM's network with other weights (also built by the killed process of the slow test)."""
    b = _shared_exports.built_limited_lm()
    rng = np.random.default_rng(99)
    for w in b.trainable_weights:
        w.assign((rng.standard_normal(w.shape) * 0.5).astype(w.dtype))
    return b


def _export(model, directory, **kwargs):
    return export.export_onnx(model, os.path.join(directory, "lm.onnx"), external_data=True, **kwargs)


def _outputs(directory, **options):
    """(export id of the model, its logits, export id of the step graph, its greedy tokens)."""
    predictor = export.OnnxPredictor(os.path.join(directory, "lm.onnx"), device="cpu", **options)
    logits = predictor({_specs.TOKEN_IDS: IDS})[_specs.LOGITS]
    generator = export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu", **options)
    tokens = generator.generate(PROMPT, max_length=MAX_LENGTH)
    return predictor.metadata["export_id"], logits, generator.metadata["export_id"], tokens


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    """Clean exports of A and B, and what their front ends return: ``{name: (dir, logits, tokens)}``."""
    out = {}
    for name, model in zip("AB", models, strict=True):
        directory = str(tmp_path_factory.mktemp(f"export_{name}"))
        _export(model, directory)
        _, logits, _, tokens = _outputs(directory)
        out[name] = (directory, logits, tokens)
    assert not np.array_equal(out["A"][1], out["B"][1])
    return out


def _data_file(graph):
    """The external data file a graph reads, as its initializers name it."""
    proto = onnx.load(graph, load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    info = {entry.key: entry.value for entry in tensor.external_data}
    return os.path.join(os.path.dirname(graph), info["location"]), info


def _copy(exported, name, tmp_path):
    return shutil.copytree(exported[name][0], str(tmp_path / name))


# ------------------------------------------------------------------ finding 4
def test_another_exports_data_beside_the_graphs_is_refused_at_load(exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    data, _ = _data_file(os.path.join(directory, "lm.onnx"))
    other, _ = _data_file(os.path.join(exported["B"][0], "lm.onnx"))
    shutil.copyfile(other, data)  # B's weights under the name A's graphs read
    with pytest.raises(ValueError, match="comes from another export") as info:
        export.OnnxPredictor(os.path.join(directory, "lm.onnx"), device="cpu")
    assert repr(data) in str(info.value)
    with pytest.raises(ValueError, match="comes from another export"):
        export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu")


def test_another_exports_generate_graph_is_refused_at_load(exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    shutil.copyfile(os.path.join(exported["B"][0], "lm_generate.onnx"), os.path.join(directory, "lm_generate.onnx"))
    with pytest.raises(ValueError, match="generate graph .* comes from another export"):
        export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu")


# ------------------------------------------------------------------ finding 6
def test_a_flipped_byte_in_the_data_is_found_by_check_pair_and_a_full_load(exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    model = os.path.join(directory, "lm.onnx")
    data, info = _data_file(model)
    with open(data, "r+b") as f:  # the exponent byte of a float32 weight: the value becomes huge
        f.seek(int(info["offset"]) + 3)
        byte = f.read(1)[0]
        f.seek(int(info["offset"]) + 3)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(ValueError, match="corrupted") as info:
        export.check_pair(model)
    assert repr(data) in str(info.value)
    with pytest.raises(ValueError, match="corrupted"):
        export.OnnxPredictor(model, device="cpu", verify="full")
    with pytest.raises(ValueError, match="corrupted"):
        export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu", verify="full")


def test_a_changed_companion_graph_is_found_by_a_full_check(exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    generate = os.path.join(directory, "lm_generate.onnx")
    with open(generate, "ab") as f:
        f.write(onnx.ModelProto(doc_string="edited").SerializeToString())  # still parses, same export id
    export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu")  # the fast check passes
    with pytest.raises(ValueError, match="not the file exported with"):
        export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu", verify="full")
    with pytest.raises(ValueError, match="not the file exported with"):
        export.check_pair(os.path.join(directory, "lm.onnx"))


# ------------------------------------------------------------- truncated data
def test_a_truncated_data_file_is_named_as_truncated(exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    data, _ = _data_file(os.path.join(directory, "lm.onnx"))
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    for make, path in (
        (export.OnnxPredictor, "lm.onnx"),
        (export.OnnxGenerator, "lm_step.onnx"),
        (export.check_pair, "lm.onnx"),
    ):
        with pytest.raises(ValueError, match=r"truncated \(incomplete\)") as info:
            make(os.path.join(directory, path), **({} if make is export.check_pair else {"device": "cpu"}))
        assert repr(data) in str(info.value), str(info.value)


def test_verify_must_be_fast_or_full(exported):
    with pytest.raises(ValueError, match="Received: verify='yes'"):
        export.OnnxPredictor(os.path.join(exported["A"][0], "lm.onnx"), device="cpu", verify="yes")


# ------------------------------------------------------------------ finding 5
def _snapshots_of(fn, tmp_path, source):
    """Runs `fn()`, copying `source` at each fault point; returns ``[(point, copy)]``."""
    snapshots = []

    def snapshot(point):
        dst = str(tmp_path / f"snap{len(snapshots):02d}")
        shutil.copytree(source, dst)
        snapshots.append((point, dst))

    previous = _atomic.set_fault_hook(snapshot)
    try:
        fn()
    finally:
        _atomic.set_fault_hook(previous)
    return snapshots


def _check_reader_view(directory, expected):
    """The model always loads and computes its own export's logits; the generator does, or refuses by name.

    `expected`: ``{export id: (logits, tokens)}``. Returns whether the generator loaded.
    """
    predictor = export.OnnxPredictor(os.path.join(directory, "lm.onnx"), device="cpu")
    logits = predictor({_specs.TOKEN_IDS: IDS})[_specs.LOGITS]
    np.testing.assert_array_equal(logits, expected[predictor.metadata["export_id"]][0])
    try:
        generator = export.OnnxGenerator(os.path.join(directory, "lm_step.onnx"), device="cpu")
        tokens = generator.generate(PROMPT, max_length=MAX_LENGTH)
    except ValueError as e:
        assert "comes from another export" in str(e) and directory in str(e), str(e)
        return False
    np.testing.assert_array_equal(tokens, expected[generator.metadata["export_id"]][1])
    return True


def _ids(directory):
    return {kind: onnx_export._read_metadata(os.path.join(directory, f)).get("export_id") for kind, f in _FILES}


_FILES = (("model", "lm.onnx"), ("step", "lm_step.onnx"), ("generate", "lm_generate.onnx"))


def _data_files(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".data"))


def test_overwrite_killed_at_every_point_never_pairs_two_exports(models, exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    id_a = _ids(directory)["model"]
    snapshots = _snapshots_of(lambda: _export(models[1], directory, overwrite=True), tmp_path, directory)
    id_b = _ids(directory)["model"]
    assert set(_ids(directory).values()) == {id_b} and _data_files(directory) == [
        os.path.basename(_data_file(os.path.join(directory, "lm.onnx"))[0])
    ]
    expected = {id_a: exported["A"][1:], id_b: exported["B"][1:]}
    refused = []
    for point, snap in snapshots:
        if not _check_reader_view(snap, expected):
            refused.append(point)
        for _dirpath, dirnames, filenames in os.walk(snap):  # nothing partial outside staging directories
            dirnames[:] = [d for d in dirnames if not _atomic.is_temporary(d)]
            assert not [f for f in filenames if _atomic.is_temporary(f)], (point, filenames)
    points = [p for p, _ in snapshots]
    for point in ("onnx:data_staged", "onnx:model_staged", "onnx:data_published", "onnx:step_published"):
        assert point in points, points
    assert points[-1] == "onnx:old_data_removed", points
    # Only between the generate graph's rename and the step graph's does a step graph name another export's.
    assert refused == ["onnx:generate_published"], refused


def test_an_overwrite_that_fails_midway_leaves_readable_files_and_the_next_one_cleans_up(models, exported, tmp_path):
    directory = _copy(exported, "A", tmp_path)
    id_a = _ids(directory)["model"]

    def fail(point):
        if point == "onnx:step_published":
            raise RuntimeError("injected")

    previous = _atomic.set_fault_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _export(models[1], directory, overwrite=True)
    finally:
        _atomic.set_fault_hook(previous)
    ids = _ids(directory)
    assert ids["model"] == id_a and ids["step"] == ids["generate"] != id_a
    assert len(_data_files(directory)) == 2  # A's, still read by A's model, and B's
    _check_reader_view(directory, {id_a: exported["A"][1:], ids["step"]: exported["B"][1:]})
    _export(models[1], directory, overwrite=True)  # the lock was released; the next export removes both
    assert len(set(_ids(directory).values())) == 1 and len(_data_files(directory)) == 1
    assert not [n for n in os.listdir(directory) if _atomic.is_temporary(n)]


def test_a_slow_writer_published_last_wins_whole(models, exported, tmp_path):
    """Writer A stages, then writer B runs a whole export, then A publishes: A's set, whole, is what is left."""
    directory = _copy(exported, "B", tmp_path)
    ran = []

    def fast_writer_in_between(point):
        if point == "onnx:model_staged" and not ran:
            ran.append(point)
            _export(models[1], directory, overwrite=True)

    previous = _atomic.set_fault_hook(fast_writer_in_between)
    try:
        _export(models[0], directory, overwrite=True)
    finally:
        _atomic.set_fault_hook(previous)
    assert ran
    ids = _ids(directory)
    assert len(set(ids.values())) == 1 and len(_data_files(directory)) == 1
    _, logits, _, tokens = _outputs(directory, verify="full")
    np.testing.assert_array_equal(logits, exported["A"][1])
    np.testing.assert_array_equal(tokens, exported["A"][2])
    export.check_pair(os.path.join(directory, "lm.onnx"))


def test_concurrent_writers_publish_one_after_the_other(models, exported, tmp_path):
    """Writer 2 reaches its publishing step while writer 1 publishes: it waits for the lock, then wins whole."""
    directory = _copy(exported, "A", tmp_path)
    main = threading.current_thread()
    second_staged, first_publishing = threading.Event(), threading.Event()
    seen, errors = {}, []

    def second_writer():
        try:
            _export(models[1], directory, overwrite=True)
        except Exception as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=second_writer)

    def hook(point):
        if threading.current_thread() is main:
            if point == "onnx:model_staged":
                thread.start()
                assert second_staged.wait(30)
            elif point == "onnx:data_published":  # writer 1 holds the lock
                first_publishing.set()
                time.sleep(0.5)  # writer 2, unblocked, would publish now without the lock
                seen["during"] = _data_files(directory)
        elif point == "onnx:model_staged":
            second_staged.set()
            assert first_publishing.wait(30)

    previous = _atomic.set_fault_hook(hook)
    try:
        _export(models[0], directory, overwrite=True)
        thread.join(120)
    finally:
        _atomic.set_fault_hook(previous)
    assert not errors, errors
    assert len(seen["during"]) == 2, seen  # the old export's data and writer 1's: writer 2 had not published
    ids = _ids(directory)
    assert len(set(ids.values())) == 1 and len(_data_files(directory)) == 1
    _, logits, _, tokens = _outputs(directory, verify="full")
    np.testing.assert_array_equal(logits, exported["B"][1])
    np.testing.assert_array_equal(tokens, exported["B"][2])


def test_an_export_without_recorded_digests_is_checked_by_its_tensors_extent(exported, tmp_path):
    """Graphs written before the digests name no ``data_file``: the header and the tensors' extent are checked."""
    directory = _copy(exported, "A", tmp_path)
    model = os.path.join(directory, "lm.onnx")
    proto = onnx.load(model, load_external_data=False)
    for entry in proto.metadata_props:
        if entry.key == onnx_export._METADATA_KEY:
            meta = json.loads(entry.value)
            del meta["data_file"], meta["digests"]
            entry.value = json.dumps(meta)
    onnx.save(proto, model)
    export.OnnxPredictor(model, device="cpu")  # whole: loads
    data, _ = _data_file(model)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(ValueError, match=r"truncated \(incomplete\)"):
        export.OnnxPredictor(model, device="cpu")


_KILLED_EXPORT = """
import sys
from keras_linattn import export
from tests.export.test_onnx_provenance import model_b
export.export_onnx(model_b(), sys.argv[1], external_data=True, overwrite=True)
"""


@pytest.mark.slow
def test_sigkill_at_the_publishing_steps_of_an_overwrite(models, exported, tmp_path):
    """A real process exporting B over A, SIGKILLed inside the publishing lock; then the next export runs."""
    directory = _copy(exported, "A", tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    id_a = _ids(directory)["model"]
    for point in ("onnx:data_published", "onnx:step_published", "onnx:old_data_removed"):
        run = subprocess.run(
            [sys.executable, "-c", _KILLED_EXPORT, os.path.join(directory, "lm.onnx")],
            env=dict(env, **{_atomic.KILL_ENV: point}),
            cwd=repo,
            capture_output=True,
            timeout=900,
        )
        assert run.returncode == -signal.SIGKILL, (point, run.stderr[-2000:])
        expected = {id_a: exported["A"][1:]}
        expected.update({i: exported["B"][1:] for i in set(_ids(directory).values()) if i != id_a})
        _check_reader_view(directory, expected)
    _export(models[0], directory, overwrite=True)  # the killed writers' lock is gone; their files are cleaned
    assert len(_data_files(directory)) == 1 and not [n for n in os.listdir(directory) if _atomic.is_temporary(n)]
    np.testing.assert_array_equal(_outputs(directory)[1], exported["A"][1])
