"""Recall and length in one table: the same students on `bench_recall` and `bench_length`, means over seeds.

    python -m benchmarks.recall_length --recall r_s0.json,r_s1.json,r_s2.json \\
        --length l_s0.json,l_s1.json,l_s2.json [--curve c_s0.json,...] \\
        --out benchmarks/results/recall_length.json [--markdown table.md]

Reads per-seed outputs of ``python -m benchmarks.bench_recall`` (haystack
retrieval by distance) and ``python -m benchmarks.bench_length`` (bits/char
past the training length). A file's seed is its ``config["seed"]``; several
files may hold one seed (a run and a follow-up with more rows, e.g.
``bench_length --teacher-preset``): their rows are merged, and a row name
found twice for one seed keeps the first file's values (a difference is
printed and kept in the row's ``"duplicates"``). The benchmark settings that
decide a number (lengths, window, cache, steps, evaluation rows) must agree
across a benchmark's files, else the script stops naming the key and files.

Each student of `STUDENTS` is one row name on each benchmark:

======================= ================================ ===========================
student                 bench_recall row                 bench_length row
======================= ================================ ===========================
teacher                 teacher                          teacher
window                  window_only                      window
lolcats                 lolcats                          lolcats
sparse_cache            sparse_cache                     cache_copy
cache_distance          sparse_cache_fixed               cache_unrotated_fixed_copy
cache_clamped           sparse_cache_clamped             cache_clamped_copy
cache_clamped_output    sparse_cache_clamped_output      cache_clamped_output
cache_clamped_attention sparse_cache_clamped_attention   cache_clamped_attention
cache_clamped_both      sparse_cache_clamped_both        cache_clamped_both
======================= ================================ ===========================

(the cache rows untrained on both, the ``_output/_attention/_both`` rows
transferred with that objective, gamma and the linear weight frozen, on
both). ``--length-row student=row`` maps a student to another bench_length
row (e.g. ``sparse_cache=cache``, the transferred one); each output row
says how each benchmark's model was trained (``"training"``).

Output (``--out``): a JSON list of rows, one per student, in `STUDENTS`'
order::

    {"student": str, "seeds": [int, ...],
     "haystack": {"inside": mean, "1-4x": mean, "4-32x": mean},
     "haystack_range": {"inside": [min, max], ...},
     "bits_per_char": {"1x": mean, "4x": mean, "16x": mean},
     "bits_per_char_range": {"1x": [min, max], ...},
     "recommended": bool, "cache_fraction": float,
     "after_transfer_of": student or None,
     "command": {"recall": [command, ...], "length": [command, ...]},
     "rows": {"recall": row, "length": row}, "training": {"recall": str, "length": str},
     "missing_seeds": {"recall": [...], "length": [...]},
     "targets": {...} or None, "beats_window_beyond_range": {...} or None,
     "per_seed": {"haystack": {seed: {...}}, "bits_per_char": {seed: {...}}},
     "change_from_copy": {...} (the transferred rows only),
     "recommended_rule": str (the recommended row only)}

- ``seeds``: the seeds on which the student has a row on both benchmarks;
  every mean, min and max is over exactly these (a seed with one benchmark
  only is listed in ``missing_seeds`` and printed, and not used). A student
  with no such seed has ``null`` values.
- ``cache_fraction``: the cache's pairs over the teacher's KV cache on the
  recall benchmark (``memory.cache_over_kv``, ``N / T``); 1 for the
  teacher, 0 for the students without a cache (the window alone, LoLCATs).
- ``targets`` (issue 59): ``retrieval`` (4-32x mean >= 0.9 x the teacher's),
  ``cache`` (cache_fraction <= 1/4), ``length`` (16x mean <= 1.02 x its own
  1x mean).
- ``change_from_copy`` (a row with ``after_transfer_of``): the row minus
  its copy on each seed both have, ``{"seeds", "haystack": {key: [mean,
  min, max]}, "bits_per_char": {...}}`` (issue 59: after the attention
  objective, retrieval >= at copy and bits/char < at copy).
- ``beats_window_beyond_range``: ``{"4-32x": its min > the window's max,
  "1x": its max bits < the window's min}``, on the seeds of each.

The recommended row (exactly one, `recommend`): among the students (not the
teacher) with at least ``--min-seeds`` seeds (default 3), the best 4-32x
retrieval (ties: the lower 16x bits/char) of the first non-empty tier: (1)
meeting all three targets, (2) the cache and length targets, (3) the cache
target, (4) any. Its ``recommended_rule`` names the tier; a tier after (1)
is printed as a fallback.

``--curve``: per-seed outputs of ``bench_recall --cache-sizes`` (the
cache-size curve); printed as a markdown table (mean, and range over the
files) after the main one, and written to ``--markdown`` with it.
"""

