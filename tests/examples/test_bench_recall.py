"""The recall-by-distance task generator, and a smoke run of `python -m benchmarks.bench_recall --quick`."""

import json

import numpy as np
import pytest

from benchmarks import bench_recall as bench


def _first_occurrence_before(row, token, position):
    earlier = np.flatnonzero(row[:position] == token)
    assert len(earlier) == 1, (token, earlier)  # a queried key appears once before its query
    return int(earlier[0])


@pytest.mark.parametrize("t,w,pairs,queries,vocab", [(64, 4, 4, 2, 64), (256, 8, 12, 8, 128), (96, 6, 5, 1, 40)])
def test_keys_sit_at_the_requested_distances(t, w, pairs, queries, vocab):
    bucket_list = bench.buckets(w, t)
    final = bench.stratified_distances(30, bucket_list, seed=5)
    tokens, targets, distances = bench.generate(
        len(final),
        t,
        num_pairs=pairs,
        num_queries=queries,
        final_distances=final,
        other_buckets=[(lo, hi) for _, lo, hi in bucket_list],
        vocabulary_size=vocab,
        seed=9,
    )
    filler, keys, values = bench.vocabulary_layout(vocab)
    assert tokens.shape == targets.shape == distances.shape == (len(final), t)
    np.testing.assert_array_equal(distances[:, -1], final)  # the last query, at the requested distance
    for row in range(len(final)):
        seq = tokens[row]
        is_key = (seq >= keys[0]) & (seq < keys[1])
        # Each pair: a key followed by a value; `pairs` distinct keys, each seen once more per query.
        key_tokens, counts = np.unique(seq[is_key], return_counts=True)
        assert len(key_tokens) == pairs and counts.sum() == pairs + queries
        assert np.all((seq >= 1) & (seq < vocab))
        scored = np.flatnonzero(targets[row] != bench.IGNORE)
        assert len(scored) == queries and scored[-1] == t - 1
        for q in scored:
            key = seq[q]
            assert keys[0] <= key < keys[1]
            p = _first_occurrence_before(seq, key, q)
            assert q - p == distances[row, q]  # measured here from the tokens, not from the generator
            assert seq[p + 1] == targets[row, q] and values[0] <= targets[row, q] < values[1]
            if q + 1 < t:
                assert seq[q + 1] == targets[row, q]  # an earlier query is followed by its answer
        assert np.all(distances[row][scored] >= 2) and np.all(distances[row][scored] < t)
        others = np.ones(t, bool)
        for q in scored:
            p = q - distances[row, q]
            others[[p, p + 1, q]] = False
            if q + 1 < t:
                others[q + 1] = False
        rest = seq[others]
        n_filler = np.sum((rest >= filler[0]) & (rest < filler[1]))
        assert n_filler == len(rest) - 2 * (pairs - queries)  # the rest: filler and the distractor pairs


def test_last_query_distance_lands_in_its_bucket():
    bucket_list = bench.buckets(8, 256)
    assert [(lo, hi) for _, lo, hi in bucket_list] == [(2, 8), (8, 32), (32, 255)]
    long = bench.buckets(8, 1024)
    assert long[:2] == bucket_list[:2] and long[2:] == [("4-32x window", 32, 256), (bench.LONG_BUCKET, 256, 1023)]
    assert len(bench.buckets(8, 257)) == 3 and len(bench.buckets(8, 258)) == 4
    cfg = bench.config_from_args(bench.parse_args(["--quick", "--eval-length", "160", "--num-eval", "3"]))
    tokens, _, distances = bench.evaluation_rows(cfg)
    assert tokens.shape == (12, 160) and distances[-3:].min() >= 128  # 4 buckets of 3 rows; the last 32-128x
    d = bench.stratified_distances(50, bucket_list, seed=0)
    for i, (_, lo, hi) in enumerate(bucket_list):
        assert np.all((d[50 * i : 50 * (i + 1)] >= lo) & (d[50 * i : 50 * (i + 1)] < hi))


def test_generator_is_deterministic_and_rejects_bad_configs():
    kwargs = dict(num_pairs=4, num_queries=2, other_buckets=[(2, 8)], vocabulary_size=64)
    a = bench.generate(5, 64, final_distances=[3] * 5, seed=1, **kwargs)
    b = bench.generate(5, 64, final_distances=[3] * 5, seed=1, **kwargs)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="final_distances"):
        bench.generate(5, 64, final_distances=[1] * 5, seed=1, **kwargs)
    with pytest.raises(ValueError, match="num_queries"):
        bench.generate(5, 64, final_distances=[3] * 5, seed=1, **{**kwargs, "num_queries": 5})
    with pytest.raises(ValueError, match="empty"):
        bench.buckets(8, 30)


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "recall.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["name"] for r in results["rows"]] == list(bench.ROWS)
    names = [n for n, _, _ in results["buckets"]]
    assert names == list(bench.BUCKET_NAMES)
    for r in results["rows"]:
        assert set(r["accuracy"]) == {*names, "all"}
        assert all(0.0 <= a <= 1.0 for a in r["accuracy"].values()), r
        assert sum(r["count"][n] for n in names) == r["count"]["all"] == 3 * bench.QUICK["num_eval"]
        if r["name"] in bench._CLAMPED_OBJECTIVE:  # transferred with its objective, gamma and weight frozen
            assert r["transfer"]["objective"] == bench._CLAMPED_OBJECTIVE[r["name"]]
            assert r["transfer"]["freeze"] == ["gamma", "linear_weight"]
    memory = results["memory"]
    assert memory["cache_size"] >= 1 and memory["window_plus_cache_over_kv"] <= 0.25
    assert results["command"].endswith("--quick --out " + str(out))
    assert results["peak_rss_bytes"] > 0


