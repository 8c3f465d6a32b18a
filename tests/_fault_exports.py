"""One `keras-linattn export` directory of a tiny causal LM, shared by the fault tests of a pytest run.

Exporting an LM (SavedModel with its step/generate signatures, ONNX model and
step graph) takes tens of seconds on a loaded CPU; tests/test_atomic_export.py,
tests/test_corrupt_files.py and tests/test_concurrency.py all start from the
same one. Copy it (`copy_export`) before changing anything in it.
"""

import atexit
import functools
import os
import shutil
import tempfile

import keras
import numpy as np

NAME = "lm"


def built_lm(seed=0):
    from tests.test_export import tiny_lm

    model = tiny_lm(seed=seed)
    model(np.zeros((1, 4), "int32"))
    return model


@functools.lru_cache(maxsize=None)
def _root():
    from keras_linattn import cli

    root = tempfile.mkdtemp(prefix="kla-fault-tests-")
    atexit.register(shutil.rmtree, root, True)
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        for seed in (0, 1):
            built_lm(seed).save(os.path.join(root, f"lm{seed}.keras"))
        code = cli.main(
            ["export", os.path.join(root, "lm0.keras"), "--out", os.path.join(root, "exported"), "--name", NAME]
        )
    finally:
        keras.config.set_dtype_policy(policy)
    assert code == 0
    return root


def keras_file(seed):
    """A .keras file of the tiny LM built with `seed` (0 is the exported one)."""
    return os.path.join(_root(), f"lm{seed}.keras")


def export_dir():
    """The shared export directory (read only: copy it with `copy_export` to change it)."""
    return os.path.join(_root(), "exported")


def copy_export(dst):
    shutil.copytree(export_dir(), dst)
    return str(dst)
