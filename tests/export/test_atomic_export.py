"""Atomic exports: whatever moment an export is killed at, a server loads complete versions only.

What a server loads: TF Serving loads every integer-named directory of a
model's base path; an ONNX server loads ``<name>.onnx`` (and the decoder its
``_step.onnx``). A version is complete when every file matches the size and
sha256 recorded at export (`export.check_integrity`) and it loads through the
TF Serving path (`SavedModelRunner`).

The fast tests observe the files at every instrumented point between two
writes of an in-process export (`keras_linattn._atomic.set_fault_hook`: a
SIGKILL there leaves exactly those files, page cache included). The slow test
kills `python -m keras_linattn.cli export` with SIGKILL at several of those
points and at random moments, then reruns it.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_linattn import _atomic, cli, export
from keras_linattn.export import onnx_export, saved_model
from tests import _fault_exports
from tests._fault_exports import NAME
from tests.conftest import TEST_SEED
from tests.export.test_export import encoder

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def lm_files():
    """Two .keras files of the tiny LM with different weights (the first is the shared export's)."""
    return [_fault_exports.keras_file(0), _fault_exports.keras_file(1)]


def server_view(out):
    """What servers would load from a `keras-linattn export` dir: {version: description}, ONNX ids.

    Asserts that every version TF Serving would load is complete.
    """
    base = os.path.join(out, NAME)
    versions = {}
    for v in saved_model._existing_versions(base):
        versions[v] = export.check_integrity(os.path.join(base, str(v)))  # raises on a partial version
    onnx_ids = {}
    for kind, fname in (
        ("model", f"{NAME}.onnx"),
        ("step", f"{NAME}_step.onnx"),
        ("generate", f"{NAME}_generate.onnx"),
    ):
        path = os.path.join(out, "onnx", fname)
        if os.path.exists(path):
            onnx_ids[kind] = onnx_export._read_metadata(path)["export_id"]  # a complete, parseable graph
    return versions, onnx_ids


def _no_partial_files(out):
    """Outside staging directories, no file is a temporary or partial one."""
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames[:] = [d for d in dirnames if not _atomic.is_temporary(d)]
        for f in filenames:
            assert not _atomic.is_temporary(f), os.path.join(dirpath, f)


def _verify_files_or_named_error(out):
    """`verify`'s file checks: they pass, or name a half-finished export (never another exception)."""
    manifest_path = os.path.join(out, cli._MANIFEST)
    if not os.path.exists(manifest_path):
        return "no manifest"
    entry = cli._read_manifest(manifest_path)["models"][NAME]
    try:
        cli._check_saved_model(out, entry)
        cli._check_onnx(out, entry)
    except ValueError as e:
        message = str(e)
        assert "\n" not in message
        assert "did not finish" in message or "another export" in message, message
        return "named"
    return "ok"


def test_export_killed_at_every_point_leaves_complete_versions(tmp_path, lm_files, capsys):
    out = _fault_exports.copy_export(tmp_path / "exported")  # version 1 and its ONNX pair
    first_versions, first_onnx = server_view(out)
    assert list(first_versions) == [1]

    snapshots = []

    def snapshot(point):
        dst = str(tmp_path / f"snap{len(snapshots):02d}")
        shutil.copytree(out, dst)
        snapshots.append((point, dst))

    previous = _atomic.set_fault_hook(snapshot)
    try:
        assert cli.main(["export", lm_files[1], "--out", out, "--name", NAME]) == 0
    finally:
        _atomic.set_fault_hook(previous)
    capsys.readouterr()
    points = [p for p, _ in snapshots]
    for expected in (
        "saved_model:written",
        "saved_model:staged",
        "saved_model:published",
        "onnx:model_staged",
        "onnx:step_staged",
        "onnx:step_published",
        "onnx:generate_staged",
        "onnx:generate_published",
        "onnx:model_published",
        "cli:keras_copied",
        "cli:manifest_published",
    ):
        assert expected in points, points

    outcomes = {}
    for point, snap in snapshots:
        versions, onnx_ids = server_view(snap)  # every loadable version is complete
        published = points.index(point) >= points.index("saved_model:published")
        assert list(versions) == ([1, 2] if published else [1]), (point, list(versions))
        # The ONNX graphs present are whole; model and step differ only between the two renames.
        assert set(onnx_ids) == {"model", "step", "generate"}
        # All are staged first; then the generate graph is renamed, then the step graph, then the model.
        step_new = point == "onnx:step_published"
        generate_new = point in ("onnx:generate_published", "onnx:step_published")
        assert (onnx_ids["model"] != onnx_ids["step"]) == step_new, point
        assert (onnx_ids["model"] != onnx_ids["generate"]) == generate_new, point
        pair_torn = generate_new
        if pair_torn:
            with pytest.raises(ValueError, match="comes from another export"):
                onnx_export.check_pair(os.path.join(snap, "onnx", f"{NAME}.onnx"))
        _no_partial_files(snap)
        outcomes[point] = _verify_files_or_named_error(snap)
    # The manifest is replaced last: before that, verify checks the previous export and names
    # the ONNX files a half-finished export replaced; after it, everything is the new export.
    assert outcomes["saved_model:staged"] == "ok" and outcomes["onnx:step_published"] == "named"
    assert outcomes["cli:manifest_published"] == "ok"

    # The new version loads through the TF Serving path (the slow test runs the full `verify`).
    with export.SavedModelRunner(os.path.join(out, NAME, "2")) as runner:
        assert "step" in runner.signature_names


def test_stale_staging_dirs_are_removed_and_never_versions(tmp_path):
    base = tmp_path / "enc"
    base.mkdir()
    stale = base / ".tmp-killed"  # a killed export's staging dir (nobody holds its lock)
    (stale / "export" / "variables").mkdir(parents=True)
    (stale / "export" / "saved_model.pb").write_bytes(b"\x08\x01partial")
    legacy = base / ".tmp-old.onnx"  # a bare temporary file of an older version of this package
    legacy.write_bytes(b"partial")
    os.utime(legacy, (time.time() - 3600, time.time() - 3600))
    assert saved_model._existing_versions(str(base)) == []
    with _atomic.staging_dir(str(base)) as live:  # an export in progress in another process
        version_dir = export.export_saved_model(encoder("elu", causal=False), base, warmup=False)
        assert version_dir == str(base / "1")
        names = sorted(os.listdir(base))
        assert names == sorted(["1", os.path.basename(live)]), names  # the stale ones gone, the live one kept
    assert sorted(os.listdir(base)) == ["1"]
    assert saved_model._existing_versions(str(base)) == [1]


def test_version_is_taken_at_the_rename(tmp_path):
    """A version that appears while an export runs (another exporter) is not overwritten: the next one is taken."""
    base = tmp_path / "enc"
    model = encoder("elu", causal=False)
    assert export.export_saved_model(model, base, warmup=False) == str(base / "1")

    def other_exporter(point):
        if point == "saved_model:staged":
            shutil.copytree(base / "1", base / "2")

    previous = _atomic.set_fault_hook(other_exporter)
    try:
        assert export.export_saved_model(model, base, warmup=False) == str(base / "3")
    finally:
        _atomic.set_fault_hook(previous)
    assert saved_model._existing_versions(str(base)) == [1, 2, 3]
    with pytest.raises(ValueError, match="already exists"):
        export.export_saved_model(model, base, version=3, warmup=False)


def _set_export_id(path, export_id):
    """Rewrites an ONNX file's export id in place (as if it came from another export)."""
    import onnx

    proto = onnx.load(path)
    for entry in proto.metadata_props:
        if entry.key == onnx_export._METADATA_KEY:
            meta = json.loads(entry.value)
            meta["export_id"] = export_id
            entry.value = json.dumps(meta)
    onnx.save(proto, path)


def test_onnx_pair_names_the_missing_or_foreign_half(tmp_path, capsys):
    out = _fault_exports.copy_export(tmp_path / "exported")
    model_path = os.path.join(out, "onnx", f"{NAME}.onnx")
    step_path = os.path.join(out, "onnx", f"{NAME}_step.onnx")
    assert onnx_export.check_pair(model_path) == step_path
    meta_model, meta_step = onnx_export._read_metadata(model_path), onnx_export._read_metadata(step_path)
    assert meta_model["export_id"] == meta_step["export_id"] and meta_model["step_file"] == f"{NAME}_step.onnx"

    # A step graph of another export in its place: named, exit status 2, one line.
    _set_export_id(step_path, "0" * 32)
    with pytest.raises(ValueError, match="comes from another export"):
        onnx_export.check_pair(model_path)
    capsys.readouterr()
    assert cli.main(["verify", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{NAME}_step.onnx" in err, err

    # The step graph missing: named.
    os.remove(step_path)
    with pytest.raises(ValueError, match="step graph is missing"):
        onnx_export.check_pair(model_path)
    assert cli.main(["verify", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ONNX step graph") and "missing" in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- SIGKILL
KILL_POINTS = ["saved_model:written", "saved_model:staged", "onnx:step_published", "cli:keras_copied"]


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(_atomic.KILL_ENV, None)
    env.update(extra)
    return env


def assert_one_error_line(stderr):
    """No traceback; one ``error:`` line, the last one (TensorFlow's own start-up lines may precede it)."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], stderr


def _cli(args, **env):
    return [sys.executable, "-m", "keras_linattn.cli", *args], _env(**env)


@pytest.mark.slow
def test_sigkill_during_export_then_rerun(tmp_path, lm_files):
    """`keras-linattn export` killed at instrumented points and at random moments, then rerun."""
    out = _fault_exports.copy_export(tmp_path / "exported")
    rng = np.random.default_rng(TEST_SEED)
    kills = [("point", p) for p in KILL_POINTS] + [("delay", float(rng.uniform(2.0, 12.0))) for _ in range(2)]
    for kind, where in kills:
        cmd, env = _cli(["export", lm_files[1], "--out", out, "--name", NAME])
        if kind == "point":
            env[_atomic.KILL_ENV] = where
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if kind == "delay":
            try:
                proc.wait(timeout=where)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=600)
        if kind == "point":
            assert proc.returncode == -signal.SIGKILL, (where, proc.stderr.read()[-2000:])
        versions, onnx_ids = server_view(out)  # complete versions only
        assert versions and set(onnx_ids) >= {"model"}, (kind, where)
        _no_partial_files(out)
        # `verify` in a separate process: passes, or fails in one line with status 2 (no traceback).
        vcmd, venv = _cli(["verify", out, "--shapes", "1x3"])
        result = subprocess.run(vcmd, env=venv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode in (0, 2), (kind, where, result.stderr[-2000:])
        if result.returncode == 2:
            assert_one_error_line(result.stderr)
        # Reported with `pytest -s` (docs/faults.md quotes it).
        last = result.stderr.strip().splitlines()[-1] if result.returncode else "all checks passed"
        print(
            f"\nkilled at {kind} {where}: rc {proc.returncode}, versions {sorted(versions)}, "
            f"onnx model/step ids equal: {len(set(onnx_ids.values())) == 1}, verify exit {result.returncode}: {last}"
        )
    # A clean rerun: staging dirs of the killed exports removed, the next version, everything verifies.
    before = saved_model._existing_versions(os.path.join(out, NAME))
    cmd, env = _cli(["export", lm_files[1], "--out", out, "--name", NAME])
    subprocess.run(cmd, env=env, cwd=REPO_ROOT, check=True, capture_output=True, timeout=600)
    after = saved_model._existing_versions(os.path.join(out, NAME))
    assert after == before + [before[-1] + 1]
    for root in (out, os.path.join(out, NAME), os.path.join(out, "onnx"), os.path.join(out, "keras")):
        assert not [n for n in os.listdir(root) if _atomic.is_temporary(n)], os.listdir(root)
    vcmd, venv = _cli(["verify", out, "--shapes", "1x3"])
    result = subprocess.run(vcmd, env=venv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with open(os.path.join(out, cli._MANIFEST)) as f:
        assert json.load(f)["models"][NAME]["saved_model"] == os.path.join(NAME, str(after[-1]))