def test_text_filler_keeps_the_text_between_the_pairs():
    text = np.frombuffer(b"def f(x):\n    return x + 1\n\n" * 20, np.uint8)
    tokens, targets, distances = bench.generate(
        4,
        64,
        num_pairs=4,
        num_queries=3,
        final_distances=[3, 10, 20, 40],
        other_buckets=[(2, 8), (8, 32)],
        vocabulary_size=256,
        seed=2,
        filler="text",
        text=text,
    )
    filler, keys, values = bench.vocabulary_layout(256, "text")
    assert filler == (1, 128) and keys == (128, 192) and values == (192, 256)
    np.testing.assert_array_equal(distances[:, -1], [3, 10, 20, 40])
    for row in tokens:
        plain = row < 128
        assert plain.sum() == 64 - 2 * 4 - 3 - 2  # four pairs, three queries, the two earlier ones answered
        # The text positions hold one contiguous slice of the text, written over where the pairs are.
        starts = [s for s in range(len(text) - 64) if np.array_equal(text[s : s + 64][plain], row[plain])]
        assert starts, row
    assert np.all(targets[:, -1] >= 192)
    with pytest.raises(ValueError, match="needs `text`"):
        bench.generate(
            1,
            64,
            num_pairs=2,
            num_queries=1,
            final_distances=[3],
            other_buckets=[(2, 8)],
            vocabulary_size=256,
            seed=0,
            filler="text",
            text=text[:50],
        )
    with pytest.raises(ValueError, match="vocabulary_size"):
        bench.vocabulary_layout(128, "text")
    with pytest.raises(ValueError, match="filler"):
        bench.vocabulary_layout(256, "words")


def test_text_codes_are_ascii_without_zero():
    codes = bench.text_codes(5000)
    assert codes.dtype == np.uint8 and len(codes) == 5000
    assert codes.min() >= 1 and codes.max() < 128


def test_repeat_filler_is_one_pattern_at_a_random_phase():
    kwargs = dict(num_pairs=3, num_queries=2, other_buckets=[(2, 8)], vocabulary_size=64, filler="repeat")
    tokens, _, _ = bench.generate(6, 64, final_distances=[3, 4, 5, 6, 7, 3], seed=4, **kwargs)
    again, _, _ = bench.generate(2, 64, final_distances=[3, 3], seed=11, **kwargs)
    filler, _, _ = bench.vocabulary_layout(64, "repeat")
    p = bench.REPEAT_PERIOD
    pattern = None
    phases = set()
    for row in np.concatenate([tokens, again]):
        plain = row < filler[1]
        assert plain.sum() == 64 - 2 * 3 - 2 - 1
        if pattern is None:  # read the pattern off the first row: one period where it is plain
            start = next(s for s in range(64 - p) if plain[s : s + p].all())
            pattern = np.roll(row[start : start + p], start)  # pattern[i % p] at position i (phase 0)
        fits = [f for f in range(p) if np.array_equal(row[plain], pattern[(f + np.arange(64)) % p][plain])]
        assert len(fits) >= 1, row  # the same pattern in every row and call, at some phase
        phases.add(fits[0])
    assert len(phases) > 1  # the phase varies


# Slow: a subprocess that starts JAX and trains; the quick run above covers the benchmark on TensorFlow.
@pytest.mark.slow
def test_the_teacher_trains_and_is_scored_on_jax_without_tensorflow(tmp_path):
    # The teacher's training and scoring need neither TensorFlow nor this package (a GPU machine with
    # JAX alone can train it): a child process on the JAX backend where `import tensorflow` fails.
    import os
    import subprocess
    import sys

    out, weights = tmp_path / "r.json", tmp_path / "t.weights.h5"
    code = (
        "import sys; sys.modules['tensorflow'] = None; sys.modules['tensorflow_text'] = None\n"
        "from benchmarks import bench_recall as R\n"
        f"R.main(['--quick', '--rows', 'teacher', '--teacher-steps', '2', '--save-teacher', {str(weights)!r}, "
        f"'--out', {str(out)!r}])\n"
        "assert 'keras_linattn' not in sys.modules\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["backend"] == "jax" and result["environment"]["tensorflow"] is None
    assert result["teacher_training"]["steps"] == 2 and result["teacher_training"]["saved_to"] == str(weights)
    assert weights.exists()
    assert set(result["rows"][0]["accuracy"]) == {name for name, _, _ in result["buckets"]} | {"all"}


def test_transfer_freeze_picks_what_the_clamped_rows_leave_untrained():
    config = bench.config_from_args(bench.parse_args(["--quick"]))
    assert config["transfer_freeze"] == ("gamma", "linear_weight")  # the default
    config = bench.config_from_args(bench.parse_args(["--quick", "--transfer-freeze", "gamma"]))
    assert config["transfer_freeze"] == ("gamma",)
    assert bench.config_from_args(bench.parse_args(["--quick", "--transfer-freeze", ""]))["transfer_freeze"] == ()
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--transfer-freeze", "gamma,feature_map"])
