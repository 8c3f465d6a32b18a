"""`benchmarks/recall_length.py`: the recall / length table from per-seed outputs written in the benchmarks' schema."""

import json

import pytest

from benchmarks import recall_length as A

# 4-32x retrieval and 1x / 16x bits per student; each seed adds `seed * 0.01` to the retrieval, `seed * 0.001`
# to the bits, so the means are the seed-1 values and the ranges +-0.01 / +-0.001 around them.
BASE = {
    # student: (inside, 1-4x, 4-32x, 1x, 4x, 16x)
    "teacher": (0.90, 0.90, 0.90, 2.00, 3.80, 4.80),
    "window": (1.00, 0.10, 0.05, 2.01, 1.98, 1.93),
    "lolcats": (0.20, 0.10, 0.10, 2.00, 3.90, 5.00),
    "sparse_cache": (0.99, 0.99, 0.95, 2.00, 2.80, 3.80),  # best retrieval, breaks past the length
    "cache_distance": (1.00, 0.18, 0.13, 2.06, 2.10, 2.14),
    "cache_clamped": (0.99, 0.99, 0.85, 2.00, 2.01, 2.03),  # meets all three
    "cache_clamped_output": (0.20, 0.20, 0.30, 1.99, 2.00, 2.02),
    "cache_clamped_attention": (0.99, 0.99, 0.88, 1.99, 2.00, 2.02),  # meets all three, the best of those
    "cache_clamped_both": (0.90, 0.90, 0.70, 1.99, 2.00, 2.02),
}
RECALL_ROW = {s: r for s, r, _, _ in A.STUDENTS}
LENGTH_ROW = {s: r for s, _, r, _ in A.STUDENTS}
TRANSFERRED = {"cache_clamped_output": "output", "cache_clamped_attention": "attention", "cache_clamped_both": "both"}


def _recall(seed, base=BASE, config=None, skip=()):
    rows = []
    for student, (inside, mid, far, *_) in base.items():
        if student in skip:
            continue
        d = 0.01 * (seed - 1)
        row = {
            "name": RECALL_ROW[student],
            "title": student,
            "accuracy": {"inside window": inside + d, "1-4x window": mid + d, "4-32x window": far + d, "all": 0.5},
            "count": {"inside window": 256, "1-4x window": 256, "4-32x window": 256, "all": 768},
        }
        if student in TRANSFERRED:
            row["transfer"] = {"steps": 100, "objective": TRANSFERRED[student], "freeze": ["gamma", "linear_weight"]}
        if student == "lolcats":
            row["transfer"] = {"steps": 100, "objective": "output", "freeze": []}
        rows.append(row)
    cfg = {"sequence_length": 256, "window_size": 8, "cache_size": 56, "seed": seed, **(config or {})}
    memory = {"teacher_kv_pairs_per_head": 256, "window": 8, "cache_size": 56, "cache_over_kv": 56 / 256}
    return {
        "command": f"python -m benchmarks.bench_recall --seed {seed}",
        "config": cfg,
        "memory": memory,
        "rows": rows,
    }


def _length(seed, base=BASE, skip=(), only=None):
    rows = []
    for student, (*_, one, four, sixteen) in base.items():
        if student in skip or (only is not None and student not in only):
            continue
        d = 0.001 * (seed - 1)
        row = {"row": LENGTH_ROW[student], "bits_per_char": {"1": one + d, "4": four + d, "16": sixteen + d}}
        if student in TRANSFERRED:
            row["transfer"] = {"objective": TRANSFERRED[student], "freeze": ["gamma", "linear_weight"], "steps": 100}
        elif student.startswith("cache") or student == "sparse_cache":
            row["transfer"] = None
        elif student == "lolcats":
            row["transfer_loss"] = [0.01, 0.001]
        rows.append(row)
    cfg = {"sequence_length": 512, "window_size": 32, "cache_size": 32, "factors": [1, 4, 16], "seed": seed}
    return {"command": f"python -m benchmarks.bench_length --seed {seed}", "config": cfg, "rows": rows}


def _write(tmp_path, outputs, prefix):
    paths = []
    for i, output in enumerate(outputs):
        path = tmp_path / f"{prefix}{i}.json"
        path.write_text(json.dumps(output))
        paths.append(str(path))
    return paths


def _table(tmp_path, recall, length, **kwargs):
    return A.aggregate(
        A.load_runs(_write(tmp_path, recall, "r"), "recall"),
        A.load_runs(_write(tmp_path, length, "l"), "length"),
        **kwargs,
    )


