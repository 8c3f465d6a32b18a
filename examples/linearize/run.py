"""Linearize a keras-hub GPT-2 / Llama teacher (LoLCATs) and compare it with its controls.

python -m examples.linearize.run --family llama --log /tmp/linearize_llama.log

For each family: trains a small softmax teacher (keras-hub backbone, random
init, character vocabulary) on the Python standard library's source, saves
it as a local preset and loads it back, then

- linearizes it (`keras_linattn.linearize`, hedgehog + a softmax window far
  shorter than the context), weights copied;
- attention transfer (`keras_linattn.attention_transfer`, feature maps and
  window gamma only);
- LoRA (rank 8, alpha 16, q/k/v/o) on the student, merged;
- controls: the softmax teacher + the same LoRA; the sliding-window softmax
  alone (the window layer with a feature map that is 0, so no linear
  part); the same linear model trained from scratch with the teacher's
  tokens; a delta-rule student (short convolution) instead of hedgehog;
- exactness with a covering window, bits/char at 1x/4x/16x the training
  length (RoPE teacher), decode time against keras-hub's KV cache, and
  SavedModel / ONNX export with parity and token checks.

Results go to ``benchmarks/results/linearize_<family>.json`` after each stage.

With the network, ``--teacher gpt2_base_en`` (any keras-hub GPT-2 or Llama
CausalLM preset) skips the teacher's training and uses the preset and its
tokenizer; bits/char are then bits per token times tokens per character.
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
from examples.char_lm.data import CharVocabulary, load_stdlib_corpus
from examples.linearize import pipeline as P

STAGES = ("scratch", "delta", "length", "decode", "export")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=P.FAMILIES, default="gpt2", help="teacher family trained here")
    p.add_argument("--teacher", default=None, help="a keras-hub CausalLM preset (name or directory) instead")
    p.add_argument("--sequence-length", type=int, default=512)
    p.add_argument("--window-size", type=int, default=32)
    p.add_argument(
        "--window-gamma",
        type=float,
        default=0.9,
        help="initial weight of the window's softmax terms (LoLCATs: 0.1; 0.9 measured better here, docs/linearize.md)",
    )
    p.add_argument("--hidden-dim", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--teacher-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8, help="teacher (and from-scratch) batch")
    p.add_argument("--teacher-lr", type=float, default=3e-3)
    p.add_argument("--transfer-steps", type=int, default=40)
    p.add_argument("--transfer-lr", type=float, default=1e-2)
    p.add_argument("--lora-steps", type=int, default=40)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--linearize-batch-size", type=int, default=2, help="batch of transfer and LoRA")
    p.add_argument("--eval-sequences", type=int, default=16)
    p.add_argument("--max-chars", type=int, default=2_000_000)
    p.add_argument("--skip", default="", help=f"comma-separated stages to skip: {','.join(STAGES)}")
    p.add_argument("--decode-contexts", default="256,1024,4096,16384")
    p.add_argument("--teacher-decode-contexts", default="4096,16384")
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--work-dir", default="/tmp/linearize_example")
    p.add_argument("--results", default=None, help="JSON path (default benchmarks/results/linearize_<family>.json)")
    p.add_argument("--log", default=None, help="also append progress lines to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reuse-teacher",
        action="store_true",
        help="load the teacher preset a previous run with the same teacher settings saved (its results JSON "
        "names it) instead of training it again",
    )
    args = p.parse_args(argv)
    unknown = set(filter(None, args.skip.split(","))) - set(STAGES)
    if unknown:
        p.error(f"--skip takes {STAGES}. Received: {sorted(unknown)}")
    return args


class Log:
    def __init__(self, path):
        self.path, self.start = path, time.time()

    def __call__(self, message):
        line = f"[{time.time() - self.start:7.1f}s] {message}"
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def run(args):
    log = Log(args.log)
    skip = set(filter(None, args.skip.split(",")))
    name = args.family if args.teacher is None else os.path.basename(args.teacher.rstrip("/"))
    results_path = args.results or f"benchmarks/results/linearize_{name}.json"
    command = "python -m examples.linearize.run " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    T, W = args.sequence_length, args.window_size
    res = {
        "family": name,
        "command": command,
        "config": {k: v for k, v in vars(args).items() if k not in ("log", "results")},
        "rows": [],
    }

    def save():
        os.makedirs(os.path.dirname(results_path) or ".", exist_ok=True)
        with open(results_path, "w") as f:
            json.dump(res, f, indent=1)

    def row(label, bpc, **extra):
        res["rows"].append({"row": label, "bits_per_char": round(bpc, 4), **extra})
        log(f"{label}: {bpc:.4f} bits/char {extra if extra else ''}")
        save()

    keras.utils.set_random_seed(args.seed)
    text = load_stdlib_corpus(args.max_chars)
    train_text, val_text = text[: int(0.95 * len(text))], text[int(0.95 * len(text)) :]
    lin_kw = dict(sequence_length=T, batch_size=args.linearize_batch_size)

    previous = _reusable_teacher(args, results_path) if args.reuse_teacher else None
    if args.teacher is None and previous is not None:
        vocab = CharVocabulary.from_text(train_text)
        ids, val_ids = vocab.encode(train_text), vocab.encode(val_text)
        V, chars_per_token = vocab.size, 1.0
        teacher = keras_hub.models.CausalLM.from_preset(previous["teacher_preset"], preprocessor=None)
        teacher_tokens = previous["teacher_tokens"]
        for key in ("teacher_preset", "teacher_train_seconds"):
            res[key] = previous[key]
        res["teacher_reused_from"] = previous["command"]
        log(f"teacher {args.family}: reused {previous['teacher_preset']} ({teacher_tokens} tokens)")
    elif args.teacher is None:
        vocab = CharVocabulary.from_text(train_text)
        ids, val_ids = vocab.encode(train_text), vocab.encode(val_text)
        V, chars_per_token = vocab.size, 1.0
        teacher = P.build_teacher(
            args.family,
            V,
            hidden_dim=args.hidden_dim,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            sequence_length=T,
            seed=args.seed,
        )
        log(f"teacher {args.family}: {teacher.count_params()} params, vocab {V}, {len(ids)} train chars")
        start = time.time()
        teacher_tokens = P.train(
            teacher,
            ids,
            steps=args.teacher_steps,
            sequence_length=T,
            batch_size=args.batch_size,
            learning_rate=args.teacher_lr,
            seed=args.seed,
        )
        res["teacher_train_seconds"] = round(time.time() - start, 1)
        preset = os.path.join(args.work_dir, f"{args.family}_teacher_preset")
        teacher.save_to_preset(preset)
        teacher = keras_hub.models.CausalLM.from_preset(preset)  # the local preset, as a user would load it
        res["teacher_preset"] = preset
    else:
        teacher = keras_hub.models.CausalLM.from_preset(args.teacher)
        tokenizer = teacher.preprocessor.tokenizer
        teacher.preprocessor = None
        ids = np.asarray(tokenizer(train_text[: 20 * T * args.linearize_batch_size * 50]), "int32")
        val_ids = np.asarray(tokenizer(val_text), "int32")
        V, chars_per_token = teacher.backbone.vocabulary_size, len(val_text) / len(val_ids)
        teacher_tokens = None
    P.compile_lm(teacher, 1e-3)
    res["teacher_tokens"] = teacher_tokens

    def bpc(model, length=T, n=args.eval_sequences):
        return P.bits_per_char(model, val_ids, length, n, chars_per_token)

    teacher_bpc = bpc(teacher)
    row("teacher", teacher_bpc, tokens=teacher_tokens)

    # Exactness: a window covering the sequence is the teacher's softmax.
    exact = keras_linattn.linearize(teacher, window_size=T)
    abs_err, rel_err = P.max_errors(exact, teacher, val_ids[: 2 * T].reshape(2, T))
    res["exactness"] = {"window_size": T, "sequence_length": T, "max_abs_logit_error": abs_err, "max_rel": rel_err}
    log(f"exactness (window {T} at T={T}): max abs {abs_err:.3g}, rel {rel_err:.3g}")
    del exact

    student = keras_linattn.linearize(teacher, window_size=W, window_gamma=args.window_gamma)
    row(f"linearized (hedgehog + window {W}), weights copied", bpc(student), tokens=0)
    window_only = P.window_only(teacher, W)
    row(f"control: sliding-window softmax alone (window {W}, linear part 0)", bpc(window_only), tokens=0)

    start = time.time()
    t_tokens, first, last = P.transfer(
        student, teacher, ids, steps=args.transfer_steps, learning_rate=args.transfer_lr, **lin_kw
    )
    res["transfer"] = {"first_loss": first, "last_loss": last, "seconds": round(time.time() - start, 1)}
    student_transfer_bpc = bpc(student)
    row("+ attention transfer", student_transfer_bpc, tokens=t_tokens)
    student.save_to_preset(os.path.join(args.work_dir, f"{name}_student_transfer_preset"))

    start = time.time()
    merged, l_tokens = P.lora_student(student, ids, steps=args.lora_steps, learning_rate=args.lora_lr, **lin_kw)
    res["lora_seconds"] = round(time.time() - start, 1)
    lora_bpc = bpc(merged)
    row("+ attention transfer + LoRA (merged)", lora_bpc, tokens=t_tokens + l_tokens)
    merged.save_to_preset(os.path.join(args.work_dir, f"{name}_student_preset"))
    res["linearize_tokens"] = t_tokens + l_tokens
    if teacher_tokens:
        res["linearize_token_fraction"] = round((t_tokens + l_tokens) / teacher_tokens, 4)

    control = keras_hub.models.CausalLM.from_preset(res.get("teacher_preset", args.teacher), preprocessor=None)
    P.lora_teacher(control, ids, steps=args.lora_steps, learning_rate=args.lora_lr, **lin_kw)
    control_bpc = bpc(control)
    row("control: softmax teacher + the same LoRA", control_bpc, tokens=l_tokens)
    del control

    if "delta" not in skip:
        delta = keras_linattn.linearize(teacher, window_size=None, update="delta", conv_size=4, normalize=False)
        row("delta rule + conv 4 (hedgehog), weights copied", bpc(delta), tokens=0)
        d_tokens, d_first, d_last = P.transfer(
            delta, teacher, ids, steps=args.transfer_steps, learning_rate=args.transfer_lr, **lin_kw
        )
        res["delta_transfer"] = {"first_loss": d_first, "last_loss": d_last}
        row("delta rule + conv 4, + attention transfer", bpc(delta), tokens=d_tokens)
        del delta

    res["targets"] = {
        "transfer_within_0.05_of_teacher": {
            "gap": round(student_transfer_bpc - teacher_bpc, 4),
            "met": student_transfer_bpc - teacher_bpc <= 0.05,
        },
        "lora_within_0.02_of_softmax_lora": {
            "gap": round(lora_bpc - control_bpc, 4),
            "met": lora_bpc - control_bpc <= 0.02,
        },
        "beats_window_only": {
            "window_only": res["rows"][2]["bits_per_char"],
            "transfer": round(student_transfer_bpc, 4),
            "met": student_transfer_bpc < res["rows"][2]["bits_per_char"],
        },
    }
    if teacher_tokens:
        res["targets"]["budget_5_percent"] = {
            "fraction": res["linearize_token_fraction"],
            "met": res["linearize_token_fraction"] <= 0.05,
        }
    save()

    if "length" not in skip and args.family == "llama" and args.teacher is None:
        res["length"] = []
        for factor, n in ((1, args.eval_sequences), (4, 4), (16, 1)):
            entry = {
                "factor": factor,
                "length": factor * T,
                "sequences": n,
                "teacher": round(bpc(teacher, factor * T, n), 4),
                "student": round(bpc(merged, factor * T, n), 4),
            }
            res["length"].append(entry)
            log(f"length {entry}")
            save()

    if "export" not in skip:
        start = time.time()
        res["export"] = P.export_check(merged, os.path.join(args.work_dir, f"{name}_export"), V)
        res["export"]["seconds"] = round(time.time() - start, 1)
        log(f"export {res['export']}")
        save()

    sample_prompt = val_ids[:64][None] if args.teacher is None else None
    if sample_prompt is not None:
        tokens = merged.generate(sample_prompt, max_length=64 + 96, stop_token_ids=None)
        res["sample"] = {"prompt": vocab.decode(sample_prompt[0]), "completion": vocab.decode(tokens[0, 64:])}
        log(f"sample: {res['sample']}")
        save()

    if "decode" not in skip and args.family == "llama":
        res["decode"] = {"student_ms_per_token": {}, "teacher_ms_per_token": {}}
        for c in map(int, args.decode_contexts.split(",")):
            ms = P.student_ms_per_token(merged, c, V, repeats=args.decode_repeats)
            res["decode"]["student_ms_per_token"][str(c)] = round(ms, 3)
            log(f"decode student context {c}: {ms:.3f} ms/token")
            save()
        for c in map(int, args.teacher_decode_contexts.split(",")):
            ms = P.teacher_ms_per_token(teacher, c, V, repeats=args.decode_repeats)
            res["decode"]["teacher_ms_per_token"][str(c)] = round(ms, 3)
            log(f"decode teacher (keras-hub generate) context {c}: {ms:.3f} ms/token")
            save()

    if "scratch" not in skip and args.teacher is None:
        scratch = keras_linattn.linearize(
            P.build_teacher(
                args.family,
                V,
                hidden_dim=args.hidden_dim,
                num_layers=args.num_layers,
                num_heads=args.num_heads,
                sequence_length=T,
                seed=args.seed + 1,
            ),
            window_size=W,
            window_gamma=args.window_gamma,
        )
        s_tokens = P.train(
            scratch,
            ids,
            steps=args.teacher_steps,
            sequence_length=T,
            batch_size=args.batch_size,
            learning_rate=args.teacher_lr,
            seed=args.seed,
        )
        row("control: the same linear model trained from scratch (teacher's tokens)", bpc(scratch), tokens=s_tokens)
    log("done")
    return res


_TEACHER_SETTINGS = (
    "family",
    "sequence_length",
    "hidden_dim",
    "num_layers",
    "num_heads",
    "teacher_steps",
    "batch_size",
    "teacher_lr",
    "max_chars",
    "seed",
)


def _reusable_teacher(args, results_path):
    """The previous results of `results_path` if they trained this teacher and its preset exists, else None."""
    try:
        with open(results_path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return None
    config = previous.get("config", {})
    same = all(config.get(k) == getattr(args, k) for k in _TEACHER_SETTINGS) and config.get("teacher") is None
    preset = previous.get("teacher_preset")
    if not same or not preset or not os.path.isdir(preset) or not previous.get("teacher_tokens"):
        print(f"--reuse-teacher: no reusable teacher in {results_path}; training one", flush=True)
        return None
    return previous


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()
