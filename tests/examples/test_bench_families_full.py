"""`benchmarks/bench_families_full.py` at tiny shapes: its rows, its decode timing, its /usr/bin/time reading."""

import json

import pytest

from benchmarks import bench_families_full as B


def test_time_v_report_is_read_for_wall_time_and_peak_rss():
    stderr = (
        "\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03.50\n\tMaximum resident set size (kbytes): 2097152\n"
    )
    assert B._time_v(stderr) == (3723.5, 2.0)
    assert B._time_v("killed") == (None, None)


def test_a_tiny_gemma_3_run_linearizes_and_times_the_student_beside_keras_hub(tmp_path):
    out = tmp_path / "families.json"
    argv = ["--shape", "gemma-3-1b", "--size", "tiny", "--stages", "linearize,decode", "--in-process"]
    argv += ["--contexts", "16,32", "--teacher-contexts", "16", "--teacher-prefill-only", "32"]
    argv += ["--prefill-piece", "16", "--decode-tokens", "3", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    B.main(argv)
    rows = {row["stage"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"linearize", "decode"}
    assert all(row["run"].endswith(" ".join(argv)) for row in rows.values())  # each row names its command
    assert rows["linearize"]["parameters"] > 0 and rows["linearize"]["linearize_s"] > 0
    decode = rows["decode"]
    assert [r["context"] for r in decode["student"]] == [16, 32]
    assert all(r["ms_per_token"] > 0 and r["prefill_s"] > 0 and r["tokens"] == 3 for r in decode["student"])
    teacher = {r["context"]: r for r in decode["teacher"]}
    assert teacher[16]["ms_per_token"] > 0
    assert "ms_per_token" not in teacher[32] and teacher[32]["prefill_s"] > 0  # prefill alone, as asked


@pytest.mark.slow
def test_a_tiny_onnx_decode_row_times_single_steps(tmp_path):
    out = tmp_path / "families.json"
    argv = ["--shape", "qwen2.5-0.5b", "--size", "tiny", "--stages", "linearize,export_onnx,decode_onnx"]
    argv += ["--in-process", "--onnx-contexts", "16", "--decode-tokens", "3"]
    argv += ["--workdir", str(tmp_path / "w"), "--out", str(out)]
    B.main(argv)
    rows = {row["stage"]: row for row in json.loads(out.read_text())["rows"]}
    (onnx,) = rows["decode_onnx"]["student_onnx"]
    assert onnx["context"] == 16 and onnx["tokens"] == 3 and onnx["prefill_s"] > 0
    low, high = onnx["ms_range"]
    assert 0 < low <= onnx["ms_per_token"] <= high  # a median of single steps, not a difference of two runs
    assert onnx["steps_before_timing"] > 64  # past the student's window: the state's steady shape
