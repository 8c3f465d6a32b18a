"""`benchmarks/device_check.py --dry-run`: every stage runs at tiny shapes on CPU and the JSON names the device."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_dry_run_runs_every_stage(tmp_path):
    out = tmp_path / "device_check.json"
    argv = [sys.executable, "-m", "benchmarks.device_check", "--dry-run", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True
    assert results["device"]["kind"] in ("CPU", "GPU") and results["device"]["name"]
    stages = results["stages"]
    assert set(stages) == {"fit", "attention", "onnx", "jax"}
    assert all(stage["ok"] for stage in stages.values()), {k: v.get("error") for k, v in stages.items()}
    assert stages["fit"]["tokens_per_s"] > 0 and stages["jax"]["backend"] == "jax"
    for precision in ("float16", "int8"):
        onnx = stages["onnx"][precision]
        assert onnx["parity"]["ok"] is True and onnx["tokens_agree"] == 1.0
        assert onnx["file_bytes"] > 0
    # int8's files are smaller than float16's: the int8 weights travelled.
    assert stages["onnx"]["int8"]["file_bytes"] < stages["onnx"]["float16"]["file_bytes"]
