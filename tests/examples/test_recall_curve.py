"""`benchmarks/recall_curve.py`: the curve's arguments, its dense rows, and a tiny run through bench_recall."""

import json

import numpy as np
import pytest

from benchmarks import bench_recall as R
from benchmarks import recall_curve as C


def test_the_curve_needs_both_lists_and_known_students():
    with pytest.raises(SystemExit):
        R.parse_args(["--cache-sizes", "16,32"])
    with pytest.raises(SystemExit):
        R.parse_args(["--cache-sizes", "16,x", "--pair-counts", "8"])
    with pytest.raises(SystemExit):
        R.parse_args(["--cache-sizes", "0", "--pair-counts", "8"])
    with pytest.raises(SystemExit):
        R.parse_args(["--cache-sizes", "16", "--pair-counts", "8", "--curve-students", "teacher"])
    args = R.parse_args(["--cache-sizes", "16,256", "--pair-counts", "8,48"])
    assert (args.cache_sizes, args.pair_counts, args.curve_students) == ([16, 256], [8, 48], list(C.CURVE_STUDENTS))
    assert args.out == C.RESULTS_PATH
    assert R.parse_args([]).out == R.RESULTS_PATH


def _full_cfg(num_eval=40):
    args = R.parse_args(["--num-eval", str(num_eval)])
    return R.config_from_args(args)


@pytest.mark.parametrize("pairs", [8, 40, 48])
def test_dense_rows_put_the_last_key_in_the_far_bucket_among_all_the_pairs(pairs):
    cfg = _full_cfg()
    t, w = cfg["sequence_length"], cfg["window_size"]
    _, keys, values = R.vocabulary_layout(cfg["vocabulary_size"])
    tokens, targets, distances = C.curve_rows(cfg, pairs)
    assert tokens.shape == (cfg["num_eval"], t)
    assert ((distances >= 4 * w) & (distances < min(32 * w, t - 1))).all()  # the 4-32x bucket only
    for row, target, d in zip(tokens, targets, distances, strict=True):
        key = row[-1]
        earlier = np.flatnonzero(row[:-1] == key)
        assert earlier.tolist() == [t - 1 - d]  # the queried key once before, at its distance
        assert row[t - d] == target  # its value right after it
        is_key = (row[:-1] >= keys[0]) & (row[:-1] < keys[1])
        assert len(set(row[:-1][is_key].tolist())) == pairs  # every pair's key (the queried ones twice)
        is_value = (row[:-1] >= values[0]) & (row[:-1] < values[1])
        assert is_value.sum() == 2 * pairs - 1  # each pair's value and each earlier query's answer


def test_rows_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        C.curve_rows(_full_cfg(), 49)  # 2 x 49 pairs + 2 x 49 queries > 3/4 of T = 256


def test_a_tiny_curve_scores_each_cache_size_and_pair_count_beside_the_teacher(tmp_path, monkeypatch):
    # An untrained teacher: the curve's bookkeeping, not the task, is under test.
    monkeypatch.setattr(R, "get_teacher", lambda cfg, log: (R.build_teacher(cfg), {"untrained": True}))
    out = tmp_path / "curve.json"
    argv = ["--quick", "--num-eval", "4", "--cache-sizes", "4,60", "--pair-counts", "2,6"]
    assert R.main([*argv, "--curve-students", "sparse_cache_clamped", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "memory" not in result and result["teacher_training"] == {"untrained": True}
    assert result["curve"]["bucket"] == ["4-32x window", 16, 63]  # T = 64, W = 4
    keys = [(p["student"], p["cache_size"], p["pairs"]) for p in result["points"]]
    assert keys == [
        ("teacher", None, 2),
        ("teacher", None, 6),
        ("sparse_cache_clamped", 4, 2),
        ("sparse_cache_clamped", 4, 6),
        ("sparse_cache_clamped", 60, 2),
        ("sparse_cache_clamped", 60, 6),
    ]
    for p in result["points"]:
        assert p["count"] == 4 and p["queries"] == p["pairs"] and p["value_positions"] == 2 * p["pairs"] - 1
        assert p["cache_over_kv"] == (1.0 if p["cache_size"] is None else p["cache_size"] / 64)
        assert 0.0 <= p["accuracy"] <= 1.0
    assert "| sparse_cache_clamped | 60 |" in C.render_curve_table(result["points"])
