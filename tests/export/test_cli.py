"""`keras-linattn export` / `keras-linattn verify` (in-process through `main`)."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_linattn import cli, export
from tests import _shared_exports
from tests.export.test_export import DIM, encoder, encoder_tolerance
from tests.tolerance import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def encoder_file(tmp_path):
    model = encoder("elu", causal=True)
    path = tmp_path / "my encoder.keras"
    model.save(path)
    return model, str(path)


def test_export_then_verify_encoder(tmp_path, encoder_file, capsys, rng):
    model, path = encoder_file
    out = tmp_path / "exported"
    assert cli.main(["export", path, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "[1/3] loading" in text and "[2/3] SavedModel" in text and "[3/3] ONNX (opset 17)" in text
    # a line before each long step
    assert "tracing and writing the signatures (serving_default)" in text
    assert "writing TF Serving warmup requests" in text and "converting the model graph to ONNX" in text
    assert "format" in text and "saved_model" in text and "onnx:model" in text
    name = "my_encoder"  # from the file name
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["models"][name]
    assert entry["saved_model"] == os.path.join(name, "1")
    assert entry["onnx"] == {"model": os.path.join("onnx", f"{name}.onnx")}
    assert entry["signatures"] == ["serving_default"]
    assert sorted(os.listdir(out)) == ["keras", "manifest.json", name, "onnx"]

    # the artifacts compute the model (checked here, not only by `verify`)
    x = rng.standard_normal((2, 11, DIM)).astype("float32")
    expected = model(x).numpy()
    tolerance = encoder_tolerance(model, x, causal=True)  # export vs Keras: paths=2
    with export.SavedModelRunner(str(out / name / "1")) as runner:
        got = runner.run("serving_default", {"features": x})["head"]
    assert_close(got, expected, paths=2, what="SavedModel", **tolerance)
    predictor = export.OnnxPredictor(str(out / "onnx" / f"{name}.onnx"), device="cpu")
    assert_close(predictor(x)["head"], expected, paths=2, what="ONNX", **tolerance)

    assert cli.main(["verify", str(out), "--shapes", "1x5,2x9"]) == 0
    text = capsys.readouterr().out
    assert "6/6 checks passed" in text  # stored weights (SavedModel, ONNX), then 2 shapes x 2 backends
    assert "stored exactly" not in text and "(bound" not in text  # the results once: in the table
    print(text)
    assert re.search(r"saved_model +serving_default:head +2x9 ", text)
    assert re.search(r"saved_model +variables:weights ", text)

    # a second export of the same name adds version 2
    assert cli.main(["export", path, "--out", str(out), "--format", "saved_model"]) == 0
    assert sorted(os.listdir(out / name)) == ["1", "2"]


def test_export_lm_saved_model_and_verify(capsys):
    # `keras-linattn export <LM>.keras --format saved_model`, run once per pytest run and shared with
    # tests/export/test_verify.py (tests/_shared_exports.py): the limited LM, one block, elu.
    out, printed = _shared_exports.limited_cli_export()
    assert "serving_default,step,generate,generate_sampled" in printed, printed
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--name", "lm", "--shapes", "2x6"]) == 0
    text = capsys.readouterr().out
    assert "step:logits" in text and "generate:output_ids" in text and "checks passed" in text
    assert "generate_sampled:output_ids" in text


def test_verify_fails_on_a_mismatch(tmp_path, encoder_file, capsys):
    _, path = encoder_file
    out = tmp_path / "exported"
    assert cli.main(["export", path, "--out", str(out), "--name", "enc", "--format", "saved_model"]) == 0
    # replace the reference model with other weights: verification must fail
    encoder("elu", causal=True, seed=5).save(out / "keras" / "enc.keras")
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--shapes", "2x9"]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "0/2 checks passed" in text  # its weights, and its outputs


def test_cli_errors(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "missing.keras"), "--out", str(tmp_path / "o")]) == 2
    assert "MODEL must be an existing .keras file" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli.main(["export", str(tmp_path / "missing.keras"), "--out", str(tmp_path / "file")]) == 2
    assert "--out must be a directory" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["export", "m.keras", "--out", "o", "--format", "tflite"])
    assert "--format must be a comma-separated subset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["verify", "d", "--shapes", "3by4"])


def test_unbuilt_model_error_through_cli(tmp_path, capsys):
    model = keras.Sequential([keras.layers.Dense(2)])
    path = tmp_path / "unbuilt.keras"
    model.save(path)
    assert cli.main(["export", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "not built" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")  # nor the output folder it had created


def test_console_script_entry_point():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from keras_linattn.cli import main; sys.exit(main(['--help']))"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0
    assert "{export,verify}" in result.stdout
    np.testing.assert_equal(
        cli.build_parser().parse_args(["verify", "d", "--shapes", "1x2,3x4"]).shapes, [(1, 2), (3, 4)]
    )


# ---------------------------------------------------------------- the default install, errors, output


def _console_script():
    """(module, function) of the `keras-linattn` console script, as pyproject.toml declares it."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        target = re.search(r'^keras-linattn = "([\w.]+):(\w+)"', f.read(), flags=re.M)
    return target.group(1), target.group(2)


