"""`benchmarks/bench_precision_quality.py`: each precision holds the student's weights, GPT-2's learned positions
bound its lengths, and a smoke run at tiny sizes writes every row with its command."""

import json
import math

import keras
import numpy as np
import pytest

import keras_linattn
from benchmarks import bench_precision_quality as B
from examples.linearize import pipeline as P
from keras_linattn.layers._attention_base import _ProjectionDense

VOCAB, T = 20, 32


def _student(family):
    teacher = P.build_teacher(family, VOCAB, hidden_dim=16, num_layers=2, num_heads=2, sequence_length=T)
    return keras_linattn.linearize(teacher, window_size=8)


def test_each_precision_holds_the_students_weights():
    student = _student("llama")
    ids = P.as_inputs(np.arange(2 * T).reshape(2, T) % VOCAB)
    assert B.precision_model(student, "float32") is student
    bf16 = B.precision_model(student, "bfloat16")
    assert {str(p.kernel.dtype) for p in bf16._flatten_layers() if isinstance(p, _ProjectionDense)} == {"bfloat16"}
    for ours, theirs in zip(bf16.weights, student.weights, strict=True):  # rounded, or kept float32 (feature maps)
        want = keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(theirs, ours.dtype), "float32"))
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.ops.cast(ours, "float32")), want)
    int8 = B.precision_model(student, "int8")
    assert {p.quantization_mode for p in int8._flatten_layers() if isinstance(p, _ProjectionDense)} == {"int8"}
    assert not [w for w in student.weights if str(w.dtype) == "int8"]  # the float32 student is left as it was
    for model in (bf16, int8):
        logits = np.asarray(keras.ops.cast(model(ids), "float32"))
        assert np.isfinite(logits).all() and logits.shape == (2, T, VOCAB)
    with pytest.raises(ValueError, match="Received: precision='int4'"):
        B.precision_model(student, "int4")


def test_gpt2s_learned_positions_bound_its_lengths_and_llamas_do_not():
    assert B._max_length(_student("gpt2")) == T
    assert B._max_length(_student("llama")) is None


@pytest.mark.slow
def test_quick_run_writes_every_row_with_its_command(tmp_path):
    out = str(tmp_path / "precision_quality.json")
    B.main(["--family", "llama", "--quick", "--work-dir", str(tmp_path), "--out", out])
    with open(out) as f:
        res = json.load(f)
    rows = res["rows"]
    assert [(r["precision"], r["factor"]) for r in rows] == [(p, f) for p in B.PRECISIONS for f in (1, 16)]
    assert all(r["command"].startswith("python -m benchmarks.bench_precision_quality ") for r in rows)
    assert all(math.isfinite(r["bits_per_char"]) for r in rows)
    assert all("delta_vs_float32" in r for r in rows if r["precision"] != "float32")
    assert res["peak_rss_bytes"] > 0
