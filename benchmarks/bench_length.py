"""Length past training: bits/char at 1x, 4x and 16x the training length, teacher vs students vs from scratch.

    python -m benchmarks.bench_length                 # full run (about 40 minutes on one core)
    python -m benchmarks.bench_length --quick         # smoke run (tiny sizes)

Part 1, linearized students of one RoPE teacher. The teacher is the
character-level keras-hub Llama of ``examples/linearize`` (2 layers, width
64, 2 heads, RoPE, trained at T=512 on the standard library's source),
trained here or loaded (``--teacher-preset``, e.g. the preset
``python -m examples.linearize.run --family llama`` saved). Each student is
``linearize(teacher, window_size=32, window_gamma=0.9, ...)`` (hedgehog
maps, identity at start) followed by the same attention transfer at T=512
(``--transfer-steps`` steps of 2 rows, the feature maps and the window's
weights trained). Rows (``--students``):

- ``window``: the sliding window alone (the linear part off), no training;
- ``lolcats``: LoLCATs (the linear part on the rotated q/k, a sum);
- ``unrotated``: ``linear_rope=False``, the linear part's features on the
  queries and keys before the rotary embedding;
- ``mean``: ``linear_mean=True``, the linear terms a mean over the older
  keys, so their share does not grow with the length;
- ``unrotated_mean``: both.
- ``cache``, ``cache_unrotated``, ``cache_unrotated_mean``: the same with
  LoLA's sparse cache (``cache_size=--cache-size``): the pairs the linear
  part recalls worst, kept exactly beside the window.
- ``cache_unrotated_fixed``, ``cache_unrotated_mean_fixed``: the two
  unrotated cache rows with ``cache_distance=--window-size`` as well: the
  cache's softmax scores every cached pair as if it sat just past the
  window, so a pair far back is not scored at a RoPE distance the teacher
  never saw.
- ``cache_clamped``, ``cache_clamped_mean``: the two unrotated cache rows
  with ``cache_max_distance=T`` (the training length) instead: a cached
  pair at its real distance up to T, at T beyond (RoPE distance ``min(d, T)``).
- ``cache_clamped_copy``, ``cache_copy``, ``cache_unrotated_fixed_copy``:
  ``cache_clamped``, ``cache`` and ``cache_unrotated_fixed`` as linearized,
  no transfer (the rows above are all transferred, gamma and the linear
  weight trained; bench_recall's cache rows are not).
- ``cache_clamped_output``, ``cache_clamped_attention``,
  ``cache_clamped_both``: ``cache_clamped`` transferred with
  ``attention_transfer(objective="output" | "attention" | "both",
  freeze=("gamma", "linear_weight"))``: the feature maps train, the window's
  gamma and linear weight stay at copy (each row records the largest change
  of a frozen weight, ``frozen_max_change``). With ``cache_clamped_copy``
  these are bench_recall's ``sparse_cache_clamped`` and
  ``sparse_cache_clamped_{output,attention,both}``. With ``--teacher-preset``
  and ``--scratch ''`` they can be added to a run whose teacher was saved
  (``--save-teacher``).

The two mean rows start the learned linear weight at ``--mean-linear-weight``
(default 8: a mean of hedgehog kernels at copy is about 2/C, so weight 1
leaves the linear part near zero, and 100 transfer steps barely move it).

Part 2, from scratch (``--scratch``): `LinearCausalLM` with the README's
recommended DeltaNet + short convolution (``delta_conv``: ``feature_map=None,
update="delta", normalize=False, conv_size=4``) and its gated form
(``gated_delta_conv``: ``decay="scalar"``), the teacher's shape (2 layers,
width 64, 2 heads), no position embedding, trained at T=128 on the same
characters with the teacher's optimizer.

Bits/char are on held-out text: the same ``--eval-chars`` characters at
every length, cut into non-overlapping windows of the length (each window a
fresh sequence, every position scored).

Output: ``benchmarks/results/length.json`` (``--out``): the config, every
row's bits/char per length with its ratio to 1x, training times and the
process's peak RSS.
"""

import argparse
import json
import os
import shlex
import sys
import time

