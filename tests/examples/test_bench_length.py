"""`benchmarks/bench_length.py`: its arguments, the length scoring and a smoke run at tiny sizes."""

import json
import math

import numpy as np
import pytest

from benchmarks import bench_length as B


class _Uniform:
    """Equal logits over V tokens: log2(V) bits per character at every position and length."""

    def __init__(self, vocabulary_size):
        self.vocabulary_size = vocabulary_size
        self.lengths = []

    def __call__(self, inputs, training=False):
        ids = np.asarray(inputs["token_ids"])
        self.lengths.append(ids.shape[1])
        return np.zeros(ids.shape + (self.vocabulary_size,), "float32")


def test_every_length_scores_windows_of_that_length_from_the_same_characters():
    model = _Uniform(16)
    ids = np.arange(1000) % 16
    bits = B.bits_at_lengths(model, ids, 10, [1, 4, 16], 700)
    assert bits == {1: 4.0, 4: 4.0, 16: 4.0}  # log2(16)
    # 700 characters: 63 windows of 10 (+1 target), 17 of 40, 4 of 160.
    assert model.lengths == [10] * 63 + [40] * 17 + [160] * 4


def test_rows_report_the_ratio_to_the_training_length():
    row = B._row("x", {1: 2.0, 4: 2.2, 16: 1.9})
    assert row["ratio_to_1x"] == {"1": 1.0, "4": 1.1, "16": 0.95}


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        B.parse_args(["--students", "lolcats,nope"])
    with pytest.raises(SystemExit):
        B.parse_args(["--scratch", "softmax"])
    with pytest.raises(SystemExit):
        B.parse_args(["--eval-chars", "1000"])  # 16 x 512 needs 8,193
    args = B.parse_args(["--quick"])
    assert (args.sequence_length, args.eval_chars) == (B.QUICK["sequence_length"], B.QUICK["eval_chars"])


# Slow: a teacher, three students and a scratch model, each trained and scored at two lengths; the
# scoring and the arguments are checked above without a run.
@pytest.mark.slow
def test_a_tiny_run_writes_every_row(tmp_path):
    path = tmp_path / "length.json"
    argv = ["--quick", "--students", "window,unrotated_mean,cache_unrotated_mean", "--scratch", "delta_conv"]
    argv += ["--factors", "1,4"]
    B.main(argv + ["--out", str(path)])
    result = json.loads(path.read_text())
    rows = {row["row"]: row for row in result["rows"]}
    assert set(rows) == {"teacher", "window", "unrotated_mean", "cache_unrotated_mean", "scratch_delta_conv"}
    assert rows["unrotated_mean"]["options"] == {"linear_rope": False, "linear_mean": True, "linear_weight": 8.0}
    assert rows["cache_unrotated_mean"]["options"] == {
        "cache_size": B.QUICK["cache_size"],
        "linear_rope": False,
        "linear_mean": True,
        "linear_weight": 8.0,
    }
    assert rows["scratch_delta_conv"]["trained_at"] == B.QUICK["scratch_length"]
    for row in rows.values():
        assert set(row["bits_per_char"]) == {"1", "4"}
        assert all(math.isfinite(b) and 0 < b < 8 for b in row["bits_per_char"].values())