def test_rows_hold_the_issue_schema_with_means_and_ranges_over_the_seeds(tmp_path):
    rows = _table(tmp_path, [_recall(s) for s in (0, 1, 2)], [_length(s) for s in (0, 1, 2)])
    assert [r["student"] for r in rows] == [s for s, *_ in A.STUDENTS]
    required = {"student", "seeds", "haystack", "bits_per_char", "recommended", "cache_fraction", "after_transfer_of"}
    for row in rows:
        assert required | {"command", "haystack_range", "bits_per_char_range"} <= set(row)
        assert row["seeds"] == [0, 1, 2]
        assert set(row["haystack"]) == {"inside", "1-4x", "4-32x"}
        assert set(row["bits_per_char"]) == {"1x", "4x", "16x"}
        inside, mid, far, one, four, sixteen = BASE[row["student"]]
        assert row["haystack"] == pytest.approx({"inside": inside, "1-4x": mid, "4-32x": far}, abs=1e-4)
        assert row["haystack_range"]["4-32x"] == pytest.approx([far - 0.01, far + 0.01], abs=1e-4)
        assert row["bits_per_char"] == pytest.approx({"1x": one, "4x": four, "16x": sixteen}, abs=1e-4)
        assert row["bits_per_char_range"]["16x"] == pytest.approx([sixteen - 0.001, sixteen + 0.001], abs=1e-4)
        assert len(row["command"]["recall"]) == len(row["command"]["length"]) == 3
    by = {r["student"]: r for r in rows}
    assert [r["student"] for r in rows].count("teacher") == 1
    assert by["teacher"]["cache_fraction"] == 1.0 and by["window"]["cache_fraction"] == 0.0
    assert by["cache_clamped"]["cache_fraction"] == pytest.approx(56 / 256, abs=1e-4)
    assert by["cache_clamped_attention"]["after_transfer_of"] == "cache_clamped"
    assert by["sparse_cache"]["after_transfer_of"] is None
    assert by["cache_clamped_attention"]["training"]["length"] == [
        "attention transfer, objective attention, gamma, linear_weight frozen"
    ]
    assert by["cache_clamped"]["training"] == {"recall": ["none (as linearized)"], "length": ["none (as linearized)"]}
    assert by["cache_clamped"]["beats_window_beyond_range"] == {"4-32x": True, "1x": True}
    change = by["cache_clamped_attention"]["change_from_copy"]
    assert change["seeds"] == [0, 1, 2]
    assert change["haystack"]["4-32x"] == pytest.approx([0.03, 0.03, 0.03], abs=1e-4)  # 0.88 - 0.85 on each seed
    assert change["bits_per_char"]["1x"] == pytest.approx([-0.01, -0.01, -0.01], abs=1e-4)
    assert by["cache_clamped_attention"]["per_seed"]["haystack"]["2"]["4-32x"] == pytest.approx(0.89)
    assert "change_from_copy" not in by["cache_clamped"]


def test_the_recommended_row_meets_the_targets_with_the_best_far_retrieval(tmp_path):
    rows = _table(tmp_path, [_recall(s) for s in (0, 1, 2)], [_length(s) for s in (0, 1, 2)])
    chosen = [r for r in rows if r["recommended"]]
    assert [r["student"] for r in chosen] == ["cache_clamped_attention"]
    assert chosen[0]["recommended_rule"].startswith("tier 1 ")
    by = {r["student"]: r for r in rows}
    # sparse_cache retrieves best but fails the length target; cache_distance fails retrieval.
    assert by["sparse_cache"]["targets"] == {"retrieval": True, "cache": True, "length": False}
    assert by["cache_distance"]["targets"]["retrieval"] is False
    assert by["teacher"]["targets"] is None


def test_without_a_row_meeting_every_target_the_rule_falls_back_and_says_so(tmp_path):
    base = {**BASE, "cache_clamped": (0.9, 0.9, 0.5, 2.0, 2.0, 2.0), "cache_clamped_attention": (1, 1, 0.6, 2, 2, 2)}
    rows = _table(tmp_path, [_recall(s, base) for s in (0, 1, 2)], [_length(s, base) for s in (0, 1, 2)])
    (chosen,) = [r for r in rows if r["recommended"]]
    assert chosen["student"] == "cache_clamped_both"  # 0.70: the best far retrieval that holds the length
    assert chosen["recommended_rule"].startswith("tier 2 ") and "fallback" in chosen["recommended_rule"]
    assert "fallback" in A.render_markdown(rows)


def test_a_missing_seed_is_recorded_and_left_out_of_the_means(tmp_path, capsys):
    recall = [_recall(0), _recall(1), _recall(2, skip=("cache_clamped_both",))]
    rows = _table(tmp_path, recall, [_length(s) for s in (0, 1, 2)], min_seeds=2)
    both = next(r for r in rows if r["student"] == "cache_clamped_both")
    assert both["seeds"] == [0, 1]
    assert both["missing_seeds"] == {"recall": [2], "length": []}
    # The mean of seeds 0 and 1 only: 0.70 - 0.005.
    assert both["haystack"]["4-32x"] == pytest.approx(0.695, abs=1e-4)
    assert both["haystack_range"]["4-32x"] == pytest.approx([0.69, 0.70], abs=1e-4)
    assert "cache_clamped_both: no recall row 'sparse_cache_clamped_both' for seeds [2]" in capsys.readouterr().err


