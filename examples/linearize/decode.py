"""Decode time per token: a linearized student against its keras-hub teacher's `generate`, in one process.

python -m examples.linearize.decode --teacher-preset DIR --student-preset DIR \
    --results benchmarks/results/linearize_llama.json

Per-token time at a context c: each repeat times a greedy generate of n0
and of n1 tokens after c tokens (for keras-hub: a padded input of c + n1
tokens whose first c + n1 - n are the prompt, so both runs have the same
prefill) and takes ``(t(c, n1) - t(c, n0)) / (n1 - n0)``; the figure is the
median over the repeats, with the lowest and highest beside it. The
measurements of all contexts are interleaved over the repeats. The student
generates more tokens per run than the teacher (``--new`` vs
``--teacher-new``): its per-token time is ~100x smaller, and a difference of
a few ms between two runs would otherwise be noise.
"""

import argparse
import json
import time

import keras_hub
import numpy as np

from examples.linearize import pipeline as P


def per_token_ms(times_n0, times_n1, n0, n1):
    """``(median, lowest, highest)`` ms per token from paired wall times (s) of n0- and n1-token runs."""
    if len(times_n0) != len(times_n1) or not times_n0 or n1 <= n0:
        raise ValueError(
            "per_token_ms takes one n0 and one n1 time per repeat, with n1 > n0. "
            f"Received: {len(times_n0)} and {len(times_n1)} times, n0={n0}, n1={n1}"
        )
    per_token = 1e3 * (np.asarray(times_n1, "float64") - np.asarray(times_n0, "float64")) / (n1 - n0)
    return float(np.median(per_token)), float(per_token.min()), float(per_token.max())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-preset", required=True)
    p.add_argument("--student-preset", required=True)
    p.add_argument("--contexts", default="256,1024,4096,16384")
    p.add_argument("--teacher-contexts", default="4096,16384")
    p.add_argument("--new", default="8,1032", help="n0,n1 tokens the student generates")
    p.add_argument("--teacher-new", default="8,264", help="n0,n1 tokens the teacher generates")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--results", default=None, help="a results JSON whose 'decode' entry is replaced")
    args = p.parse_args(argv)
    new = {"student": tuple(map(int, args.new.split(","))), "teacher": tuple(map(int, args.teacher_new.split(",")))}
    teacher = keras_hub.models.CausalLM.from_preset(args.teacher_preset, preprocessor=None)
    student = keras_hub.models.CausalLM.from_preset(args.student_preset, preprocessor=None)
    P.compile_lm(teacher, 1e-3)
    V = teacher.backbone.vocabulary_size
    rng = np.random.default_rng(0)
    runs = {}
    for c in map(int, args.contexts.split(",")):
        prompt = rng.integers(2, V, (1, c)).astype("int32")
        for n in new["student"]:
            runs[("student", c, n)] = lambda prompt=prompt, c=c, n=n: student.generate(
                prompt, max_length=c + n, stop_token_ids=None
            )
    for c in map(int, args.teacher_contexts.split(",")):
        n1 = new["teacher"][1]
        ids = rng.integers(2, V, (1, c + n1)).astype("int32")
        for n in new["teacher"]:
            mask = np.zeros_like(ids)
            mask[:, : c + n1 - n] = 1
            runs[("teacher", c, n)] = lambda ids=ids, mask=mask: teacher.generate(
                {"token_ids": ids, "padding_mask": mask}, stop_token_ids=None
            )
    for fn in runs.values():
        fn()  # compile
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    out = {
        "student_ms_per_token": {},
        "teacher_ms_per_token": {},
        "range_ms_per_token": {},
        "new_tokens": {who: list(n) for who, n in new.items()},
        "repeats": args.repeats,
    }
    for (who, c, n), ts in times.items():
        n0, n1 = new[who]
        if n == n1:
            median, lowest, highest = per_token_ms(times[(who, c, n0)], ts, n0, n1)
            out[f"{who}_ms_per_token"][str(c)] = round(median, 4)
            out["range_ms_per_token"][f"{who} {c}"] = [round(lowest, 4), round(highest, 4)]
    student = out["student_ms_per_token"]
    if student:
        out["student_spread"] = round(max(student.values()) / min(student.values()), 3)
    out["command"] = "python -m examples.linearize.decode " + " ".join(argv or __import__("sys").argv[1:])
    print(json.dumps(out, indent=1))
    if args.results:
        with open(args.results) as f:
            res = json.load(f)
        res["decode"] = out
        with open(args.results, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
