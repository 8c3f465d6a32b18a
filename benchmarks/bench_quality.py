"""Quality of every attention choice: MQAR recall and a character LM, same model, same budget.

    python -m benchmarks.bench_quality                       # MQAR default table (about an hour, 2 CPU cores)
    python -m benchmarks.bench_quality --quick               # CI smoke run (about a minute, mostly XLA compilation)
    python -m benchmarks.bench_quality --contenders all      # + the mechanism rows (decay, conv, window)
    python -m benchmarks.bench_quality --task lm             # bits/char on the stdlib's source
    python -m benchmarks.bench_quality --resume              # continue an interrupted run

Model family (`benchmarks.quality_models`): token embedding + learned
positions, 2 pre-LN blocks (causal self-attention + gelu MLP of width 4E),
final LayerNorm, logits over the vocabulary. Only the attention changes
between contenders (`quality_models.CONTENDERS`, `MECHANISM_CONTENDERS`).
Every run: AdamW (weight decay 0.01, clipnorm 1.0), linear warm-up over the
first 10% of steps then cosine decay, XLA (``jit_compile=True``), float32.

MQAR (`examples.recall.mqar`, Zoology's generator: power_a 0.01, random
filler): settings are ``T:P:E`` (sequence length, key-value pairs, width);
the vocabulary is ``V = 2T`` (128, 256, 512: the key and the value halves
each have T tokens, so ``V > T`` as Zoology requires). Training examples are
one fixed seeded set (seed 10_000 + run seed), the test set another (seed 1):
disjoint draws of the same distribution. Loss and accuracy count query
positions only. Each contender x setting runs every learning rate x seed;
the reported learning rate is the one with the best mean test accuracy over
seeds (Zoology reports the best swept rate); the cell is that mean and its
min..max over seeds.

Default budget: 12 contenders x 3 rates (logspace(-3, -2, 3)) x 2 seeds = 72
runs of 800 steps, batch 32, 10k training / 1k test examples, on ONE
setting, T=64, P=4, E=64, 1 head. On the shared 2-core CPU where the
table in ``results/quality_mqar.md`` was made, a run took 40-90 s (favor_trig
about 150 s; the first 80-step interval, which includes XLA compilation,
took ~20 s against ~5 s for the later ones): 63 s on average over the first
33 runs, so the default table takes about an hour and a quarter there. Each
further setting is another 72 runs (and longer sequences cost more per
step), which is why the default is one setting and the issue's
whole grid (T in 64, 128, 256 with T/16 pairs, widths 64 and 128) is opt-in:
``--settings full`` (several hours on a 2-core CPU).
800 steps is short for MQAR: at the issue's calibration budget (3,000 steps
of batch 64, lr 1e-3: ``--settings 64:4:64 --contenders softmax,elu --lrs
1e-3 --seeds 0 --steps 3000 --batch-size 64 --num-train 100000``) softmax
leaves the "guess one of the P values" plateau (accuracy ~1/P) only after
about 1,600 steps. Longer runs: ``--steps N``.

LM: the Python standard library's source (`examples.char_lm.data`), 128
most frequent characters, windows of 128, width 128, 4 heads, 2 blocks,
batch 16, 1,200 steps, one learning rate (3e-3) by default; bits per
character of training (mean over each evaluation interval) and of 20
validation batches every 100 steps.

Outputs (``--out-dir``, default ``benchmarks/results``): ``quality_mqar``
/ ``quality_lm`` ``.json`` (every run: config, curves, wall time; the
aggregated table; the exact command), ``.md`` (tables) and ``.png``. The
cache of finished runs is ``<prefix>_runs.json``; ``--resume`` reuses runs
whose configuration matches, so an interrupted run continues where it stopped.
"""

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import quality_models as qm  # noqa: E402
from examples.common import format_table, warmup_cosine_schedule  # noqa: E402
from examples.recall import mqar  # noqa: E402
from keras_linattn import _atomic  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: The default table: one setting (see the module docstring for why).
DEFAULT_SETTINGS = ((64, 4, 64),)
#: The issue's whole grid: T in (64, 128, 256) with P = T/16 pairs, at widths 64 and 128 (``--settings full``).
FULL_SETTINGS = ((64, 4, 64), (128, 8, 64), (256, 16, 64), (64, 4, 128), (128, 8, 128), (256, 16, 128))
#: Training steps per run, the same for every contender and setting.
DEFAULT_STEPS = 800
DEFAULT_LRS = tuple(float(f"{x:.3g}") for x in np.logspace(-3.0, -2.0, 3))  # 1e-3, 3.16e-3, 1e-2
DEFAULT_SEEDS = (0, 1)
TEST_SEED = 1
TRAIN_SEED_OFFSET = 10_000