import keras
import keras_hub

import keras_linattn
from benchmarks._common import proc_status_bytes
from examples.char_lm.data import CharVocabulary, load_stdlib_corpus
from examples.linearize import pipeline as P

STUDENTS = {
    "window": None,
    "lolcats": {},
    "unrotated": {"linear_rope": False},
    "mean": {"linear_mean": True},
    "unrotated_mean": {"linear_rope": False, "linear_mean": True},
    # cache_size is --cache-size
    "cache": {"cache_size": None},
    "cache_unrotated": {"cache_size": None, "linear_rope": False},
    "cache_unrotated_mean": {"cache_size": None, "linear_rope": False, "linear_mean": True},
    # cache_distance is --window-size
    "cache_unrotated_fixed": {"cache_size": None, "linear_rope": False, "cache_distance": None},
    "cache_unrotated_mean_fixed": {
        "cache_size": None,
        "linear_rope": False,
        "linear_mean": True,
        "cache_distance": None,
    },
    # cache_max_distance is the training length
    "cache_clamped": {"cache_size": None, "linear_rope": False, "cache_max_distance": None},
    "cache_clamped_mean": {"cache_size": None, "linear_rope": False, "linear_mean": True, "cache_max_distance": None},
    # cache_clamped's construction: at copy (no transfer), and transferred with one objective each, gamma and the
    # linear weight frozen (bench_recall's sparse_cache_clamped and sparse_cache_clamped_{output,attention,both})
    "cache_clamped_copy": {"cache_size": None, "linear_rope": False, "cache_max_distance": None},
    # cache and cache_unrotated_fixed at copy (bench_recall's sparse_cache and sparse_cache_fixed)
    "cache_copy": {"cache_size": None},
    "cache_unrotated_fixed_copy": {"cache_size": None, "linear_rope": False, "cache_distance": None},
    "cache_clamped_output": {"cache_size": None, "linear_rope": False, "cache_max_distance": None},
    "cache_clamped_attention": {"cache_size": None, "linear_rope": False, "cache_max_distance": None},
    "cache_clamped_both": {"cache_size": None, "linear_rope": False, "cache_max_distance": None},
}
# Students scored as linearized, with no attention transfer.
AT_COPY = ("cache_clamped_copy", "cache_copy", "cache_unrotated_fixed_copy")
# Students transferred with `attention_transfer(objective=...)`, the window's gamma and linear weight frozen.
OBJECTIVES = {"cache_clamped_output": "output", "cache_clamped_attention": "attention", "cache_clamped_both": "both"}
FROZEN = ("gamma", "linear_weight")
SCRATCH = {
    "delta_conv": {"feature_map": None, "update": "delta", "normalize": False, "conv_size": 4},
    "gated_delta_conv": {"feature_map": None, "update": "delta", "normalize": False, "conv_size": 4, "decay": "scalar"},
}
QUICK = {
    "max_chars": 60_000,
    "teacher_steps": 20,
    "sequence_length": 32,
    "window_size": 8,
    "cache_size": 4,
    "transfer_steps": 3,
    "scratch_steps": 20,
    "scratch_length": 16,
    "eval_chars": 1100,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_length", description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-preset", default=None, help="a saved Llama teacher preset (else one is trained)")
    p.add_argument("--save-teacher", default=None, help="save the trained teacher's preset here")
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--sequence-length", type=int, default=512, help="the teacher's and the transfer's T")
    p.add_argument("--window-size", type=int, default=32)
    p.add_argument("--window-gamma", type=float, default=0.9)
    p.add_argument("--cache-size", type=int, default=32, help="the sparse cache's pairs in the cache rows")
    p.add_argument("--transfer-steps", type=int, default=100)
    p.add_argument(
        "--mean-linear-weight", type=float, default=8.0, help="initial linear weight of the mean rows (0: none)"
    )
    p.add_argument("--students", default=",".join(STUDENTS), help=f"comma list of {','.join(STUDENTS)}")
    p.add_argument("--scratch", default=",".join(SCRATCH), help=f"comma list of {','.join(SCRATCH)}, or ''")
    p.add_argument("--scratch-steps", type=int, default=1000)
    p.add_argument("--scratch-length", type=int, default=128, help="from-scratch training length")
    p.add_argument("--scratch-batch-size", type=int, default=32)
    p.add_argument("--factors", default="1,4,16", help="evaluation lengths as multiples of the training length")
    p.add_argument("--eval-chars", type=int, default=32_768, help="held-out characters scored at every length")
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/length.json")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny corpus, steps and lengths")
    args = p.parse_args(argv)
    args.command = "python -m benchmarks.bench_length" + "".join(" " + shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.students = [s for s in args.students.split(",") if s]
    args.scratch = [s for s in args.scratch.split(",") if s]
    for name in args.students:
        if name not in STUDENTS:
            p.error(f"unknown student {name!r}; known: {', '.join(STUDENTS)}")
    for name in args.scratch:
        if name not in SCRATCH:
            p.error(f"unknown from-scratch model {name!r}; known: {', '.join(SCRATCH)}")
    args.factors = [int(f) for f in args.factors.split(",")]
    longest = max(args.factors) * max(args.sequence_length, args.scratch_length)
    if args.eval_chars < longest + 1:
        p.error(f"--eval-chars ({args.eval_chars}) must hold one window of the longest length ({longest})")
    return args


def bits_at_lengths(model, ids, base_length, factors, eval_chars):
    """``{factor: bits/char}``: the same `eval_chars` ids cut into windows of ``factor * base_length``."""
    out = {}
    for factor in factors:
        length = factor * base_length
        n = eval_chars // (length + 1)
        out[factor] = round(P.bits_per_char(model, ids, length, max_sequences=n), 4)
    return out


def _row(name, bits, **extra):
    first = bits[min(bits)]
    return {
        "row": name,
        "bits_per_char": {str(f): b for f, b in bits.items()},
        "ratio_to_1x": {str(f): round(b / first, 4) for f, b in bits.items()},
        **extra,
    }


def _frozen_values(student):
    """``{variable path: value}`` of the window weights `FROZEN` names in the student's attention layers."""
    from keras_linattn.linearization._attention_objective import frozen_names

    names = frozen_names(FROZEN)
    return {
        v.path: keras.ops.convert_to_numpy(v).copy()
        for layer in P.attention_layers(student)
        for v in layer.weights
        if v.name in names
    }


def transfer(student, teacher, ids, args, objective="output", freeze=None):
    """`attention_transfer` as `examples.linearize.pipeline.transfer` runs it, with `objective` and `freeze`.

    Returns:
        ``(first loss, last loss)``.
    """
    pairs = list(zip(P.attention_layers(teacher), P.attention_layers(student), strict=True))
    data = P.dataset(ids, args.sequence_length, 2, seed=1).map(lambda x, y: x)
    _, history = keras_linattn.attention_transfer(
        student,
        teacher,
        data,
        steps=1,
        epochs=args.transfer_steps,
        learning_rate=1e-2,
        pairs=pairs,
        verbose=0,
        objective=objective,
        freeze=freeze,
    )
    losses = history.history["loss"]
    return float(losses[0]), float(losses[-1])


def make_student(name, teacher, ids, args):
    """``(student, row extras)``: the `STUDENTS` row `name` of `teacher`, linearized and trained as the row says.

    Raises:
        ValueError: for a name not in `STUDENTS`.
    """
    if name not in STUDENTS:
        raise ValueError(f"Unknown student {name!r}; known: {', '.join(STUDENTS)}")
    T, W = args.sequence_length, args.window_size
    if STUDENTS[name] is None:
        return P.window_only(teacher, W), {}
    options = dict(STUDENTS[name])
    if "cache_size" in options:
        options["cache_size"] = args.cache_size
    if "cache_distance" in options:
        options["cache_distance"] = W
    if "cache_max_distance" in options:
        options["cache_max_distance"] = T
    if options.get("linear_mean") and args.mean_linear_weight:
        options["linear_weight"] = args.mean_linear_weight
    student = keras_linattn.linearize(teacher, window_size=W, window_gamma=args.window_gamma, **options)
    extra = {"options": options}
    if name in AT_COPY:
        extra["transfer"] = None
    elif name in OBJECTIVES:
        before = _frozen_values(student)
        first, last = transfer(student, teacher, ids, args, objective=OBJECTIVES[name], freeze=FROZEN)
        after = _frozen_values(student)
        extra["transfer"] = {"objective": OBJECTIVES[name], "freeze": list(FROZEN), "steps": args.transfer_steps}
        extra["transfer_loss"] = [round(first, 6), round(last, 6)]
        # The freeze's check: the largest change of a frozen weight (0.0 where it held).
        extra["frozen_max_change"] = max((float(abs(after[k] - before[k]).max()) for k in before), default=None)
    else:
        _, first, last = P.transfer(
            student, teacher, ids, steps=args.transfer_steps, sequence_length=T, batch_size=2, verbose=0
        )
        extra["transfer_loss"] = [round(first, 6), round(last, 6)]
    return student, extra


def run(args):
    keras.utils.set_random_seed(args.seed)
    text = load_stdlib_corpus(args.max_chars)
    train_text, val_text = text[: int(0.95 * len(text))], text[int(0.95 * len(text)) :]
    vocab = CharVocabulary.from_text(train_text)
    ids, val_ids = vocab.encode(train_text), vocab.encode(val_text)
    val_ids = val_ids[: args.eval_chars]
    T = args.sequence_length
    res = {"command": args.command, "config": {k: v for k, v in vars(args).items() if k != "command"}, "rows": []}

    def save():
        res["peak_rss_bytes"] = proc_status_bytes("VmHWM")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def log(message):
        print(f"[{time.time() - started:7.1f}s] {message}", flush=True)

    started = time.time()
    if args.students:
        if args.teacher_preset:
            teacher = keras_hub.models.CausalLM.from_preset(args.teacher_preset, preprocessor=None)
            res["teacher"] = {"preset": args.teacher_preset}
        else:
            teacher = P.build_teacher("llama", vocab.size, sequence_length=T, seed=args.seed)
            start = time.time()
            tokens = P.train(
                teacher, ids, steps=args.teacher_steps, sequence_length=T, batch_size=8, learning_rate=3e-3, verbose=0
            )
            res["teacher"] = {"steps": args.teacher_steps, "tokens": tokens, "seconds": round(time.time() - start, 1)}
            if args.save_teacher:
                teacher.save_to_preset(args.save_teacher)
                res["teacher"]["preset"] = args.save_teacher
        log(f"teacher {res['teacher']}")
        bits = bits_at_lengths(teacher, val_ids, T, args.factors, args.eval_chars)
        res["rows"].append(_row("teacher", bits, trained_at=T))
        log(f"teacher: {bits}")
        save()
        for name in args.students:
            start = time.time()
            student, extra = make_student(name, teacher, ids, args)
            bits = bits_at_lengths(student, val_ids, T, args.factors, args.eval_chars)
            res["rows"].append(_row(name, bits, trained_at=T, seconds=round(time.time() - start, 1), **extra))
            log(f"{name}: {bits} {extra}")
            save()
    for name in args.scratch:
        start = time.time()
        model = keras_linattn.models.LinearCausalLM(
            vocabulary_size=vocab.size,
            num_layers=2,
            hidden_dim=64,
            num_heads=2,
            intermediate_dim=256,
            **SCRATCH[name],
        )
        tokens = P.train(
            model,
            ids,
            steps=args.scratch_steps,
            sequence_length=args.scratch_length,
            batch_size=args.scratch_batch_size,
            learning_rate=3e-3,
            verbose=0,
        )
        bits = bits_at_lengths(model, val_ids, args.scratch_length, args.factors, args.eval_chars)
        seconds = round(time.time() - start, 1)
        res["rows"].append(
            _row(
                f"scratch_{name}",
                bits,
                trained_at=args.scratch_length,
                tokens=tokens,
                seconds=seconds,
                options=SCRATCH[name],
            )
        )
        log(f"scratch {name}: {bits}")
        save()
    save()
    return res


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()
