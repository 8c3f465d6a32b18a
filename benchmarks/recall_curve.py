"""The cache-size curve: retrieval on dense rows at 4-32x the window against cache size and pairs per row.

    python -m benchmarks.bench_recall --load-teacher teacher.weights.h5 --cache-sizes 16,32,64,128,256 \\
        --pair-counts 8,16,24,32,40,48 --out benchmarks/results/recall_curve.json
    python -m benchmarks.bench_recall --quick --cache-sizes 4,8 --pair-counts 2,4,8   # smoke run

A mode of `benchmarks.bench_recall` (``--cache-sizes`` with
``--pair-counts``): the teacher is loaded (``--load-teacher``) or trained
as there, and its sparse-cache students are scored without training at
each cache size N, beside the teacher, on the same rows.

The rows (dense rows, the teacher's training layout): its filler
(``--filler``, or ``--eval-filler``), P pairs per row and P queries (every
pair queried, as in the training rows' 40 pairs and 40 queries), or Q
queries with ``--eval-queries`` (Q <= P). The last query sits at T - 1,
its key at a distance in the 4-32x bucket (``4 W <= d < min(32 W, T - 1)``,
``--num-eval`` rows, drawn as bench_recall's evaluation rows with seed 1:
the same rows for every seed and model). Only that query is scored. Before
it, ``P + Q - 1`` positions hold a value (each pair's, each earlier
query's answer): ``value_positions``, which a cache of N pairs must hold
beside the window for exact recall.

Students (``--curve-students``, default both), bench_recall's rows of the
same names with ``cache_size=N``: ``sparse_cache`` (the cache at real RoPE
distance, the small linear weight) and ``sparse_cache_clamped`` (the cache
at distance ``min(d, T)``, the linear part on unrotated features).

Output (``--out``, default ``benchmarks/results/recall_curve.json``): the
config, the bucket, the teacher's training or source, and ``points``: a list
of ``{"student", "cache_size" (None for the teacher), "cache_over_kv"
(N / T; 1 for the teacher), "pairs", "queries", "value_positions",
"accuracy", "count", "wall_s"}``, written after every student. A markdown
table is printed (``benchmarks.recall_length --curve`` tabulates several
seeds' files).
"""

import json
import os
import time

from benchmarks import bench_recall as R
from benchmarks._common import proc_status_bytes

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "recall_curve.json")
CURVE_STUDENTS = ("sparse_cache", "sparse_cache_clamped")


def _int_list(parser, flag, text):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} takes a comma list of positive ints. Received: {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} takes a comma list of positive ints. Received: {text!r}")
    return values


def check_args(parser, args):
    """Parses the curve's flags into ``args.cache_sizes``, ``args.pair_counts`` and ``args.curve_students``.

    Calls ``parser.error`` (exits) for a flag without the other, a bad list
    or an unknown student.
    """
    if not (args.cache_sizes and args.pair_counts):
        parser.error("The cache-size curve needs both --cache-sizes and --pair-counts.")
    args.cache_sizes = _int_list(parser, "--cache-sizes", args.cache_sizes)
    args.pair_counts = _int_list(parser, "--pair-counts", args.pair_counts)
    students = [s for s in (args.curve_students or ",".join(CURVE_STUDENTS)).split(",") if s]
    unknown = sorted(set(students) - set(CURVE_STUDENTS))
    if unknown or not students:
        parser.error(f"--curve-students: unknown {unknown}; choose from {CURVE_STUDENTS}")
    args.curve_students = students


def curve_bucket(cfg):
    """``(name, lo, hi)``: the 4-32x bucket at the evaluated length."""
    return R.buckets(cfg["window_size"], R.eval_length(cfg))[2]


