"""Bits/char of the linearized students of ``examples/linearize`` with float32, bfloat16 and int8 weights.

    python -m benchmarks.bench_precision_quality --family llama     # teacher 1000 steps, transfer 100, LoRA 100
    python -m benchmarks.bench_precision_quality --family gpt2
    python -m benchmarks.bench_precision_quality --family llama --student-preset DIR   # a saved student
    python -m benchmarks.bench_precision_quality --family llama --quick                # smoke run (tiny sizes)

The student is the example's (``python -m examples.linearize.run``, same settings and seed): the character-level
keras-hub teacher (2 layers, width 64, 2 heads) trained ``--teacher-steps`` steps at T=512 on the standard
library's source, ``linearize(teacher, window_size=32, window_gamma=0.9)``, attention transfer, LoRA (rank 8,
alpha 16) and `merge_lora`. Or a student preset that run saved (``<work-dir>/<family>_student_preset``), or that
this script saved on an earlier run (``--student-preset``).

Each precision holds the same weights: ``float32`` the student itself; ``bfloat16`` the student rebuilt with
``dtype="bfloat16"`` and its weights rounded (the features, the state and the normalizer stay float32);
``int8`` a float32 copy after ``Model.quantize("int8")``. Bits/char on the held-out 5% of the text: 16 windows
of T at 1x and one window of 16 T at 16x (8,192 characters either way), as the example's length rows. GPT-2's
learned positions stop at T: its student (which keeps them) has no 16x row. Target: bf16 and int8 within 0.01
bits/char of float32.

Output (``--out``, default ``benchmarks/results/precision_quality_<family>.json``): every row with its command,
the config, the student's provenance, seconds and the process's peak RSS.
"""

import argparse
import json
import os
import shlex
import sys
import time

import keras
import keras_hub
import numpy as np

import keras_linattn
import keras_linattn.models  # noqa: F401 - registers the student's classes for `from_preset`
from benchmarks._common import proc_status_bytes
from examples.char_lm.data import CharVocabulary, load_stdlib_corpus
from examples.linearize import pipeline as P

PRECISIONS = ("float32", "bfloat16", "int8")
TARGET = 0.01


def _data(args):
    """``(train ids, held-out ids)``: run.py's corpus, split and vocabulary."""
    text = load_stdlib_corpus(args.max_chars)
    train_text, val_text = text[: int(0.95 * len(text))], text[int(0.95 * len(text)) :]
    vocab = CharVocabulary.from_text(train_text)
    return vocab.encode(train_text), vocab.encode(val_text), vocab.size


def _student(args, ids, vocabulary_size, log):
    """``(merged float32 student, provenance)``: loaded from `--student-preset`, or the example's recipe run here."""
    if args.student_preset:
        log(f"student: loading {args.student_preset}")
        student = keras_hub.models.CausalLM.from_preset(args.student_preset, preprocessor=None)
        return student, {"student_preset": args.student_preset}
    T = args.sequence_length
    teacher = P.build_teacher(
        args.family, vocabulary_size, hidden_dim=args.hidden_dim, num_layers=2, num_heads=2, sequence_length=T
    )
    start = time.time()
    P.train(teacher, ids, steps=args.teacher_steps, sequence_length=T, batch_size=8, learning_rate=3e-3, verbose=0)
    provenance = {"teacher_steps": args.teacher_steps, "teacher_train_seconds": round(time.time() - start, 1)}
    log(f"teacher trained: {provenance}")
    student = keras_linattn.linearize(teacher, window_size=args.window_size, window_gamma=0.9)
    kw = dict(sequence_length=T, batch_size=2, verbose=0)
    P.transfer(student, teacher, ids, steps=args.transfer_steps, learning_rate=1e-2, **kw)
    student, _ = P.lora_student(student, ids, steps=args.lora_steps, learning_rate=1e-3, **kw)
    provenance.update(transfer_steps=args.transfer_steps, lora_steps=args.lora_steps)
    preset = os.path.join(args.work_dir, f"{args.family}_precision_student_preset")
    student.save_to_preset(preset)
    provenance["student_preset"] = preset
    log(f"student saved: {preset}")
    return student, provenance