def _run_console(args, **env):
    """The console script's entry point in a fresh interpreter (the way pip's wrapper calls it)."""
    module, function = _console_script()
    code = (
        "import sys\n"
        f"sys.argv = ['keras-linattn', *{list(args)!r}]\n"
        f"from {module} import {function} as main\n"
        "try:\n"
        "    status = main()\n"
        "except SystemExit as e:\n"
        "    status = e.code\n"
        "loaded = sorted(m for m in ('tensorflow', 'keras', 'keras_linattn') if m in sys.modules)\n"
        "print('LOADED=' + ','.join(loaded))\n"
        "sys.exit(status)\n"
    )
    env = {k: v for k, v in dict(os.environ, **env).items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_help_and_bad_arguments_answer_without_importing_tensorflow():
    # Asserted on the imports, not on a time: `--help` used to load TensorFlow first (seconds, for a usage line).
    for args, status in ((["--help"], 0), (["export", "--help"], 0), (["verify", "d", "--shapes", "3by4"], 2)):
        result = _run_console(args)
        assert result.returncode == status, result.stderr
        assert result.stdout.strip().splitlines()[-1] == "LOADED=", (args, result.stdout[-500:])
    assert "--no-warmup" in _run_console(["export", "--help"]).stdout


def test_a_command_prints_no_tensorflow_log_lines():
    # TensorFlow 2.21 prints oneDNN / CUDA notices (and `failed call to cuInit` without a GPU) while it
    # loads, whatever TF_CPP_MIN_LOG_LEVEL says: a failing command prints its one `error:` line and nothing else.
    # A file that exists but is no .keras archive: the error comes once TensorFlow has loaded.
    junk = os.path.join(ROOT, "README.md")
    result = _run_console(["export", junk, "--out", os.path.join(ROOT, "no such dir")])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: MODEL is not a readable .keras file (not a complete zip archive: truncated or corrupted). "
        f"Received: MODEL={junk!r}"
    ]
    assert result.stdout.strip().splitlines()[-1] == "LOADED=keras,keras_linattn,tensorflow"


def _block_serving_api(monkeypatch):
    """As if tensorflow-serving-api were not installed."""
    for module in ("tensorflow_serving", "tensorflow_serving.apis"):
        monkeypatch.setitem(sys.modules, module, None)
    for module in ("predict_pb2", "prediction_log_pb2"):
        monkeypatch.setitem(sys.modules, f"tensorflow_serving.apis.{module}", None)


def test_tensorflow_serving_api_is_a_base_dependency():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    assert re.search(r'^\s*"tensorflow-serving-api[>=<,.\d]*",', dependencies, flags=re.M), dependencies


def test_missing_serving_api_is_one_line_naming_no_warmup(tmp_path, encoder_file, capsys, monkeypatch):
    _, path = encoder_file
    _block_serving_api(monkeypatch)
    out = tmp_path / "exported"
    assert cli.main(["export", path, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("error: writing TF Serving warmup requests needs the tensorflow-serving-api")
    assert "--no-warmup" in captured.err and "warmup=False" not in captured.err
    assert not out.exists()  # stopped before anything was written
    # without warmup records the same install exports
    assert cli.main(["export", path, "--out", str(out), "--format", "saved_model", "--no-warmup"]) == 0
    assert not (out / "my_encoder" / "1" / "assets.extra" / "tf_serving_warmup_requests").exists()


def test_a_failed_export_leaves_no_folder_behind(tmp_path, encoder_file, capsys, monkeypatch):
    _, path = encoder_file
    out = tmp_path / "new" / "exported"

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(export, "export_onnx", fail)
    assert cli.main(["export", path, "--out", str(out), "--no-warmup"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "error: RuntimeError: boom (an unexpected error; --verbose shows the traceback)"
    ]
    assert not out.exists()  # the SavedModel version went too: nothing was published
    assert (tmp_path / "new").is_dir()  # the folder above was not the export's
    assert cli.main(["export", path, "--out", str(out), "--no-warmup", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: RuntimeError: boom")


def test_export_model_sh_finds_the_checkouts_venv(tmp_path):
    # After `make demo` the console script is in .venv/bin, which is not on PATH until activated.
    kit = tmp_path / "export"
    kit.mkdir()
    script = kit / "export_model.sh"
    script.write_text(open(os.path.join(ROOT, "export", "export_model.sh"), encoding="utf-8").read())
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(script), "m.keras", "enc"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "error: keras-linattn is not on PATH" in result.stderr, result.stderr
    assert "pip install -e ." in result.stderr and ".venv/bin/activate" in result.stderr
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "keras-linattn").write_text('#!/bin/sh\necho "called: $*"\n')
    (venv_bin / "keras-linattn").chmod(0o755)
    result = subprocess.run(["bash", str(script), "m.keras", "enc"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"called: export m.keras --out {kit}/exported --name enc",
        f"called: verify {kit}/exported --name enc",
    ]
