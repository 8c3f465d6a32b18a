"""Corrupted inputs: every damaged file gives one clear error that names it.

Each case damages one file (truncated to half its size, or one byte flipped
in its middle) and checks the error of the entry point that reads it: a
ValueError whose message names the file, or, through ``keras-linattn``, one
``error:`` line on stderr and exit status 2 (never a traceback).

``KLA_FAULT_TABLE=FILE`` appends one markdown row per case (file, damage,
entry point, message): docs/faults.md's table is made that way.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import _atomic, cli, export
from keras_linattn.callbacks import BackupAndRestore
from tests import _fault_exports
from tests._fault_exports import NAME

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def flip_byte(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {"truncated": truncate, "byte flipped": flip_byte}


def _record(file, damage, entry_point, message):
    table = os.environ.get("KLA_FAULT_TABLE")
    if table:
        text = re.sub(r"/tmp/\S+?/(exported|backup|ckpt|files)/", r"\1/", " ".join(message.split()))
        text = re.sub(r"'/tmp/[^']*/", "'.../", text).replace("|", "\\|")
        with open(table, "a") as f:
            f.write(f"| `{file}` | {damage} | {entry_point} | {text} |\n")


def _verify_error(out, capsys):
    """`keras-linattn verify out` in-process: exit status 2 and one error line; returns it."""
    capsys.readouterr()
    assert cli.main(["verify", out, "--shapes", "1x3"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return lines[0]


# ------------------------------------------------------------- exported files
EXPORT_CASES = [
    # (file inside the export dir, damage, words the message must hold)
    (f"{NAME}/1/saved_model.pb", "truncated", ["saved_model.pb", "truncated"]),
    (f"{NAME}/1/saved_model.pb", "byte flipped", ["saved_model.pb", "corrupted"]),
    (f"{NAME}/1/variables/variables.data-00000-of-00001", "truncated", ["variables.data", "truncated"]),
    (f"{NAME}/1/variables/variables.data-00000-of-00001", "byte flipped", ["variables.data", "corrupted"]),
    (f"{NAME}/1/variables/variables.index", "truncated", ["variables.index", "truncated"]),
    (f"{NAME}/1/assets.extra/tf_serving_warmup_requests", "truncated", ["tf_serving_warmup_requests", "truncated"]),
    (f"{NAME}/1/assets.extra/keras_linattn.json", "truncated", ["keras_linattn.json"]),
    (f"onnx/{NAME}.onnx", "truncated", [f"onnx/{NAME}.onnx", "truncated"]),
    (f"onnx/{NAME}.onnx", "byte flipped", [f"onnx/{NAME}.onnx", "corrupted"]),
    (f"onnx/{NAME}_step.onnx", "truncated", [f"onnx/{NAME}_step.onnx", "truncated"]),
    (f"keras/{NAME}.keras", "truncated", [f"keras/{NAME}.keras", "not a readable .keras file"]),
    ("manifest.json", "truncated", ["manifest.json", "unreadable"]),
]


@pytest.mark.parametrize("rel,damage,words", EXPORT_CASES, ids=[f"{r}-{d}" for r, d, _ in EXPORT_CASES])
def test_verify_names_the_damaged_file(tmp_path, capsys, rel, damage, words):
    out = _fault_exports.copy_export(tmp_path / "exported")
    DAMAGE[damage](os.path.join(out, rel))
    line = _verify_error(out, capsys)
    for word in words:
        assert word in line, line
    _record(rel, damage, "`keras-linattn verify`", line)


def test_verify_process_prints_one_line_and_exits_2(tmp_path):
    """The console entry point as a process: no traceback, one `error:` line, status 2."""
    out = _fault_exports.copy_export(tmp_path / "exported")
    truncate(os.path.join(out, NAME, "1", "variables", "variables.data-00000-of-00001"))
    env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    result = subprocess.run(
        [sys.executable, "-m", "keras_linattn.cli", "verify", out],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    assert "variables.data-00000-of-00001 is truncated" in lines[-1]


def test_runtimes_name_a_truncated_onnx_file(tmp_path):
    """(A flipped byte inside a weight still parses: ONNX keeps no checksum. `verify` finds it by its sha256.)"""
    out = _fault_exports.copy_export(tmp_path / "exported")
    path = os.path.join(out, "onnx", f"{NAME}_step.onnx")
    truncate(path)
    for name, make in (("OnnxPredictor", export.OnnxPredictor), ("OnnxGenerator", export.OnnxGenerator)):
        with pytest.raises(ValueError, match=re.escape(repr(path))) as info:
            make(path, device="cpu")
        _record(f"onnx/{NAME}_step.onnx", "truncated", f"`{name}(path)`", str(info.value))
    with pytest.raises(ValueError, match=re.escape(repr(path))) as info:
        export.check_pair(os.path.join(out, "onnx", f"{NAME}.onnx"))
    _record(f"onnx/{NAME}_step.onnx", "truncated", "`export.check_pair(model)`", str(info.value))


def test_saved_model_runner_and_check_integrity_name_the_version(tmp_path):
    out = _fault_exports.copy_export(tmp_path / "exported")
    version = os.path.join(out, NAME, "1")
    truncate(os.path.join(version, "saved_model.pb"))
    with pytest.raises(ValueError, match=re.escape(repr(version))) as info:
        export.SavedModelRunner(version)
    _record(f"{NAME}/1/saved_model.pb", "truncated", "`SavedModelRunner(dir)`", str(info.value))
    with pytest.raises(ValueError, match="saved_model.pb is truncated") as info:
        export.check_integrity(version)
    _record(f"{NAME}/1/saved_model.pb", "truncated", "`export.check_integrity(dir)`", str(info.value))


def test_warmup_file(tmp_path):
    out = _fault_exports.copy_export(tmp_path / "exported")
    path = os.path.join(out, NAME, "1", "assets.extra", "tf_serving_warmup_requests")
    assert len(export.read_warmup_requests(path)) == 4
    truncate(path)
    with pytest.raises(ValueError, match=re.escape(repr(path))) as info:
        export.read_warmup_requests(path)
    _record(
        "assets.extra/tf_serving_warmup_requests", "truncated", "`export.read_warmup_requests(path)`", str(info.value)
    )


@pytest.mark.parametrize("command", ["export", "verify"])
def test_truncated_keras_file(tmp_path, capsys, command):
    path = str(tmp_path / "model.keras")
    shutil.copyfile(_fault_exports.keras_file(0), path)
    truncate(path)
    capsys.readouterr()
    if command == "export":
        assert cli.main(["export", path, "--out", str(tmp_path / "out")]) == 2
        line = capsys.readouterr().err.strip()
        assert line.count("\n") == 0 and repr(path) in line and "truncated or corrupted" in line, line
        assert not os.path.exists(tmp_path / "out" / "model")
        _record("model.keras", "truncated", "`keras-linattn export MODEL`", line)
    else:
        out = _fault_exports.copy_export(tmp_path / "exported")
        shutil.copyfile(path, os.path.join(out, "keras", f"{NAME}.keras"))
        line = _verify_error(out, capsys)
        assert f"{NAME}.keras" in line and "truncated or corrupted" in line


# ------------------------------------------------------------- training state
def _tiny_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(1e-2), "mse", run_eagerly=True)
    return model


def _backup(tmp_path):
    backup_dir = str(tmp_path / "backup")
    x = np.ones((4, 3), "float32")
    _tiny_model().fit(
        x,
        x[:, :2],
        epochs=1,
        batch_size=2,
        verbose=0,
        callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False)],
    )
    return backup_dir, x


@pytest.mark.parametrize("damage", ["truncated", "byte flipped"])
def test_damaged_backup_weights_name_the_file(tmp_path, damage):
    backup_dir, x = _backup(tmp_path)
    meta = BackupAndRestore(backup_dir).read_metadata()
    path = os.path.join(backup_dir, meta["weights"])
    DAMAGE[damage](path)
    with pytest.raises(ValueError, match=re.escape(repr(path))) as info:
        _tiny_model().fit(x, x[:, :2], epochs=2, batch_size=2, verbose=0, callbacks=[BackupAndRestore(backup_dir)])
    assert ("truncated" if damage == "truncated" else "corrupted") in str(info.value)
    _record("backup/backup-*.weights.h5", damage, "`fit(callbacks=[BackupAndRestore(dir)])`", str(info.value))


def test_damaged_backup_metadata_names_the_file(tmp_path):
    backup_dir, x = _backup(tmp_path)
    path = os.path.join(backup_dir, "latest.json")
    truncate(path)
    with pytest.raises(ValueError, match=re.escape(repr(path))) as info:
        _tiny_model().fit(x, x[:, :2], epochs=2, batch_size=2, verbose=0, callbacks=[BackupAndRestore(backup_dir)])
    _record("backup/latest.json", "truncated", "`fit(callbacks=[BackupAndRestore(dir)])`", str(info.value))


@pytest.mark.parametrize("which", ["index", "data"])
def test_damaged_tf_checkpoint_names_the_file(tmp_path, which):
    from examples.multi_worker.train import restore

    model = _tiny_model()
    step = tf.Variable(3, dtype=tf.int64)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, step=step), str(tmp_path / "ckpt"), 1)
    prefix = manager.save()
    target = prefix + (".index" if which == "index" else ".data-00000-of-00001")
    truncate(target)
    fresh = _tiny_model()
    with pytest.raises(ValueError, match=re.escape(repr(prefix))) as info:
        restore(tf.train.Checkpoint(model=fresh, step=tf.Variable(0, dtype=tf.int64)), str(tmp_path / "ckpt"))
    _record(
        f"ckpt/ckpt-1.{'index' if which == 'index' else 'data-00000-of-00001'}",
        "truncated",
        "`examples.multi_worker.train.restore`",
        str(info.value),
    )


def test_truncated_epoch_log_of_the_examples(tmp_path):
    from examples.common import EpochLog

    path = str(tmp_path / "epoch_logs.json")
    _atomic.write_bytes_atomic(path, json.dumps({"0": {"loss": 1.0}}))
    truncate(path)
    with pytest.raises(ValueError, match=re.escape(repr(path))):
        EpochLog(path).read()