QUICK = dict(
    settings=((16, 2, 32),),
    steps=150,
    batch_size=32,
    num_train=2000,
    num_test=256,
    lrs=(3e-3,),
    seeds=(0,),
    eval_every=50,
    vocabulary=16,
    contenders=("softmax", "elu"),
)


# --------------------------------------------------------------- configuration
def parse_settings(text):
    """``"64:4:64,128:8:64"`` -> ``((64, 4, 64), (128, 8, 64))`` (T:P:E)."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"A setting is T:P:E (three integers). Received: {item!r}")
        t, p, e = (int(p) for p in parts)
        mqar.check_config(t, p, 2 * t)
        out.append((t, p, e))
    return tuple(out)


def parse_contenders(text):
    """Names from ``--contenders``: a comma list, ``default``, ``mechanisms`` or ``all``."""
    groups = {"default": [n for n, _ in qm.CONTENDERS], "mechanisms": [n for n, _ in qm.MECHANISM_CONTENDERS]}
    groups["all"] = groups["default"] + groups["mechanisms"]
    names = []
    for item in text.split(","):
        item = item.strip()
        names += groups.get(item, [item])
    return qm.resolve(list(dict.fromkeys(names)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_quality",
        description="MQAR recall and character-LM bits/char of softmax and every LinearAttention variant, "
        "one model family, one training budget.",
    )
    p.add_argument("--task", choices=["mqar", "lm"], default="mqar")
    p.add_argument(
        "--contenders",
        default="default",
        help="comma list of names, or 'default' (softmax + every feature map), 'mechanisms', 'all'. "
        f"Known: {', '.join(qm.ALL_CONTENDERS)}",
    )
    p.add_argument(
        "--settings",
        default=None,
        help="MQAR: comma list of T:P:E, or 'full' (%s); default %s"
        % tuple(",".join(":".join(map(str, s)) for s in group) for group in (FULL_SETTINGS, DEFAULT_SETTINGS)),
    )
    p.add_argument("--vocabulary", type=int, default=None, help="MQAR vocabulary (default 2T per setting)")
    p.add_argument(
        "--steps", type=int, default=None, help=f"training steps per run (MQAR default {DEFAULT_STEPS}; LM 1200)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="(MQAR default 32, LM 16)")
    p.add_argument(
        "--lrs",
        default=None,
        help="comma list of AdamW learning rates (MQAR default %s; LM 3e-3)" % ",".join(f"{x:g}" for x in DEFAULT_LRS),
    )
    p.add_argument("--seeds", default=None, help="comma list of seeds (default 0,1 for MQAR, 0 for LM)")
    p.add_argument("--num-train", type=int, default=10_000, help="MQAR training examples")
    p.add_argument("--num-test", type=int, default=1000, help="MQAR held-out test examples")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default steps/10)")
    p.add_argument("--num-heads", type=int, default=None, help="(MQAR default 1, LM 4)")
    p.add_argument("--lm-width", type=int, default=128)
    p.add_argument("--lm-sequence-length", type=int, default=128)
    p.add_argument("--lm-max-chars", type=int, default=1_000_000)
    p.add_argument("--lm-validation-steps", type=int, default=20)
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke run: tiny MQAR (T=16, 2 pairs, V=16), softmax and elu, 150 steps, one rate and seed",
    )
    p.add_argument("--resume", action="store_true", help="reuse finished runs from <out-dir>/<prefix>_runs.json")
    p.add_argument(
        "--from-cache",
        action="store_true",
        help="train nothing: write the tables from the finished runs in the cache (MQAR); cells with "
        "missing runs say how many of their runs exist",
    )
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--prefix", default=None, help="output file prefix (default quality_<task>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--no-jit",
        action="store_true",
        help="train without XLA (graph mode): quicker to start for tiny smoke runs; the published tables use XLA",
    )
    args = p.parse_args(argv)
    args.command = "python -m benchmarks.bench_quality" + "".join(" " + shlex.quote(a) for a in (argv or sys.argv[1:]))
    lm = args.task == "lm"
    if args.quick:
        if lm:
            p.error("--quick is an MQAR smoke run; it does not combine with --task lm")
        q = QUICK
        args.settings = args.settings or ",".join(":".join(map(str, s)) for s in q["settings"])
        args.steps = args.steps or q["steps"]
        args.batch_size = args.batch_size or q["batch_size"]
        args.num_train, args.num_test = q["num_train"], q["num_test"]
        args.lrs = args.lrs or ",".join(map(str, q["lrs"]))
        args.seeds = args.seeds or ",".join(map(str, q["seeds"]))
        args.eval_every = args.eval_every or q["eval_every"]
        args.vocabulary = args.vocabulary or q["vocabulary"]
        if args.contenders == "default":
            args.contenders = ",".join(q["contenders"])
    if args.from_cache and lm:
        p.error("--from-cache renders MQAR tables; the LM task has no partial table")
    args.contender_list = parse_contenders(args.contenders)
    args.settings = (
        DEFAULT_SETTINGS
        if args.settings is None
        else FULL_SETTINGS
        if args.settings == "full"
        else parse_settings(args.settings)
    )
    default_lrs = ",".join(map(str, (3e-3,) if lm else DEFAULT_LRS))
    args.lr_list = tuple(float(x) for x in (args.lrs or default_lrs).split(","))
    args.seed_list = tuple(int(x) for x in (args.seeds or ("0" if lm else "0,1")).split(","))
    args.batch_size = args.batch_size or (16 if lm else 32)
    args.num_heads = args.num_heads or (4 if lm else 1)
    args.prefix = args.prefix or f"quality_{args.task}"
    for name, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--eval-every", args.eval_every)):
        if value is not None and value < 1:
            p.error(f"{name} must be positive. Received: {value}")
    return args


def steps_for(args, sequence_length):
    if args.steps:
        return args.steps
    if args.task == "lm":
        return 1200
    return DEFAULT_STEPS


# ------------------------------------------------------------------- training
def log_line(*parts):
    """Progress line, flushed at once (long runs are watched through pipes and files)."""
    print(*parts, flush=True)


def compile_model(model, steps, lr, weighted, jit_compile=True):
    model.compile(
        optimizer=keras.optimizers.AdamW(warmup_cosine_schedule(steps, lr), weight_decay=0.01, clipnorm=1.0),
        # Masked MQAR positions carry weight 0; the loss is the mean over query positions.
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight" if weighted else "sum_over_batch_size"
        ),
        weighted_metrics=["accuracy"] if weighted else None,
        metrics=None if weighted else ["accuracy"],
        jit_compile=jit_compile,
    )


def _mqar_dataset(inputs, labels, batch_size, shuffle_seed=None):
    weights = (labels != mqar.IGNORE).astype("float32")  # [N, T]: 1 at query positions
    targets = np.maximum(labels, 0)  # masked positions: any class, weight 0
    ds = tf.data.Dataset.from_tensor_slices((inputs, targets, weights))
    if shuffle_seed is not None:
        ds = ds.shuffle(len(inputs), seed=shuffle_seed, reshuffle_each_iteration=True).repeat()
    return ds.batch(batch_size, drop_remainder=shuffle_seed is not None).prefetch(tf.data.AUTOTUNE)


def _fit(model, train_ds, val_ds, steps, eval_every, log_prefix, log):
    eval_every = min(eval_every, steps)
    epochs = max(1, steps // eval_every)
    curve, start = [], time.perf_counter()

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs = {k: float(v) for k, v in (logs or {}).items()}
            point = {"step": (epoch + 1) * eval_every, "seconds": time.perf_counter() - start, **logs}
            curve.append(point)
            log(
                f"{log_prefix} step {point['step']:>5}  loss {logs.get('loss', float('nan')):.3f}  "
                f"val_loss {logs.get('val_loss', float('nan')):.3f}  "
                f"val_acc {logs.get('val_accuracy', float('nan')):.3f}"
                f"  {point['seconds']:.0f}s"
            )

    model.fit(
        train_ds,
        epochs=epochs,
        steps_per_epoch=eval_every,
        validation_data=val_ds,
        verbose=0,
        callbacks=[Progress()],
        shuffle=False,
    )  # the datasets shuffle themselves
    return curve, time.perf_counter() - start


def run_mqar(contender, setting, lr, seed, args, data, log=log_line):
    """One MQAR training run; returns its record (final test accuracy, curves, wall time)."""
    name, kwargs = contender
    t, p, e = setting
    v = args.vocabulary or 2 * t
    steps = steps_for(args, t)
    keras.utils.clear_session()
    keras.utils.set_random_seed(seed)
    model = qm.build_model(kwargs, v, t, e, num_heads=args.num_heads, seed=seed)
    compile_model(model, steps, lr, weighted=True, jit_compile=not getattr(args, "no_jit", False))
    (x_tr, y_tr), (x_te, y_te) = data
    train_ds = _mqar_dataset(x_tr, y_tr, args.batch_size, shuffle_seed=seed)
    test_ds = _mqar_dataset(x_te, y_te, 250)
    curve, seconds = _fit(
        model,
        train_ds,
        test_ds,
        steps,
        args.eval_every or max(1, steps // 10),
        f"[mqar {name} T={t} P={p} E={e} lr={lr:g} seed={seed}]",
        log,
    )
    return {"accuracy": curve[-1]["val_accuracy"], "curve": curve, "wall_s": seconds, "params": model.count_params()}


def run_lm(contender, lr, seed, args, data, log=log_line):
    """One character-LM run; returns its record (bits/char curves, end points, wall time)."""
    name, kwargs = contender
    train_ids, val_ids, vocab_size = data
    from examples.char_lm import data as lm_data

    keras.utils.clear_session()
    keras.utils.set_random_seed(seed)
    t, steps = args.lm_sequence_length, steps_for(args, args.lm_sequence_length)
    model = qm.build_model(kwargs, vocab_size, t, args.lm_width, num_heads=args.num_heads, seed=seed)
    compile_model(model, steps, lr, weighted=False, jit_compile=not getattr(args, "no_jit", False))
    train_ds = lm_data.windows(train_ids, t, args.batch_size, shuffle=True, seed=seed).repeat()
    val_ds = lm_data.windows(val_ids, t, args.batch_size).take(args.lm_validation_steps)
    curve, seconds = _fit(
        model, train_ds, val_ds, steps, args.eval_every or 100, f"[lm {name} lr={lr:g} seed={seed}]", log
    )
    for point in curve:
        point["train_bits_per_char"] = point["loss"] / math.log(2)
        point["val_bits_per_char"] = point["val_loss"] / math.log(2)
    return {
        "train_bits_per_char": curve[-1]["train_bits_per_char"],
        "val_bits_per_char": curve[-1]["val_bits_per_char"],
        "curve": curve,
        "wall_s": seconds,
        "params": model.count_params(),
    }


# ---------------------------------------------------------------- bookkeeping
def run_key(task, name, kwargs, setting, lr, seed, budget):
    return json.dumps(
        {"task": task, "contender": name, "kwargs": kwargs, "setting": list(setting), "lr": lr, "seed": seed, **budget},
        sort_keys=True,
    )


class RunCache:
    """Finished runs by configuration key, saved atomically after each run."""

    def __init__(self, path, resume):
        self.path = path
        self.runs = {}
        if resume and os.path.exists(path):
            with open(path) as f:
                self.runs = json.load(f)

    def get(self, key):
        return self.runs.get(key)

    def put(self, key, record):
        self.runs[key] = record
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        _atomic.write_bytes_atomic(self.path, json.dumps(self.runs, indent=0).encode())


def aggregate(runs, metric, higher_is_better=True):
    """``runs``: records of one contender x setting. Best rate by mean over seeds; mean, min, max, std there."""
    by_lr = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    sign = 1 if higher_is_better else -1
    means = {lr: statistics.fmean(r[metric] for r in rs) for lr, rs in by_lr.items()}
    best = max(means, key=lambda lr: sign * means[lr])
    vals = [r[metric] for r in by_lr[best]]
    return {
        "best_lr": best,
        "mean": means[best],
        "min": min(vals),
        "max": max(vals),
        "std": statistics.pstdev(vals),
        "seeds": len(vals),
        "per_lr": {f"{lr:g}": means[lr] for lr in sorted(means)},
        "wall_s_mean": statistics.fmean(r["wall_s"] for rs in by_lr.values() for r in rs),
    }


def environment():
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
    }


# ------------------------------------------------------------------------ main
def benchmark_mqar(args, log=log_line):
    qm.check_supported(args.contender_list, width=args.settings[0][2], num_heads=args.num_heads)
    cache = RunCache(os.path.join(args.out_dir, args.prefix + "_runs.json"), args.resume or args.from_cache)
    total = len(args.contender_list) * len(args.settings) * len(args.lr_list) * len(args.seed_list)
    done, records, started = 0, [], time.perf_counter()
    for setting in args.settings:
        t, p, e = setting
        v = args.vocabulary or 2 * t
        train = {s: None for s in args.seed_list}
        test = mqar.generate(args.num_test, t, p, v, seed=TEST_SEED)
        budget = {
            "steps": steps_for(args, t),
            "batch_size": args.batch_size,
            "num_train": args.num_train,
            "num_test": args.num_test,
            "vocabulary": v,
            "num_heads": args.num_heads,
            "eval_every": args.eval_every or max(1, steps_for(args, t) // 10),
        }
        for name, kwargs in args.contender_list:
            for lr in args.lr_list:
                for seed in args.seed_list:
                    done += 1
                    key = run_key("mqar", name, kwargs, setting, lr, seed, budget)
                    record = cache.get(key)
                    if record is None and args.from_cache:
                        log(f"[{done}/{total}] missing {name} T={t} P={p} E={e} lr={lr:g} seed={seed}")
                        continue
                    if record is None:
                        if train[seed] is None:
                            train[seed] = mqar.generate(args.num_train, t, p, v, seed=TRAIN_SEED_OFFSET + seed)
                        record = run_mqar((name, kwargs), setting, lr, seed, args, (train[seed], test), log)
                        record.update(
                            contender=name, kwargs=kwargs, setting=list(setting), lr=lr, seed=seed, budget=budget
                        )
                        cache.put(key, record)
                        state = "ran"
                    else:
                        state = "cached"
                    records.append(record)
                    log(
                        f"[{done}/{total}] {state} {name} T={t} P={p} E={e} lr={lr:g} seed={seed}: "
                        f"acc {record['accuracy']:.3f} ({record['wall_s']:.0f}s; {time.perf_counter() - started:.0f}s "
                        "elapsed)"
                    )
    table = []
    for setting in args.settings:
        for name, kwargs in args.contender_list:
            rs = [r for r in records if r["contender"] == name and tuple(r["setting"]) == setting]
            if not rs:
                continue
            t, p, e = setting
            table.append(
                {
                    "contender": name,
                    "setting": list(setting),
                    "chance": mqar.chance_accuracy(p, args.vocabulary or 2 * t),
                    "state_floats_per_layer": qm.state_floats(kwargs, e, args.num_heads, t),
                    "runs": len(rs),
                    "planned_runs": len(args.lr_list) * len(args.seed_list),
                    **aggregate(rs, "accuracy"),
                }
            )
    return {
        "task": "mqar",
        "command": args.command,
        "environment": environment(),
        "config": {
            "settings": [list(s) for s in args.settings],
            "lrs": list(args.lr_list),
            "seeds": list(args.seed_list),
            "batch_size": args.batch_size,
            "num_train": args.num_train,
            "num_test": args.num_test,
            "num_heads": args.num_heads,
            "vocabulary": args.vocabulary,
            "steps": {str(s[0]): steps_for(args, s[0]) for s in args.settings},
            "contenders": {n: k for n, k in args.contender_list},
        },
        "table": table,
        "runs": records,
        "total_wall_s": time.perf_counter() - started,
    }


def benchmark_lm(args, log=log_line):
    from examples.char_lm import data as lm_data

    qm.check_supported(args.contender_list, width=args.lm_width, num_heads=args.num_heads)
    text = lm_data.load_stdlib_corpus(max_chars=args.lm_max_chars)
    vocab = lm_data.CharVocabulary.from_text(text, max_size=128)
    train_ids, val_ids = lm_data.split_ids(vocab.encode(text))
    cache = RunCache(os.path.join(args.out_dir, args.prefix + "_runs.json"), args.resume)
    budget = {
        "steps": steps_for(args, args.lm_sequence_length),
        "batch_size": args.batch_size,
        "width": args.lm_width,
        "sequence_length": args.lm_sequence_length,
        "num_heads": args.num_heads,
        "max_chars": args.lm_max_chars,
        "validation_steps": args.lm_validation_steps,
        "eval_every": args.eval_every or 100,
    }
    total = len(args.contender_list) * len(args.lr_list) * len(args.seed_list)
    done, records, started = 0, [], time.perf_counter()
    for name, kwargs in args.contender_list:
        for lr in args.lr_list:
            for seed in args.seed_list:
                done += 1
                key = run_key("lm", name, kwargs, (), lr, seed, budget)
                record = cache.get(key)
                state = "cached"
                if record is None:
                    record = run_lm((name, kwargs), lr, seed, args, (train_ids, val_ids, vocab.size), log)
                    record.update(contender=name, kwargs=kwargs, lr=lr, seed=seed, budget=budget)
                    cache.put(key, record)
                    state = "ran"
                records.append(record)
                log(
                    f"[{done}/{total}] {state} lm {name} lr={lr:g} seed={seed}: val bits/char "
                    f"{record['val_bits_per_char']:.3f} ({record['wall_s']:.0f}s)"
                )
    table = []
    for name, kwargs in args.contender_list:
        rs = [r for r in records if r["contender"] == name]
        row = aggregate(rs, "val_bits_per_char", higher_is_better=False)
        best = [r for r in rs if r["lr"] == row["best_lr"]]
        row["train_bits_per_char"] = statistics.fmean(r["train_bits_per_char"] for r in best)
        table.append(
            {
                "contender": name,
                "state_floats_per_layer": qm.state_floats(
                    kwargs, args.lm_width, args.num_heads, args.lm_sequence_length
                ),
                **row,
            }
        )
    return {
        "task": "lm",
        "command": args.command,
        "environment": environment(),
        "config": {
            **budget,
            "lrs": list(args.lr_list),
            "seeds": list(args.seed_list),
            "vocabulary": vocab.size,
            "corpus_chars": len(text),
            "contenders": {n: k for n, k in args.contender_list},
        },
        "table": table,
        "runs": records,
        "total_wall_s": time.perf_counter() - started,
    }


def _setting_label(s):
    return f"T={s[0]} P={s[1]} E={s[2]}"


def render_markdown(results):
    cfg = results["config"]
    lines = [
        f"# {'MQAR recall' if results['task'] == 'mqar' else 'Character LM'}: quality per attention choice",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Environment: {json.dumps(results['environment'])}; wall time of this invocation "
        f"{results['total_wall_s']:.0f} s (cached runs excluded); sum of the wall times of the runs in the "
        f"tables {sum(r['wall_s'] for r in results['runs']):.0f} s over {len(results['runs'])} runs.",
        "",
    ]
    if results["task"] == "mqar":
        settings = [tuple(s) for s in cfg["settings"]]
        lines += [
            f"Budget per run: steps {cfg['steps']} (by T; same for every contender), "
            f"batch {cfg['batch_size']}, {cfg['num_train']} "
            f"training / {cfg['num_test']} test examples, {cfg['num_heads']} head(s), AdamW + warm-up/cosine, "
            f"rates {cfg['lrs']}, seeds {cfg['seeds']}. Vocabulary {cfg['vocabulary'] or '2T'}. "
            "Accuracy on query positions of the "
            "held-out set after the last step.",
            "",
            "### Test accuracy at the best rate: mean (min..max over seeds)",
            "",
        ]
        cell = {(r["contender"], tuple(r["setting"])): r for r in results["table"]}
        names = list(dict.fromkeys(r["contender"] for r in results["table"]))

        def acc(c):
            text = f"{c['mean']:.3f} ({c['min']:.3f}..{c['max']:.3f})"
            if c.get("runs", 0) < c.get("planned_runs", 0):
                text += f" [only {c['runs']} of {c['planned_runs']} runs]"
            return text

        rows = [[n] + [acc(cell[n, s]) if (n, s) in cell else "not run" for s in settings] for n in names]
        rows.append(
            ["chance: 1/#values ; 1/P"]
            + [
                f"{cell[names[0], s]['chance']['uniform_value']:.3f} ; "
                f"{cell[names[0], s]['chance']['in_context_value']:.3f}"
                for s in settings
            ]
        )
        lines += [
            format_table(["contender"] + [_setting_label(s) for s in settings], rows),
            "",
            "### Best learning rate (mean accuracy per rate)",
            "",
        ]
        rows = [
            [n]
            + [
                f"{cell[n, s]['best_lr']:g} ("
                + ", ".join(f"{lr}: {a:.3f}" for lr, a in cell[n, s]["per_lr"].items())
                + ")"
                if (n, s) in cell
                else "not run"
                for s in settings
            ]
            for n in names
        ]
        lines += [
            format_table(["contender"] + [_setting_label(s) for s in settings], rows),
            "",
            "### Wall time per run (s, mean over rates and seeds) and decode state per layer (floats)",
            "",
        ]
        rows = [
            [n]
            + [
                f"{cell[n, s]['wall_s_mean']:.0f} s / {cell[n, s]['state_floats_per_layer']}"
                if (n, s) in cell
                else "not run"
                for s in settings
            ]
            for n in names
        ]
        lines += [
            format_table(["contender"] + [_setting_label(s) for s in settings], rows),
            "",
            "Softmax's state is its key/value cache at length T (it grows with T); linear attention's "
            "is S and z (fixed).",
            "",
        ]
    else:
        lines += [
            f"Budget per run: {cfg['steps']} steps, batch {cfg['batch_size']}, windows of "
            f"{cfg['sequence_length']} characters, width {cfg['width']}, {cfg['num_heads']} heads, 2 blocks, "
            f"vocabulary {cfg['vocabulary']}, {cfg['corpus_chars']:,} characters of stdlib source "
            f"(5% held out), rates {cfg['lrs']}, seeds {cfg['seeds']}.",
            "",
            "### Bits per character after the last step (best rate)",
            "",
        ]
        rows = [
            [
                r["contender"],
                f"{r['mean']:.3f} ({r['min']:.3f}..{r['max']:.3f})",
                f"{r['train_bits_per_char']:.3f}",
                f"{r['best_lr']:g}",
                f"{r['wall_s_mean']:.0f}",
                r["state_floats_per_layer"],
            ]
            for r in results["table"]
        ]
        lines += [
            format_table(
                ["contender", "val bits/char (min..max)", "train bits/char", "lr", "wall s/run", "state floats/layer"],
                rows,
            ),
            "",
            "### Validation bits/char vs step (best rate, first seed)",
            "",
        ]
        curves = {}
        for r in results["table"]:
            run = next(x for x in results["runs"] if x["contender"] == r["contender"] and x["lr"] == r["best_lr"])
            curves[r["contender"]] = {pt["step"]: pt["val_bits_per_char"] for pt in run["curve"]}
        steps = sorted({s for c in curves.values() for s in c})
        lines += [
            format_table(
                ["contender"] + [str(s) for s in steps],
                [[n] + [f"{c[s]:.3f}" if s in c else "" for s in steps] for n, c in curves.items()],
            ),
            "",
        ]
    return "\n".join(lines)


def write_plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results["task"] == "mqar":
        widths = sorted({r["setting"][2] for r in results["table"]})
        fig, axes = plt.subplots(1, len(widths), figsize=(6 * len(widths), 4.5), squeeze=False)
        for ax, e in zip(axes[0], widths, strict=True):
            rows = [r for r in results["table"] if r["setting"][2] == e]
            settings = sorted({tuple(r["setting"]) for r in rows})
            for name in dict.fromkeys(r["contender"] for r in rows):
                pts = sorted((tuple(r["setting"]), r) for r in rows if r["contender"] == name)
                xs = [settings.index(s) for s, _ in pts]
                ys = [r["mean"] for _, r in pts]
                err = [[r["mean"] - r["min"] for _, r in pts], [r["max"] - r["mean"] for _, r in pts]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
            ax.set_xticks(range(len(settings)), [f"T={s[0]}\nP={s[1]}" for s in settings])
            ax.set_ylim(0, 1.02)
            ax.set_ylabel("MQAR test accuracy (best lr; bars: min..max over seeds)")
            ax.set_title(f"width {e}")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="best")
    else:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
        for r in results["table"]:
            run = next(x for x in results["runs"] if x["contender"] == r["contender"] and x["lr"] == r["best_lr"])
            steps = [pt["step"] for pt in run["curve"]]
            axes[0][0].plot(steps, [pt["train_bits_per_char"] for pt in run["curve"]], label=r["contender"])
            axes[0][1].plot(steps, [pt["val_bits_per_char"] for pt in run["curve"]], label=r["contender"])
        for ax, title in zip(axes[0], ("train", "validation"), strict=True):
            ax.set_xlabel("step")
            ax.set_ylabel("bits per character")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        axes[0][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results, out_dir, prefix, plot=True):
    os.makedirs(out_dir, exist_ok=True)
    paths = {"md": os.path.join(out_dir, prefix + ".md"), "json": os.path.join(out_dir, prefix + ".json")}
    with open(paths["md"], "w") as f:
        f.write(render_markdown(results))
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1)
    if plot:
        paths["png"] = os.path.join(out_dir, prefix + ".png")
        write_plot(results, paths["png"])
    return paths


def main(argv=None):
    args = parse_args(argv)
    try:
        results = benchmark_lm(args) if args.task == "lm" else benchmark_mqar(args)
    except qm.UnsupportedContender as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(results, args.out_dir, args.prefix, plot=not args.no_plot)
    print(render_markdown(results))
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