import argparse
import json
import os
import shlex
import sys

RECALL_BUCKETS = {"inside": "inside window", "1-4x": "1-4x window", "4-32x": "4-32x window"}
LENGTH_FACTORS = {"1x": "1", "4x": "4", "16x": "16"}
# (student, bench_recall row, bench_length row, the student it is transferred from, or None)
STUDENTS = (
    ("teacher", "teacher", "teacher", None),
    ("window", "window_only", "window", None),
    ("lolcats", "lolcats", "lolcats", None),
    ("sparse_cache", "sparse_cache", "cache_copy", None),
    ("cache_distance", "sparse_cache_fixed", "cache_unrotated_fixed_copy", None),
    ("cache_clamped", "sparse_cache_clamped", "cache_clamped_copy", None),
    ("cache_clamped_output", "sparse_cache_clamped_output", "cache_clamped_output", "cache_clamped"),
    ("cache_clamped_attention", "sparse_cache_clamped_attention", "cache_clamped_attention", "cache_clamped"),
    ("cache_clamped_both", "sparse_cache_clamped_both", "cache_clamped_both", "cache_clamped"),
)
NO_CACHE = ("window", "lolcats")
# The settings that decide a benchmark's numbers: equal across its files.
RECALL_KEYS = (
    "sequence_length",
    "window_size",
    "vocabulary_size",
    "num_pairs",
    "num_queries",
    "num_layers",
    "hidden_dim",
    "num_heads",
    "num_key_value_heads",
    "teacher_steps",
    "transfer_steps",
    "num_eval",
    "cache_size",
    "window_gamma",
    "linear_weight",
    "filler",
    "eval_filler",
    "eval_num_pairs",
    "eval_num_queries",
    "eval_length",
)
LENGTH_KEYS = (
    "sequence_length",
    "window_size",
    "window_gamma",
    "cache_size",
    "transfer_steps",
    "mean_linear_weight",
    "factors",
    "eval_chars",
    "max_chars",
)
RETRIEVAL_TARGET, CACHE_TARGET, LENGTH_TARGET = 0.9, 0.25, 1.02
TIERS = (
    ("retrieval", "cache", "length"),
    ("cache", "length"),
    ("cache",),
    (),
)


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read a benchmark output. Received: {path!r} ({e})") from e


def load_runs(paths, kind):
    """``{seed: {"rows": {name: row}, "files": {name: path}, "commands": {path: command}, "memory": ...}}``.

    Args:
        paths: the benchmark's output files.
        kind: ``"recall"`` (rows named by ``"name"``) or ``"length"`` (``"row"``).

    Raises:
        ValueError: for no files, an unreadable file, a file without a
            seed, or files whose settings (`RECALL_KEYS` / `LENGTH_KEYS`) differ.
    """
    if kind not in ("recall", "length"):
        raise ValueError(f"`kind` must be 'recall' or 'length'. Received: kind={kind!r}")
    if not paths:
        raise ValueError(f"No {kind} files. Received: paths={paths!r}")
    keys, field = (RECALL_KEYS, "name") if kind == "recall" else (LENGTH_KEYS, "row")
    runs, first = {}, None
    for path in paths:
        result = _read(path)
        config = result.get("config", {})
        if "seed" not in config:
            raise ValueError(f"The {kind} output {path!r} has no config['seed'] (rerun it with --seed).")
        settings = {k: config.get(k) for k in keys}
        if first is None:
            first = (path, settings)
        for k in keys:
            if settings[k] != first[1][k]:
                raise ValueError(
                    f"The {kind} outputs differ in {k!r}: {first[1][k]!r} in {first[0]!r}, {settings[k]!r} in {path!r}"
                )
        run = runs.setdefault(config["seed"], {"rows": {}, "files": {}, "commands": {}, "duplicates": {}})
        run["commands"][path] = result.get("command")
        run.setdefault("memory", result.get("memory"))
        for row in result.get("rows", []):
            name = row[field]
            if name in run["rows"]:
                if _values(row, kind) != _values(run["rows"][name], kind):
                    note = f"{kind} row {name!r}, seed {config['seed']}: {run['files'][name]!r} kept, {path!r} differs"
                    print(f"warning: {note}", file=sys.stderr)
                    run["duplicates"].setdefault(name, []).append(note)
                continue
            run["rows"][name], run["files"][name] = row, path
    return runs