def _with_weights_of(student, dtype):
    """`student` rebuilt from its config with `dtype` weights, its weights rounded to them."""
    config = student.get_config()
    config["backbone"]["config"]["dtype"] = dtype
    rebuilt = type(student).from_config(config)
    rebuilt(P.as_inputs(np.ones((1, 4), "int32")))
    for target, source in zip(rebuilt.weights, student.weights, strict=True):
        target.assign(keras.ops.cast(source, target.dtype))
    return rebuilt


def precision_model(student, precision):
    """The student with `precision` weights (``"float32"``, ``"bfloat16"`` or ``"int8"``): the same weights."""
    if precision == "float32":
        return student
    if precision == "bfloat16":
        return _with_weights_of(student, "bfloat16")
    if precision == "int8":
        quantized = _with_weights_of(student, "float32")
        quantized.quantize("int8")
        return quantized
    raise ValueError(f"`precision` must be one of {PRECISIONS}. Received: precision={precision!r}")


def _max_length(model):
    """The longest sequence the model takes: its learned positions' count, or None (no position table)."""
    return model.backbone.get_config().get("max_sequence_length")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=P.FAMILIES, default="llama")
    p.add_argument("--student-preset", default=None, help="a saved student preset (else the recipe runs here)")
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--transfer-steps", type=int, default=100)
    p.add_argument("--lora-steps", type=int, default=100)
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--window-size", type=int, default=32)
    p.add_argument("--hidden-dim", type=int, default=64)
    p.add_argument("--factors", default="1,16", help="evaluation lengths as multiples of the training length")
    p.add_argument("--eval-chars", type=int, default=8192, help="held-out characters scored at every length")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--work-dir", default="/tmp/linearize_example")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny corpus, steps and lengths")
    args = p.parse_args(argv)
    if args.quick:
        args.teacher_steps, args.transfer_steps, args.lora_steps = 2, 2, 2
        args.sequence_length, args.window_size, args.hidden_dim = 32, 8, 16
        args.eval_chars, args.max_chars = 64 * 4, 60_000
    args.out = args.out or f"benchmarks/results/precision_quality_{args.family}.json"
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    command = "python -m benchmarks.bench_precision_quality " + " ".join(shlex.quote(a) for a in argv)
    start = time.time()

    def log(message):
        print(f"[{time.time() - start:7.1f}s] {message}", flush=True)

    keras.utils.set_random_seed(args.seed)
    ids, val_ids, vocabulary_size = _data(args)
    student, provenance = _student(args, ids, vocabulary_size, log)
    T = args.sequence_length
    res = {"family": args.family, "command": command, "config": vars(args), "student": provenance, "rows": []}
    float32 = {}
    for precision in args.precisions.split(","):
        model = precision_model(student, precision)
        for factor in map(int, args.factors.split(",")):
            length = factor * T
            row = {"precision": precision, "factor": factor, "length": length, "command": command}
            limit = _max_length(model)
            if limit is not None and length > limit:
                row["skipped"] = f"learned positions stop at {limit}"
            else:
                sequences = max(1, args.eval_chars // length)
                bpc = P.bits_per_char(model, val_ids, length, sequences)
                row.update(sequences=sequences, bits_per_char=round(bpc, 4))
                float32.setdefault(factor, bpc if precision == "float32" else None)
                if float32[factor] is not None and precision != "float32":
                    row["delta_vs_float32"] = round(bpc - float32[factor], 4)
                    row["within_target"] = abs(bpc - float32[factor]) <= TARGET
            res["rows"].append(row)
            log(row)
        del model
    res["seconds"] = round(time.time() - start, 1)
    res["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
