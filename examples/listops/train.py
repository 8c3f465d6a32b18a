"""ListOps: softmax attention vs linear attention with fixed and trainable kernels.

Trains the same small encoder classifier with each attention variant, on the
same data, steps and seeds, and prints a table of test accuracy (mean, std
and best over seeds) plus validation accuracy during training (convergence).

Variants: ``softmax`` (keras.layers.MultiHeadAttention), ``elu``, ``favor+``,
``ffn`` (softplus feedforward kernel), ``ffn-orth`` (its orthogonal version),
``glu``, ``oglu``, ``aoglu``; the trainable kernels are built with
``--units`` stacked units (``oglu-2`` = two units).

CPU scale (the defaults; about a minute per variant and seed on 2 cores):

    python -m examples.listops.train

Long Range Arena scale (GPU): lengths 500-2000, 96k training examples:

    python -m examples.listops.train --config lra --seq-len 2000 --steps 5000 \\
        --batch-size 32 --hidden-dim 128 --num-heads 4 --num-layers 4 --intermediate-dim 256 \\
        --seeds 0,1,2,3,4 --eval-every 500

XLA: ``jit_compile=True`` is passed explicitly (Keras' "auto" does not enable
XLA on CPU); every batch is padded to ``--seq-len`` so the train step
compiles once.

Resumable: with ``--backup-dir DIR`` each run (variant x seed) backs its
training state up in ``DIR/<variant>-seed<seed>/`` and, when it finishes,
writes its result to ``DIR/results/``. Rerunning the same command after a
crash skips the finished runs and resumes the interrupted one.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from examples import common  # noqa: E402
from examples.listops.listops_dataset import ListOps, ListOpsConfig  # noqa: E402
from examples.listops.tokenizer import PAD_ID, ListOpsTokenizer  # noqa: E402
from keras_linattn import (
    _atomic,  # noqa: E402
    feature_maps,  # noqa: E402
)

#: Variant name -> (registered feature-map name, constructor kwargs, name of the
#: argument taking the number of stacked units ``--units``, or None).
#: ``ffn`` is the plain feedforward kernel (Glorot init, no penalty);
#: ``ffn-orth`` its orthogonal version (orthogonal init + the
#: ``||W W^T - I||_F^2`` penalty, same factor as OGLU's default 0.01).
VARIANTS = {
    "softmax": (common.SOFTMAX, {}, None),
    "elu": ("elu", {}, None),
    "favor+": ("favor+", {"num_features": 64}, None),
    "ffn": ("ffn", {"kernel_initializer": "glorot_uniform", "orthogonal_penalty": 0.0}, "depth"),
    "ffn-orth": ("ffn", {"kernel_initializer": "orthogonal", "orthogonal_penalty": 0.01}, "depth"),
    "glu": ("glu", {}, "depth"),
    "oglu": ("oglu", {}, "depth"),
    "aoglu": ("aoglu", {}, "depth"),
}
DEFAULT_VARIANTS = "softmax,elu,favor+,ffn,ffn-orth,glu,oglu,aoglu"


def resolve_variants(names, units):
    """Expands variant names and unit counts into ``[(label, feature map or factory)]``.

    Raises:
        ValueError: for an unknown variant or a feature map that is not registered.
    """
    resolved = []
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"Unknown variant. Received: variant={name!r}. Known: {sorted(VARIANTS)}")
        fm_name, kwargs, units_arg = VARIANTS[name]
        if fm_name == common.SOFTMAX:
            resolved.append((name, common.SOFTMAX))
            continue
        if fm_name not in feature_maps.available():
            raise ValueError(
                f"Variant {name!r} needs feature map {fm_name!r}, which is not registered. "
                f"Available: {feature_maps.available()}"
            )
        if units_arg is None:
            resolved.append((name, common.feature_map_factory(fm_name, **kwargs)))
            continue
        for k in units:
            label = name if len(units) == 1 and k == 1 else f"{name}-{k}"
            resolved.append((label, common.feature_map_factory(fm_name, **kwargs, **{units_arg: k})))
    return resolved


def load_splits(args):
    """Builds (or reuses) the TFDS dataset; returns padded validation/test `tf.data` pipelines and a
    function making the (repeating, shuffled) training stream."""
    if args.config == "lra":
        config = "lra"
        args.min_length, args.max_length = 500, 2000
    else:
        config = ListOpsConfig(
            name=f"len{args.min_length}-{args.max_length}_n{args.num_train}_seed{args.data_seed}",
            min_length=args.min_length,
            max_length=args.max_length,
            num_train=args.num_train,
            num_validation=args.num_eval,
            num_test=args.num_eval,
            seed=args.data_seed,
        )
    builder = ListOps(config=config, data_dir=args.data_dir)
    builder.download_and_prepare()
    tokenizer = ListOpsTokenizer()
    seq_len = args.seq_len

    def encode(example):
        ids = tokenizer.tf_encode(example["source"])[:seq_len]  # [<=T]
        ids = tf.pad(ids, [[0, seq_len - tf.shape(ids)[0]]], constant_values=PAD_ID)  # [T]
        return tf.ensure_shape(ids, (seq_len,)), example["label"]

    def pipeline(split, training):
        ds = builder.as_dataset(split=split, shuffle_files=False).map(encode, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.cache()
        if training:
            ds = ds.shuffle(10_000, seed=args.data_seed, reshuffle_each_iteration=True).repeat()
        # drop_remainder keeps one static batch shape: one XLA compilation.
        return ds.batch(args.batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)

    # The training stream is built anew for every run: `shuffle(reshuffle_each_iteration=True)`
    # draws each new iterator's order from a generator that belongs to the dataset object,
    # so a shared stream would give the second run another order than the first, and a
    # resumed process (whose first iterator it is) another order than the uninterrupted one.
    return builder, tokenizer, lambda: pipeline("train", True), pipeline("validation", False), pipeline("test", False)


def _build(args, label, feature_map, vocabulary_size):
    return common.build_classifier_from_args(
        args, vocabulary_size, args.seq_len, 10, feature_map, name=f"listops_{label.replace('+', 'plus')}"
    )


def train_variant(args, label, feature_map, seeds, data, vocabulary_size):
    """Trains one variant once per seed; returns a list of result dicts.

    The model is compiled once per variant; for each seed a freshly
    initialized copy (built under that seed) provides the weights and the
    optimizer state is restored to its initial values, so the XLA train step
    is compiled once per variant rather than once per run.
    """
    make_train_ds, val_ds, test_ds = data
    keras.utils.clear_session()
    model = _build(args, label, feature_map, vocabulary_size)
    common.compile_for_training(model, common.warmup_cosine_schedule(args.steps, args.learning_rate), args.jit_compile)
    model.optimizer.build(model.trainable_variables)
    initial_optimizer_state = [v.numpy() for v in model.optimizer.variables]
    results = []
    for seed in seeds:
        run_name = f"{label.replace('+', 'plus')}-seed{seed}"
        done_path = os.path.join(args.backup_dir, "results", run_name + ".json") if args.backup_dir else None
        if done_path and os.path.exists(done_path):
            with open(done_path) as f:
                result = json.load(f)
            print(f"[{label} seed={seed}] finished in an earlier run: {done_path}", flush=True)
            results.append(result)
            continue
        keras.utils.set_random_seed(seed)
        fresh = _build(args, label, feature_map, vocabulary_size)
        model.set_weights(fresh.get_weights())
        for var, value in zip(model.optimizer.variables, initial_optimizer_state, strict=True):
            var.assign(value)
        backup = common.make_backup(
            os.path.join(args.backup_dir, run_name) if args.backup_dir else None, args.backup_every
        )
        history, timer, seconds = common.fit_timed(
            model, make_train_ds(), args.steps, args.eval_every, args.verbose, validation_data=val_ds, backup=backup
        )
        _, test_acc = model.evaluate(test_ds, verbose=0)
        result = {
            "variant": label,
            "seed": seed,
            "test_accuracy": float(test_acc),
            "val_accuracy": [float(a) for a in history.history["val_accuracy"]],
            "train_loss": [float(x) for x in history.history["loss"]],
            "seconds": seconds,
            "median_step_ms": 1000 * timer.median_step_seconds,
            "params": int(model.count_params()),
        }
        print(
            f"[{label} seed={seed}] test_acc={test_acc:.4f} "
            f"val_acc={[round(a, 3) for a in result['val_accuracy']]} "
            f"time={seconds:.1f}s step={result['median_step_ms']:.1f}ms params={result['params']}",
            flush=True,
        )
        if done_path:
            os.makedirs(os.path.dirname(done_path), exist_ok=True)
            _atomic.write_bytes_atomic(done_path, json.dumps(result))
        results.append(result)
    return results


def summarize(results, eval_every):
    """Markdown table: test accuracy (mean ± std, best) and validation accuracy during training."""
    labels = list(dict.fromkeys(r["variant"] for r in results))
    num_evals = len(results[0]["val_accuracy"])
    checkpoints = sorted({max(0, num_evals // 4 - 1), max(0, num_evals // 2 - 1)} - {num_evals - 1})
    header = ["variant", "params", "test acc mean ± std", "best"]
    header += [f"val acc @{(i + 1) * eval_every} steps (mean ± std)" for i in checkpoints]
    header += ["val acc final (mean ± std)", "ms/step"]
    rows = []
    for label in labels:
        runs = [r for r in results if r["variant"] == label]
        acc = [r["test_accuracy"] for r in runs]

        def mean_std(xs):
            std = statistics.stdev(xs) if len(xs) > 1 else 0.0
            return f"{statistics.mean(xs):.3f} ± {std:.3f}"

        row = [label, runs[0]["params"], mean_std(acc), f"{max(acc):.3f}"]
        row += [mean_std([r["val_accuracy"][i] for r in runs]) for i in checkpoints]
        row += [mean_std([r["val_accuracy"][-1] for r in runs])]
        row += [f"{statistics.median(r['median_step_ms'] for r in runs):.1f}"]
        rows.append(row)
    return common.format_table(header, rows)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.listops.train",
        description="ListOps (Long Range Arena): softmax vs linear attention feature maps, same budget.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated; known: {sorted(VARIANTS)}")
    parser.add_argument("--units", default="1", help="comma-separated numbers of stacked units of ffn/glu/oglu/aoglu")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated model seeds")
    parser.add_argument("--config", choices=["custom", "lra"], default="custom", help="'lra': LRA's 500-2000 x 96k")
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-eval", type=int, default=500, help="examples in validation and in test")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--data-dir", default=os.path.join("~", "tensorflow_datasets"))
    parser.add_argument("--seq-len", type=int, default=128, help="padded length (longer inputs are truncated)")
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--hidden-dim", type=int, default=32)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--intermediate-dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    parser.add_argument("--output", default=None, help="write all results as JSON to this file")
    common.add_training_args(parser, steps=400, batch_size=32, learning_rate=3e-3)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.data_dir = os.path.expanduser(args.data_dir)
    common.apply_dtype_policy(args)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    units = [int(u) for u in args.units.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = resolve_variants(names, units)
    builder, tokenizer, make_train_ds, val_ds, test_ds = load_splits(args)
    print(common.xla_message(args.jit_compile))
    print(f"data: {builder.info.full_name} in {args.data_dir}, padded to {args.seq_len} tokens")
    results = []
    start = time.perf_counter()
    for label, feature_map in variants:
        results += train_variant(
            args, label, feature_map, seeds, (make_train_ds, val_ds, test_ds), tokenizer.vocabulary_size
        )
    total = time.perf_counter() - start
    table = summarize(results, args.eval_every)
    print()
    print(
        f"ListOps, {len(seeds)} seeds x {args.steps} steps, batch {args.batch_size}, lengths "
        f"{args.min_length}-{args.max_length} (padded {args.seq_len}); total {total / 60:.1f} min"
    )
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "results": results, "table": table}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