def _values(row, kind):
    """The row's numbers in the table's keys: ``{"inside": acc, ...}`` or ``{"1x": bits, ...}`` (None if absent)."""
    if kind == "recall":
        return {k: row.get("accuracy", {}).get(v) for k, v in RECALL_BUCKETS.items()}
    return {k: row.get("bits_per_char", {}).get(v) for k, v in LENGTH_FACTORS.items()}


def _training(row, kind):
    """How the benchmark's model of the row was trained, in words."""
    transfer = row.get("transfer")
    if kind == "length" and transfer is None and "transfer_loss" in row:
        return "attention transfer, objective output, nothing frozen"
    if not transfer:
        return "none (as linearized)" if row.get("name", row.get("row")) != "teacher" else "the teacher"
    frozen = ", ".join(transfer.get("freeze") or ()) or "nothing"
    return f"attention transfer, objective {transfer.get('objective', 'output')}, {frozen} frozen"


def _stats(per_seed):
    """``(means, ranges)`` of ``[{key: value}]`` over the list (values rounded to 4 places)."""
    keys = per_seed[0].keys()
    means = {k: round(sum(v[k] for v in per_seed) / len(per_seed), 4) for k in keys}
    ranges = {k: [round(min(v[k] for v in per_seed), 4), round(max(v[k] for v in per_seed), 4)] for k in keys}
    return means, ranges


def _student_row(student, rows_of, after, recall, length):
    """One output row (before the targets and the recommendation)."""
    names = {"recall": rows_of[0], "length": rows_of[1]}
    present = {
        kind: {s for s, run in runs.items() if names[kind] in run["rows"]}
        for kind, runs in (("recall", recall), ("length", length))
    }
    every = set(recall) | set(length)
    seeds = sorted(present["recall"] & present["length"])
    missing = {kind: sorted(every - present[kind]) for kind in present}
    out = {"student": student, "seeds": seeds, "rows": names, "missing_seeds": missing}
    for kind, field, runs in (("recall", "haystack", recall), ("length", "bits_per_char", length)):
        per_seed = [_values(runs[s]["rows"][names[kind]], kind) for s in seeds]
        if any(v is None for values in per_seed for v in values.values()):
            absent = [s for s, values in zip(seeds, per_seed, strict=True) if None in values.values()]
            raise ValueError(f"The {kind} row {names[kind]!r} lacks a column of {list(per_seed[0])} on seeds {absent}.")
        out[field], out[field + "_range"] = _stats(per_seed) if per_seed else (None, None)
        out.setdefault("per_seed", {})[field] = {str(s): v for s, v in zip(seeds, per_seed, strict=True)}
    for kind in ("recall", "length"):
        if missing[kind]:
            print(
                f"note: {student}: no {kind} row {names[kind]!r} for seeds {missing[kind]}; "
                f"its means are over seeds {seeds}",
                file=sys.stderr,
            )
    out["recommended"] = False
    out["cache_fraction"] = _cache_fraction(student, recall, seeds)
    out["after_transfer_of"] = after
    out["command"] = {
        kind: [runs[s]["commands"][runs[s]["files"][names[kind]]] for s in seeds]
        for kind, runs in (("recall", recall), ("length", length))
    }
    out["training"] = {
        kind: sorted({_training(runs[s]["rows"][names[kind]], kind) for s in seeds})
        for kind, runs in (("recall", recall), ("length", length))
    }
    duplicates = [
        note
        for kind, runs in (("recall", recall), ("length", length))
        for s in seeds
        for note in runs[s]["duplicates"].get(names[kind], [])
    ]
    if duplicates:
        out["duplicates"] = duplicates
    return out


def _cache_fraction(student, recall, seeds):
    if student == "teacher":
        return 1.0
    if student in NO_CACHE:
        return 0.0
    fractions = {recall[s]["memory"]["cache_over_kv"] for s in seeds if recall[s].get("memory")}
    return round(fractions.pop(), 4) if len(fractions) == 1 else None


