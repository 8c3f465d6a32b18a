"""`benchmarks.memory_1b` measures each step in its own process and writes one row a step."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("keras_hub")


@pytest.mark.slow
def test_memory_benchmark_rows_at_tiny_size(tmp_path):
    out = os.path.join(tmp_path, "memory.json")
    command = [sys.executable, "-m", "benchmarks.memory_1b", "--size", "tiny", "--steps", "linearize_save,load"]
    command += ["--workdir", str(tmp_path / "work"), "--out", out, "--label", "tiny", "--kill-gib", "3"]
    subprocess.run(command, check=True, timeout=600, capture_output=True)
    with open(out) as f:
        rows = json.load(f)["llama_tiny"]["tiny"]  # <family>_<size>, then the label
    assert [r["step"] for r in rows] == ["linearize_save", "load"]
    for row in rows:
        assert "failed" not in row and "killed" not in row, row
        phases = [p["peak_gib"] for p in row["phases"].values() if isinstance(p, dict) and "peak_gib" in p]
        assert phases and row["peak_gib"] >= max(phases) > 0  # the step's peak covers every phase's
    assert set(rows[0]["phases"]) >= {"teacher", "linearize", "del_teacher", "save"}
    assert os.path.isfile(tmp_path / "work" / "student.keras")