def curve_rows(cfg, pairs, queries=None, seed=1):
    """``(tokens, last targets, last distances)``: `num_eval` dense rows, the last query in the 4-32x bucket.

    Args:
        cfg: a bench_recall config.
        pairs: pairs per row.
        queries: queries per row (default `pairs`).
        seed: the rows' seed.

    Raises:
        ValueError: for pairs and queries that do not fit in a row (as `generate`).
    """
    queries = pairs if queries is None else queries
    t = R.eval_length(cfg)
    _, lo, hi = curve_bucket(cfg)
    final = R.stratified_distances(cfg["num_eval"], [(None, lo, hi)], seed)
    tokens, targets, distances = R.generate(
        len(final),
        t,
        num_pairs=pairs,
        num_queries=queries,
        final_distances=final,
        other_buckets=[(lo_, hi_) for _, lo_, hi_ in R.buckets(cfg["window_size"], t)],
        vocabulary_size=cfg["vocabulary_size"],
        seed=seed + 1,
        **R._filler_args(cfg, cfg.get("eval_filler")),
    )
    return tokens, targets[:, -1], distances[:, -1]


def _point(student, size, t, rows, model, cfg, predict):
    start = time.perf_counter()
    tokens, targets, _, pairs, queries = rows
    correct = R.last_predictions(model, tokens, cfg, predict) == targets
    return {
        "student": student,
        "cache_size": size,
        "cache_over_kv": 1.0 if size is None else size / t,
        "pairs": pairs,
        "queries": queries,
        "value_positions": pairs + queries - 1,
        "accuracy": float(correct.mean()),
        "count": int(correct.size),
        "wall_s": time.perf_counter() - start,
    }


def run_curve(cfg, cache_sizes, pair_counts, students, log, save, queries=None):
    """The curve's points (module docstring); `save(points)` after the teacher and after each student's size."""
    t = R.eval_length(cfg)
    row_sets = {}
    for pairs in pair_counts:  # every row set first: a bad pair count fails before the teacher trains
        q = pairs if queries is None else queries
        row_sets[pairs] = (*curve_rows(cfg, pairs, q), pairs, q)
    teacher, training = R.get_teacher(cfg, log)
    predict = R.prediction_function(teacher)
    points = [_point("teacher", None, t, row_sets[p], teacher, cfg, predict) for p in pair_counts]
    log("teacher: " + ", ".join(f"{p['pairs']} pairs {p['accuracy']:.3f}" for p in points))
    save(points, training)
    for student in students:
        for size in cache_sizes:
            import keras

            keras.utils.set_random_seed(1 + cfg.get("seed", 0))
            model = R.make_student(student, teacher, {**cfg, "cache_size": size})
            predict = R.prediction_function(model)
            new = [_point(student, size, t, row_sets[p], model, cfg, predict) for p in pair_counts]
            points += new
            log(f"{student} N={size}: " + ", ".join(f"{p['pairs']} pairs {p['accuracy']:.3f}" for p in new))
            save(points, training)
    return points


def render_curve_table(points):
    """Markdown: one line per (student, cache size), one column per pair count."""
    pair_counts = sorted({p["pairs"] for p in points})
    lines = [
        "| student | cache | " + " | ".join(f"{n} pairs" for n in pair_counts) + " |",
        "|---|---:" + "|---:" * len(pair_counts) + "|",
    ]
    keys = list(dict.fromkeys((p["student"], p["cache_size"]) for p in points))
    for student, size in keys:
        acc = {p["pairs"]: p["accuracy"] for p in points if (p["student"], p["cache_size"]) == (student, size)}
        cells = [f"{acc[n]:.3f}" if n in acc else "-" for n in pair_counts]
        lines.append(f"| {student} | {'KV' if size is None else size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args, cfg, results, log):
    """bench_recall's curve mode: runs `run_curve` and writes ``args.out``; returns 0."""
    started = time.perf_counter()
    results.pop("memory", None)  # the rows' cache; the curve's sizes are in its points
    results["curve"] = {
        "bucket": list(curve_bucket(cfg)),
        "cache_sizes": args.cache_sizes,
        "pair_counts": args.pair_counts,
        "queries": args.eval_queries or "pairs",
        "students": args.curve_students,
    }

    def save(points, training):
        results["teacher_training"], results["points"] = training, points
        results["total_wall_s"] = time.perf_counter() - started
        results["peak_rss_bytes"] = proc_status_bytes("VmHWM")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    points = run_curve(
        cfg, args.cache_sizes, args.pair_counts, args.curve_students, log, save, queries=args.eval_queries
    )
    print(render_curve_table(points))
    print(f"wrote {args.out}")
    return 0