def _targets(row, teacher):
    if row["student"] == "teacher" or row["haystack"] is None or teacher["haystack"] is None:
        return None
    return {
        "retrieval": row["haystack"]["4-32x"] >= RETRIEVAL_TARGET * teacher["haystack"]["4-32x"],
        "cache": row["cache_fraction"] is not None and row["cache_fraction"] <= CACHE_TARGET,
        "length": row["bits_per_char"]["16x"] <= LENGTH_TARGET * row["bits_per_char"]["1x"],
    }


def _beats(row, window):
    if row["student"] in ("teacher", "window") or window is None or row["haystack"] is None:
        return None
    if window["haystack"] is None:
        return None
    return {
        "4-32x": row["haystack_range"]["4-32x"][0] > window["haystack_range"]["4-32x"][1],
        "1x": row["bits_per_char_range"]["1x"][1] < window["bits_per_char_range"]["1x"][0],
    }


def _change(row, copy):
    """``{"seeds", "haystack": {key: [mean, min, max]}, "bits_per_char": ...}``: row minus copy, seed by seed."""
    seeds = [s for s in row["seeds"] if s in copy["seeds"]]
    out = {"seeds": seeds}
    for field in ("haystack", "bits_per_char"):
        if not seeds:
            out[field] = None
            continue
        diffs = [
            {k: row["per_seed"][field][str(s)][k] - copy["per_seed"][field][str(s)][k] for k in row[field]}
            for s in seeds
        ]
        means, ranges = _stats(diffs)
        out[field] = {k: [means[k], *ranges[k]] for k in means}
    return out


def recommend(rows, min_seeds):
    """Marks exactly one row ``recommended`` (module docstring's rule) and returns it.

    Raises:
        ValueError: when no student besides the teacher has `min_seeds` seeds.
    """
    eligible = [r for r in rows if r["student"] != "teacher" and r["targets"] and len(r["seeds"]) >= min_seeds]
    if not eligible:
        counts = {r["student"]: len(r["seeds"]) for r in rows}
        raise ValueError(f"No student has {min_seeds} seeds on both benchmarks to recommend. Received: {counts}")
    for tier, needed in enumerate(TIERS, 1):
        chosen = [r for r in eligible if all(r["targets"][t] for t in needed)]
        if chosen:
            best = max(chosen, key=lambda r: (r["haystack"]["4-32x"], -r["bits_per_char"]["16x"]))
            best["recommended"] = True
            met = ", ".join(needed) or "none"
            best["recommended_rule"] = (
                f"tier {tier} of {len(TIERS)}: best 4-32x retrieval among the students with >= {min_seeds} seeds "
                f"meeting the targets: {met}" + ("" if tier == 1 else " (fallback: no student meets all three)")
            )
            return best
    raise AssertionError("the last tier needs no target")


def aggregate(recall, length, min_seeds=3, length_rows=None):
    """The table's rows (module docstring) from `load_runs` outputs.

    Args:
        recall, length: `load_runs` outputs of the two benchmarks.
        min_seeds: the seeds a student needs to be recommended.
        length_rows: optional ``{student: bench_length row}`` overrides.

    Raises:
        ValueError: for an unknown student in `length_rows`, a teacher
            without seeds on both benchmarks, or as `recommend`.
    """
    length_rows = dict(length_rows or {})
    unknown = sorted(set(length_rows) - {s for s, *_ in STUDENTS})
    if unknown:
        raise ValueError(f"Unknown students in the length rows: {unknown}; known: {[s for s, *_ in STUDENTS]}")
    rows = [
        _student_row(student, (recall_row, length_rows.get(student, length_row)), after, recall, length)
        for student, recall_row, length_row, after in STUDENTS
    ]
    teacher, window = rows[0], rows[1]
    if not teacher["seeds"]:
        raise ValueError(f"The teacher has no seed on both benchmarks. Received: missing {teacher['missing_seeds']}")
    for row in rows:
        row["targets"] = _targets(row, teacher)
        row["beats_window_beyond_range"] = _beats(row, window if window["seeds"] else None)
        if row["after_transfer_of"]:
            row["change_from_copy"] = _change(row, next(r for r in rows if r["student"] == row["after_transfer_of"]))
    recommend(rows, min_seeds)
    return rows


