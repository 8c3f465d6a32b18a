"""One `keras-linattn export` directory of a tiny causal LM, shared by the fault tests of a pytest run.

Built once per run, across pytest-xdist workers, and read by the export tests
too (tests/_shared_exports.py).

Exporting an LM (SavedModel with its step/generate signatures, ONNX model and
step graph) takes tens of seconds on a loaded CPU; tests/export/test_atomic_export.py,
tests/export/test_corrupt_files.py and tests/export/test_concurrency.py all start from the
same one. Copy it (`copy_export`) before changing anything in it.
"""

import os
import shutil

from tests._shared_exports import NAME, built_lm, lm_export_root

__all__ = ["NAME", "built_lm", "copy_export", "export_dir", "keras_file"]


def _root():
    return lm_export_root()


def keras_file(seed):
    """A .keras file of the tiny LM built with `seed` (0 is the exported one)."""
    return os.path.join(_root(), f"lm{seed}.keras")


def export_dir():
    """The shared export directory (read only: copy it with `copy_export` to change it)."""
    return os.path.join(_root(), "exported")


def copy_export(dst):
    shutil.copytree(export_dir(), dst)
    return str(dst)
