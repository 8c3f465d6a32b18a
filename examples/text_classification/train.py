"""IMDB sentiment with a linear-attention encoder classifier.

TFDS ``imdb_reviews`` must be prepared in ``--data-dir`` (pass ``--download``
on a machine with internet to let TFDS fetch it). Reviews are tokenized as
UTF-8 bytes (default) or words, padded to ``--sequence-length`` and
classified by embeddings + linear-attention encoder blocks + masked mean
pooling; padding is masked out of the attention keys and of the pooling.

    python -m examples.text_classification.train --download          # CPU-sized defaults
    python -m examples.text_classification.train --sequence-length 2048 --num-layers 4 \\
        --hidden-dim 128 --intermediate-dim 256 --steps 5000 --feature-map oglu   # GPU

XLA: ``jit_compile=True`` is passed explicitly (Keras' "auto" does not enable
XLA on CPU).
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from examples import common  # noqa: E402
from examples.text_classification.data import load_imdb  # noqa: E402
from keras_linattn import feature_maps  # noqa: E402


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.text_classification.train",
        description="IMDB reviews (TFDS) with a linear-attention encoder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data-dir", default=None, help="TFDS data_dir")
    parser.add_argument("--download", action="store_true", help="allow TFDS to download imdb_reviews")
    parser.add_argument("--tokenizer", choices=["bytes", "words"], default="bytes")
    parser.add_argument("--vocabulary-size", type=int, default=20000, help="for --tokenizer words")
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-test-examples", type=int, default=2000)
    parser.add_argument("--feature-map", default="elu", help=f"'softmax' or a feature map: {feature_maps.available()}")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    common.add_training_args(parser, steps=300, batch_size=32, learning_rate=1e-3)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    common.apply_dtype_policy(args)
    try:
        train_ds, test_ds, vocab_size = load_imdb(
            sequence_length=args.sequence_length,
            batch_size=args.batch_size,
            tokenizer=args.tokenizer,
            vocabulary_size=args.vocabulary_size,
            data_dir=args.data_dir,
            max_train_examples=args.max_train_examples,
            max_test_examples=args.max_test_examples,
            seed=args.seed,
            download=args.download,
        )
    except Exception as e:  # TFDS raises several types for a dataset that is not prepared.
        raise SystemExit(
            f"imdb_reviews could not be loaded from data_dir={args.data_dir!r} ({type(e).__name__}: {e}). "
            "Prepare it with --download on a machine with internet access."
        ) from e
    print(common.xla_message(args.jit_compile))
    feature_map = common.SOFTMAX if args.feature_map == common.SOFTMAX else common.feature_map_factory(args.feature_map)
    model = common.build_classifier_from_args(
        args, vocab_size, args.sequence_length, 2, feature_map, name="imdb_classifier"
    )
    common.compile_for_training(model, args.learning_rate, args.jit_compile)
    history, timer, seconds = common.fit_timed(
        model,
        train_ds,
        args.steps,
        min(args.eval_every, args.steps),
        args.verbose,
        backup=common.make_backup(args.backup_dir, args.backup_every),
    )
    test_loss, test_acc = model.evaluate(test_ds, verbose=args.verbose)
    summary = {
        # NaN when a complete backup was found and no epoch ran.
        "train_loss": history.history.get("loss", [float("nan")])[-1],
        "train_accuracy": history.history.get("accuracy", [float("nan")])[-1],
        "test_loss": float(test_loss),
        "test_accuracy": float(test_acc),
        "train_seconds": seconds,
        "median_step_ms": 1000 * timer.median_step_seconds,
        "params": model.count_params(),
    }
    print("\nsummary")
    print(
        common.format_table(
            ["feature map", "tokenizer", "T", "steps", "params", "train acc", "test loss", "test acc", "ms/step"],
            [
                [
                    args.feature_map,
                    args.tokenizer,
                    args.sequence_length,
                    args.steps,
                    summary["params"],
                    f"{summary['train_accuracy']:.3f}",
                    f"{test_loss:.3f}",
                    f"{test_acc:.3f}",
                    f"{summary['median_step_ms']:.1f}",
                ]
            ],
        )
    )
    return model, summary


if __name__ == "__main__":
    main()
