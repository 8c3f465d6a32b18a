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
    assert not os.path.exists(tmp_path / "o" / "unbuilt")


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
