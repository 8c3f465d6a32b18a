"""One `keras-linattn export` directory of a tiny causal LM, shared by the fault tests of a pytest run.

Built once per run, across pytest-xdist workers (tests/_shared_exports.py).

Exporting an LM (SavedModel with its step/generate signatures, ONNX model and
step graph) takes tens of seconds on a loaded CPU; tests/test_atomic_export.py,
tests/test_corrupt_files.py and tests/test_concurrency.py all start from the
same one. Copy it (`copy_export`) before changing anything in it.
"""

import os
import shutil

from tests._shared_exports import built_lm, shared_dir

NAME = "lm"

__all__ = ["NAME", "built_lm", "copy_export", "export_dir", "keras_file"]


def _build(root):
    from keras_linattn import cli

    for seed in (0, 1):
        built_lm(seed).save(os.path.join(root, f"lm{seed}.keras"))
    code = cli.main(
        ["export", os.path.join(root, "lm0.keras"), "--out", os.path.join(root, "exported"), "--name", NAME]
    )
    assert code == 0


def _root():
    return shared_dir("fault_tests_export", _build)


def keras_file(seed):
    """A .keras file of the tiny LM built with `seed` (0 is the exported one)."""
    return os.path.join(_root(), f"lm{seed}.keras")


def export_dir():
    """The shared export directory (read only: copy it with `copy_export` to change it)."""
    return os.path.join(_root(), "exported")


def copy_export(dst):
    shutil.copytree(export_dir(), dst)
    return str(dst)
