"""Export from a JAX session: the CLI runs on TensorFlow by itself; the Python API says so in one line."""

import os
import subprocess
import sys
import textwrap

import keras
import pytest

from tests.export.test_cli import ROOT, _run_console

pytest.importorskip("jax", reason="the `jax` extra (make test installs it)")


@pytest.fixture(scope="module")
def dense_file(tmp_path_factory):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 4), name="features")
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(inputs))
    path = tmp_path_factory.mktemp("jax_export") / "dense.keras"
    model.save(path)
    return str(path)


def test_cli_export_under_jax_runs_on_tensorflow(tmp_path, dense_file):
    out = tmp_path / "out"
    result = _run_console(
        ["export", dense_file, "--out", str(out), "--format", "onnx"], KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.isfile(out / "onnx" / "dense.onnx") and os.path.isfile(out / "manifest.json")


SCRIPT = textwrap.dedent(
    """
    import sys
    import keras
    assert keras.backend.backend() == "jax", keras.backend.backend()
    from keras_linattn import export
    from keras_linattn_cli import main

    model = keras.saving.load_model(sys.argv[1])
    for fn, target in ((export.export_onnx, sys.argv[2] + "/m.onnx"), (export.export_saved_model, sys.argv[2])):
        try:
            fn(model, target)
        except ValueError as e:
            print("ERROR", str(e))
    # `main` called from this JAX session: the command runs again on TensorFlow.
    sys.exit(main(["export", sys.argv[1], "--out", sys.argv[2] + "/cli", "--format", "onnx"]))
    """
)


def test_python_api_under_jax_says_one_line_and_main_reruns_on_tensorflow(tmp_path, dense_file):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, dense_file, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 2, result.stdout
    for line in errors:
        assert line.startswith("ERROR export needs the TensorFlow backend: run without KERAS_BACKEND=jax"), line
    assert os.path.isfile(tmp_path / "cli" / "onnx" / "dense.onnx")
