"""Train a character-level `LinearCausalLM` on local text, then sample from it.

Default corpus: the Python standard library's source (always on disk, so it
runs offline); ``--corpus tiny_shakespeare`` uses TFDS when that dataset has
been prepared locally. Training uses the chunkwise-parallel causal path;
`generate()` prefills the prompt in parallel and then decodes one character
at a time with a fixed-size state.

    python -m examples.char_lm.train                       # CPU-sized defaults
    python -m examples.char_lm.train --steps 5000 --num-layers 4 --hidden-dim 256 \\
        --num-heads 4 --intermediate-dim 1024 --sequence-length 512 --batch-size 64   # GPU

Resumable: ``--backup-dir DIR`` backs the training state up after every
evaluation epoch (``--backup-every N``: every N steps); rerunning the same
command after a crash continues from the last backup and ends with the
weights an uninterrupted run ends with.

XLA: ``jit_compile=True`` is passed explicitly (Keras' "auto" does not enable
XLA on CPU); windows have one fixed length, so the step compiles once.
"""

import argparse
import inspect
import math
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from examples import common  # noqa: E402
from examples.char_lm import data  # noqa: E402
from keras_linattn import feature_maps, samplers  # noqa: E402
from keras_linattn.callbacks import RedrawRandomFeatures  # noqa: E402
from keras_linattn.models import LinearCausalLM  # noqa: E402


def load_corpus(args):
    if args.corpus == "stdlib":
        return data.load_stdlib_corpus(max_chars=args.max_chars)
    return data.load_tiny_shakespeare(data_dir=args.data_dir, max_chars=args.max_chars)


def make_feature_map(name, seed):
    """The feature map `name`; random maps (those taking a `seed`) are seeded with `seed`."""
    cls = type(feature_maps.get(name))
    if "seed" in inspect.signature(cls.__init__).parameters:
        return feature_maps.get(name, seed=seed)
    return feature_maps.get(name)


def build_model(args, vocabulary_size):
    model = LinearCausalLM(
        vocabulary_size=vocabulary_size,
        num_layers=args.num_layers,
        hidden_dim=args.hidden_dim,
        num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim,
        feature_map=make_feature_map(args.feature_map, args.seed),
        conv_size=None,  # the feature map alone: the figures on record (docs/examples.md) are of it
        chunk_size=args.chunk_size,
        dropout=args.dropout,
    )
    model(np.zeros((1, args.sequence_length), "int32"))  # builds the weights (a backup restores into them)
    return model


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.char_lm.train",
        description="Character-level LinearCausalLM on local text, then generate() samples.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--corpus", choices=["stdlib", "tiny_shakespeare"], default="stdlib")
    parser.add_argument("--data-dir", default=None, help="TFDS data_dir for tiny_shakespeare")
    parser.add_argument("--max-chars", type=int, default=1_000_000, help="characters of corpus to use")
    parser.add_argument("--max-vocabulary", type=int, default=128, help="most frequent characters kept")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--feature-map", default="elu", help=f"one of {feature_maps.available()}")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation evaluations")
    parser.add_argument("--validation-steps", type=int, default=20)
    parser.add_argument("--prompt", default="def ", help="generation prompt")
    parser.add_argument("--generate-length", type=int, default=200, help="characters generated after the prompt")
    parser.add_argument("--num-samples", type=int, default=2)
    parser.add_argument("--sampler", default="top_k", help=f"one of {samplers.available()}")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and random maps")
    parser.add_argument(
        "--redraw-every", type=int, default=None, help="random feature maps: redraw the projection every N steps"
    )
    parser.add_argument("--save", default=None, help="save the trained model to this .keras file")
    common.add_training_args(parser, steps=300, batch_size=16, learning_rate=3e-3)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    common.apply_dtype_policy(args)
    text = load_corpus(args)
    vocab = data.CharVocabulary.from_text(text, max_size=args.max_vocabulary)
    train_ids, val_ids = data.split_ids(vocab.encode(text))
    train_ds = data.windows(train_ids, args.sequence_length, args.batch_size, shuffle=True, seed=args.seed).repeat()
    val_ds = data.windows(val_ids, args.sequence_length, args.batch_size)
    print(f"corpus: {args.corpus}, {len(text):,} characters, vocabulary {vocab.size}")
    print(common.xla_message(args.jit_compile))

    model = build_model(args, vocab.size)
    common.compile_for_training(model, common.warmup_cosine_schedule(args.steps, args.learning_rate), args.jit_compile)
    history, timer, train_seconds = common.fit_timed(
        model,
        train_ds,
        args.steps,
        min(args.eval_every, args.steps),
        args.verbose,
        validation_data=val_ds.take(args.validation_steps),
        backup=common.make_backup(args.backup_dir, args.backup_every),
        callbacks=[RedrawRandomFeatures(args.redraw_every)] if args.redraw_every else [],
    )

    sampler = (
        samplers.get(args.sampler)
        if args.sampler == "greedy"
        else samplers.get(args.sampler, temperature=args.temperature)
    )
    prompt = np.tile(vocab.encode(args.prompt)[None], (args.num_samples, 1))  # [B, P]
    start = time.perf_counter()
    out = model.generate(prompt, max_length=prompt.shape[1] + args.generate_length, sampler=sampler, seed=args.seed)
    gen_seconds = time.perf_counter() - start
    samples = [vocab.decode(row) for row in out]
    for i, sample in enumerate(samples):
        print(f"--- sample {i} ---\n{sample}")

    def last(key):  # NaN when the backup was already complete and no epoch ran
        return history.history.get(key, [float("nan")])[-1]

    val_loss = last("val_loss")
    summary = {
        "train_loss": last("loss"),
        "val_loss": val_loss,
        "val_bits_per_char": val_loss / math.log(2),
        "val_accuracy": last("val_accuracy"),
        "train_seconds": train_seconds,
        "median_step_ms": 1000 * timer.median_step_seconds,
        "generate_seconds": gen_seconds,
        "params": model.count_params(),
    }
    print("\nsummary")
    print(
        common.format_table(
            [
                "steps",
                "params",
                "train loss",
                "val loss",
                "val bits/char",
                "val acc",
                "ms/step",
                "train s",
                "generate s",
            ],
            [
                [
                    args.steps,
                    summary["params"],
                    f"{summary['train_loss']:.3f}",
                    f"{val_loss:.3f}",
                    f"{summary['val_bits_per_char']:.3f}",
                    f"{summary['val_accuracy']:.3f}",
                    f"{summary['median_step_ms']:.1f}",
                    f"{train_seconds:.1f}",
                    f"{gen_seconds:.1f}",
                ]
            ],
        )
    )
    if args.save:
        model.save(args.save)
        print(f"saved to {args.save}")
    return model, vocab, samples, summary


if __name__ == "__main__":
    main()