def test_a_student_with_no_seed_on_one_benchmark_has_no_values_and_is_not_recommended(tmp_path):
    length = [_length(s, skip=("cache_clamped_attention",)) for s in (0, 1, 2)]
    rows = _table(tmp_path, [_recall(s) for s in (0, 1, 2)], length)
    attention = next(r for r in rows if r["student"] == "cache_clamped_attention")
    assert attention["seeds"] == [] and attention["haystack"] is None and attention["bits_per_char"] is None
    assert attention["recommended"] is False
    assert next(r for r in rows if r["recommended"])["student"] == "cache_clamped"
    assert "| cache_clamped_attention | - |" in A.render_markdown(rows)


def test_fewer_seeds_than_asked_cannot_be_recommended(tmp_path):
    with pytest.raises(ValueError, match="No student has 3 seeds"):
        _table(tmp_path, [_recall(0)], [_length(0)])
    rows = _table(tmp_path, [_recall(0)], [_length(0)], min_seeds=1)
    assert sum(r["recommended"] for r in rows) == 1


def test_a_follow_up_file_adds_rows_to_its_seed(tmp_path):
    students = ("teacher", "window", "lolcats", "sparse_cache", "cache_distance")
    main = [_length(s, only=students) for s in (0, 1, 2)]
    follow_up = [_length(s, skip=students[1:]) for s in (0, 1, 2)]  # the teacher again, and the clamped rows
    rows = _table(tmp_path, [_recall(s) for s in (0, 1, 2)], main + follow_up)
    assert all(r["seeds"] == [0, 1, 2] for r in rows)
    assert "duplicates" not in rows[0]  # the same teacher numbers in both files


def test_settings_that_differ_across_files_stop_the_table(tmp_path):
    recall = [_recall(0), _recall(1, config={"window_size": 16})]
    with pytest.raises(ValueError, match="differ in 'window_size'"):
        A.load_runs(_write(tmp_path, recall, "r"), "recall")
    no_seed = _recall(0)
    del no_seed["config"]["seed"]
    with pytest.raises(ValueError, match="no config"):
        A.load_runs(_write(tmp_path, [no_seed], "r"), "recall")
    with pytest.raises(ValueError, match="Cannot read"):
        A.load_runs([str(tmp_path / "absent.json")], "length")


def test_a_student_can_be_mapped_to_another_length_row(tmp_path):
    length = [_length(s) for s in (0, 1, 2)]
    for output in length:
        output["rows"].append(
            {"row": "cache", "bits_per_char": {"1": 2.0, "4": 2.8, "16": 3.8}, "transfer_loss": [1, 0]}
        )
    rows = _table(tmp_path, [_recall(s) for s in (0, 1, 2)], length, length_rows={"sparse_cache": "cache"})
    cache = next(r for r in rows if r["student"] == "sparse_cache")
    assert cache["rows"] == {"recall": "sparse_cache", "length": "cache"}
    assert cache["training"]["length"] == ["attention transfer, objective output, nothing frozen"]
    with pytest.raises(ValueError, match="Unknown students"):
        _table(tmp_path, [_recall(0)], [_length(0)], min_seeds=1, length_rows={"nope": "cache"})


def test_main_writes_a_list_of_rows_and_the_tables(tmp_path, capsys):
    recall = ",".join(_write(tmp_path, [_recall(s) for s in (0, 1, 2)], "r"))
    length = ",".join(_write(tmp_path, [_length(s) for s in (0, 1, 2)], "l"))
    points = [
        {"student": "teacher", "cache_size": None, "pairs": 8, "accuracy": 0.9},
        {"student": "sparse_cache", "cache_size": 16, "pairs": 8, "accuracy": 0.5},
    ]
    curve = _write(tmp_path, [{"points": points}, {"points": [{**p, "accuracy": 0.7} for p in points]}], "c")
    out, markdown = tmp_path / "recall_length.json", tmp_path / "table.md"
    argv = ["--recall", recall, "--length", length, "--curve", ",".join(curve), "--out", str(out)]
    assert A.main([*argv, "--markdown", str(markdown)]) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and sum(r["recommended"] for r in rows) == 1
    text = markdown.read_text()
    assert "**cache_clamped_attention** (recommended)" in text
    assert "- cache_clamped_attention - cache_clamped: haystack 4-32x +0.030 (+0.030 to +0.030)" in text
    assert "| teacher | KV | 0.800 (0.700-0.900) |" in text
    assert "| sparse_cache | 16 | 0.600 (0.500-0.700) |" in text
    with pytest.raises(SystemExit):
        A.parse_args(["--recall", recall, "--length", length, "--length-row", "sparse_cache"])
