"""The CLI on a user's first tries: a bad path answers before TensorFlow loads; `verify` shows each check."""

import os

from keras_linattn import cli
from tests.export.test_cli import _run_console, encoder_file  # noqa: F401 - the fixture


def test_a_missing_model_file_is_named_before_tensorflow_loads(tmp_path):
    missing = str(tmp_path / "missing.keras")
    result = _run_console(["export", missing, "--out", str(tmp_path / "out")])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: MODEL must be an existing .keras file (no such file). Received: MODEL={missing!r}"
    ]
    assert result.stdout.strip().splitlines() == ["LOADED="]  # neither TensorFlow nor Keras nor the package
    assert not os.path.exists(tmp_path / "out")


def test_a_directory_without_manifest_is_named_before_tensorflow_loads(tmp_path):
    result = _run_console(["verify", str(tmp_path)])
    assert result.returncode == 2, result.stderr
    assert "no manifest.json" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stdout.strip().splitlines() == ["LOADED="]


def test_verify_prints_one_line_per_check_unless_quiet(tmp_path, encoder_file, capsys):  # noqa: F811
    _, path = encoder_file
    out = tmp_path / "exported"
    assert cli.main(["export", path, "--out", str(out), "--name", "enc", "--format", "onnx"]) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(out), "--shapes", "1x5,2x9"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("  check ")]
    assert lines[0].startswith("  check 1 done: ") and len(lines) >= 3, text  # weights + two shapes at least
    assert "(bound" not in "\n".join(lines)  # the results once: in the table
    assert cli.main(["verify", str(out), "--shapes", "1x5,2x9", "--quiet"]) == 0
    quiet = capsys.readouterr().out
    assert "  check " not in quiet and "checks passed" in quiet