def _cell(means, ranges, key, digits=3):
    if means is None:
        return "-"
    lo, hi = ranges[key]
    return f"{means[key]:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def render_markdown(rows):
    """The table: mean (min-max) per column, the seeds, the cache fraction, the recommended row in bold."""
    head = [*(f"haystack {k}" for k in RECALL_BUCKETS), *(f"bits/char {k}" for k in LENGTH_FACTORS)]
    lines = ["| student | " + " | ".join(head) + " | cache / KV | seeds |", "|---" + "|---:" * (len(head) + 2) + "|"]
    for r in rows:
        cells = [_cell(r["haystack"], r["haystack_range"], k) for k in RECALL_BUCKETS]
        cells += [_cell(r["bits_per_char"], r["bits_per_char_range"], k) for k in LENGTH_FACTORS]
        name = f"**{r['student']}** (recommended)" if r["recommended"] else r["student"]
        fraction = "-" if r["cache_fraction"] is None else f"{r['cache_fraction']:.3f}"
        seeds = ",".join(map(str, r["seeds"])) or "none"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {fraction} | {seeds} |")
    changes = [r for r in rows if r.get("change_from_copy") and r["change_from_copy"]["haystack"]]
    if changes:
        lines += ["", "After transfer minus at copy, mean (min-max) over the seeds both have:", ""]
        for r in changes:
            far, one = r["change_from_copy"]["haystack"]["4-32x"], r["change_from_copy"]["bits_per_char"]["1x"]
            lines.append(
                f"- {r['student']} - {r['after_transfer_of']}: haystack 4-32x {far[0]:+.3f} "
                f"({far[1]:+.3f} to {far[2]:+.3f}), bits/char 1x {one[0]:+.4f} ({one[1]:+.4f} to {one[2]:+.4f})"
            )
    best = next(r for r in rows if r["recommended"])
    lines += ["", f"Recommended: {best['student']} ({best['recommended_rule']})."]
    return "\n".join(lines)


def render_curve(paths):
    """The cache-size curve's table: 4-32x accuracy, mean (min-max) over the files, per student and pair count."""
    points = {}
    for path in paths:
        for p in _read(path).get("points", []):
            points.setdefault((p["student"], p["cache_size"]), {}).setdefault(p["pairs"], []).append(p["accuracy"])
    pairs = sorted({n for by_pairs in points.values() for n in by_pairs})
    lines = [
        f"Cache-size curve ({len(paths)} file(s)): accuracy at 4-32x the window",
        "",
        "| student | cache | " + " | ".join(f"{n} pairs" for n in pairs) + " |",
        "|---|---:" + "|---:" * len(pairs) + "|",
    ]
    order = sorted(points, key=lambda k: (k[0] != "teacher", k[0], k[1] or 0))
    for student, size in order:
        cells = []
        for n in pairs:
            acc = points[(student, size)].get(n)
            cells.append("-" if not acc else f"{sum(acc) / len(acc):.3f} ({min(acc):.3f}-{max(acc):.3f})")
        lines.append(f"| {student} | {'KV' if size is None else size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.recall_length", description=__doc__.split("\n\n")[0])
    p.add_argument("--recall", required=True, help="comma list of bench_recall outputs (one seed or more each)")
    p.add_argument("--length", required=True, help="comma list of bench_length outputs")
    p.add_argument("--curve", default="", help="comma list of bench_recall --cache-sizes outputs")
    p.add_argument("--min-seeds", type=int, default=3, help="seeds a student needs to be recommended")
    p.add_argument(
        "--length-row", action="append", default=[], help="student=bench_length row, overriding the default map"
    )
    p.add_argument("--out", default="benchmarks/results/recall_length.json")
    p.add_argument("--markdown", default=None, help="also write the table(s) here")
    args = p.parse_args(argv)
    args.command = "python -m benchmarks.recall_length " + shlex.join(sys.argv[1:] if argv is None else argv)
    overrides = {}
    for item in args.length_row:
        student, sep, row = item.partition("=")
        if not sep or not row:
            p.error(f"--length-row takes student=row. Received: {item!r}")
        overrides[student] = row
    args.length_rows = overrides
    return args


def main(argv=None):
    args = parse_args(argv)
    recall = load_runs([x for x in args.recall.split(",") if x], "recall")
    length = load_runs([x for x in args.length.split(",") if x], "length")
    rows = aggregate(recall, length, min_seeds=args.min_seeds, length_rows=args.length_rows)
    text = render_markdown(rows)
    curve = [x for x in args.curve.split(",") if x]
    if curve:
        text += "\n\n" + render_curve(curve)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"<!-- {args.command} -->\n\n{text}\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
