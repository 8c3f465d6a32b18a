"""`save_to_preset` survives a kill: the previous preset stays whole until the new one replaces it in one step.

Issue 56: kill -9 during `save_to_preset` left h5py "bad object header" /
"truncated file", and an overwritten preset was lost (the old weight files
were removed first, the new ones written in place). Now the save writes a
staging copy beside the preset and exchanges the two directories in one
rename (`keras_linattn._atomic.replace_dir`); a preset left partial by an
older save, or by an interrupted copy, is refused as partial.

A kill is observed at each instrumented point by copying the preset there
(`keras_linattn._atomic.set_fault_hook`: a SIGKILL leaves exactly those
files); the slow test kills a real process at each point.
"""

import os
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest

from keras_linattn import _atomic
from keras_linattn.models import LinearCausalLM
from tests.models.test_presets import _ids, _lm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POINTS = ["preset:staged", "preset:manifest_written", "preset:published"]


@pytest.fixture(scope="module")
def two_lms():
    """(A, B, A's logits, B's logits): two LMs of one architecture with different weights."""
    a, b = _lm(seed=0), _lm(seed=1)
    logits_a, logits_b = np.asarray(a(_ids())), np.asarray(b(_ids()))
    assert not np.array_equal(logits_a, logits_b)
    return a, b, logits_a, logits_b


def _loaded_logits(preset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a preset without its manifest would warn
        return np.asarray(LinearCausalLM.from_preset(preset)(_ids()))


def _temporaries(directory):
    return [n for n in os.listdir(directory) if _atomic.is_temporary(n)]


def test_save_killed_at_every_point_leaves_a_whole_preset(two_lms, tmp_path):
    a, b, logits_a, logits_b = two_lms
    preset = str(tmp_path / "preset")
    a.save_to_preset(preset)
    snapshots = []

    def snapshot(point):
        dst = str(tmp_path / f"snap{len(snapshots)}")
        shutil.copytree(preset, dst)
        snapshots.append((point, dst))

    previous = _atomic.set_fault_hook(snapshot)
    try:
        b.save_to_preset(preset)
    finally:
        _atomic.set_fault_hook(previous)
    assert [p for p, _ in snapshots] == POINTS
    for point, snap in snapshots:
        want = logits_b if point == "preset:published" else logits_a
        np.testing.assert_array_equal(_loaded_logits(snap), want, err_msg=point)
    np.testing.assert_array_equal(_loaded_logits(preset), logits_b)
    assert not _temporaries(tmp_path)


def test_a_save_that_fails_midway_keeps_the_previous_preset(two_lms, tmp_path, monkeypatch):
    a, b, logits_a, _ = two_lms
    preset = str(tmp_path / "preset")
    a.save_to_preset(preset)

    def half_written(path, *args, **kwargs):
        with open(path, "wb") as f:  # what a process killed inside the HDF5 write leaves
            f.write(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
        raise OSError("injected: the disk filled up")

    monkeypatch.setattr(b.backbone, "save_weights", half_written)
    with pytest.raises(OSError, match="injected"):
        b.save_to_preset(preset)
    np.testing.assert_array_equal(_loaded_logits(preset), logits_a)
    assert not _temporaries(tmp_path)


@pytest.mark.parametrize("damage", ["weights truncated", "config missing"])
def test_a_partial_preset_is_named_as_partial(two_lms, tmp_path, damage):
    """A preset without its manifest and with a cut weights file (an older save killed midway, a cut copy)."""
    preset = str(tmp_path / "preset")
    two_lms[0].save_to_preset(preset)
    os.remove(os.path.join(preset, "linattn_manifest.json"))
    if damage == "config missing":
        os.remove(os.path.join(preset, "config.json"))
    else:
        path = os.path.join(preset, "model.weights.h5")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="is partial") as info:
        LinearCausalLM.from_preset(preset)
    message = str(info.value)
    assert repr(preset) in message and "Save the preset again" in message, message
    assert ("model.weights.h5 cannot be read" if damage == "weights truncated" else "config.json is missing") in message


_SAVE = """
import sys
from tests.models.test_presets import _lm
_lm(seed=1).save_to_preset(sys.argv[1])
"""


@pytest.mark.slow
def test_sigkill_at_every_point_of_a_save(two_lms, tmp_path):
    """A real process saving B over A, SIGKILLed at each point; then a clean save."""
    a, _, logits_a, logits_b = two_lms
    preset = str(tmp_path / "preset")
    a.save_to_preset(preset)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for point in POINTS:
        run = subprocess.run(
            [sys.executable, "-c", _SAVE, preset],
            env=dict(env, **{_atomic.KILL_ENV: point}),
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=600,
        )
        assert run.returncode == -signal.SIGKILL, (point, run.stderr[-2000:])
        want = logits_b if point == "preset:published" else logits_a
        np.testing.assert_array_equal(_loaded_logits(preset), want, err_msg=point)
        if point == "preset:published":
            a.save_to_preset(preset)  # back to A for the next point
    subprocess.run([sys.executable, "-c", _SAVE, preset], env=env, cwd=REPO_ROOT, check=True, timeout=600)
    np.testing.assert_array_equal(_loaded_logits(preset), logits_b)
    assert not _temporaries(tmp_path)
