"""`benchmarks.bench_precision`: one process a precision, the float32 tokens of an earlier run as the reference."""

import json

import pytest

from benchmarks import bench_precision

pytestmark = pytest.mark.tf_only("exports ONNX")

_TINY = ["--layers", "1", "--width", "64", "--vocabulary", "64", "--rounds", "1"]


def test_a_reference_of_another_shape_is_refused_before_any_work(tmp_path):
    reference = tmp_path / "f.json"
    reference.write_text(json.dumps({"shape": {"width": 64, "layers": 2, "vocabulary": 64}, "rows": []}))
    with pytest.raises(ValueError, match="another shape"):
        bench_precision.main([*_TINY, "--precisions", "int8", "--reference", str(reference)])
    reference.write_text(json.dumps({"shape": {"width": 64, "layers": 1, "vocabulary": 64}, "rows": []}))
    with pytest.raises(ValueError, match="no float32 row"):
        bench_precision.main([*_TINY, "--precisions", "int8", "--reference", str(reference)])


@pytest.mark.slow
def test_int8_in_its_own_process_is_compared_with_the_float32_runs_tokens(tmp_path):
    f32, int8 = tmp_path / "f.json", tmp_path / "i.json"
    assert bench_precision.main([*_TINY, "--precisions", "float32", "--out", str(f32)]) == 0
    assert bench_precision.main([*_TINY, "--precisions", "int8", "--reference", str(f32), "--out", str(int8)]) == 0
    (f32_row,) = json.loads(f32.read_text())["rows"]
    (int8_row,) = json.loads(int8.read_text())["rows"]
    assert f32_row["keras_agreement_with_float32"] == 1.0  # its own tokens
    assert int8_row["precision"] == "int8" and int8_row["weight_bytes"] < f32_row["weight_bytes"] / 2
    # Against the float32 run's tokens (not its own): the fraction of equal tokens, position by position.
    expected = sum(a == b for a, b in zip(int8_row["keras_tokens"], f32_row["keras_tokens"], strict=True)) / len(
        f32_row["keras_tokens"]
    )
    assert int8_row["keras_agreement_with_float32"] == expected
    assert int8_row["onnx_data_bytes"] == 0  # a small model keeps its weights inside each graph
    assert int8_row["peak_rss_bytes"] >= int8_row["rss_after_setup_bytes"] > 0


def test_runtimes_are_checked_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="comma list of"):
        bench_precision.main([*_TINY, "--runtimes", "keras,tflite"])
    with pytest.raises(ValueError, match="needs `--reference`"):
        bench_precision.main([*_TINY, "--runtimes", "onnx"])


@pytest.mark.slow
def test_one_runtime_a_process_times_that_runtime_only(tmp_path):
    f32, keras_only, onnx_only = tmp_path / "f.json", tmp_path / "k.json", tmp_path / "o.json"
    base = [*_TINY, "--precisions", "bfloat16", "--reference", str(f32)]
    assert bench_precision.main([*_TINY, "--precisions", "float32", "--runtimes", "keras", "--out", str(f32)]) == 0
    (f32_row,) = json.loads(f32.read_text())["rows"]
    assert "onnx_ms_per_token" not in f32_row and "onnx_bytes" not in f32_row  # nothing exported
    assert bench_precision.main([*base, "--runtimes", "onnx", "--out", str(onnx_only)]) == 0
    assert bench_precision.main([*base, "--runtimes", "keras", "--out", str(keras_only)]) == 0
    (onnx_row,) = json.loads(onnx_only.read_text())["rows"]
    (keras_row,) = json.loads(keras_only.read_text())["rows"]
    # ms/token is a difference of two lengths' times: at this size noise can put it below 0; present is the check.
    assert len(onnx_row["onnx_ms_per_token_all"]) == 1 and "keras_ms_per_token" not in onnx_row
    assert len(keras_row["keras_ms_per_token_all"]) == 1 and "onnx_ms_per_token" not in keras_row
    for row in (onnx_row, keras_row):
        kind = "onnx" if row is onnx_row else "keras"
        equal = [a == b for a, b in zip(row[f"{kind}_tokens"], f32_row["keras_tokens"], strict=True)]
        assert row[f"{kind}_agreement_with_float32"] == sum(equal) / len(equal)
