"""`make demo`: the package end to end in a few minutes on a CPU.

1. trains a small causal character LM whose linear attention has a short
   causal convolution and a data-dependent decay gate (elu + 1 features,
   ``conv_size=4, decay="scalar"``), with `model.fit(jit_compile=True)` (XLA; Keras' default
   "auto" does not enable XLA on a CPU-only TensorFlow), on the Python
   standard library's own source (local data, nothing is downloaded);
2. generates a sample with the recurrent path (prefill + constant-cost steps);
3. exports the model as a SavedModel laid out for TF Serving and as ONNX,
   and verifies both against Keras (outputs and greedy decoding);
4. prints a summary of what it produced and where.

Run: ``python -m examples.demo --help`` for the knobs (defaults fit in about
five minutes on a 2-core CPU). With ``--backup-dir DIR`` the training state is
backed up after every epoch; rerunning the same command after a crash resumes
from the last backup.
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from examples._native_log import filter_native_noise  # noqa: E402

if __name__ == "__main__":
    filter_native_noise()  # before TensorFlow is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402

from examples.char_lm import data  # noqa: E402
from keras_linattn import export, models, samplers  # noqa: E402
from keras_linattn.callbacks import BackupAndRestore  # noqa: E402


def compile_lm(model):
    """AdamW, cross-entropy on logits, XLA; one accuracy metric (`LinearCausalLM.compile` adds its own
    weighted accuracy: passing `metrics=["accuracy"]` too printed two on every epoch line)."""
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=3e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=True,
    )


def build_parser():
    parser = argparse.ArgumentParser(
        description="Train, sample, export and verify a small linear-attention LM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="out/demo", help="directory for the model and exports")
    parser.add_argument("--steps", type=int, default=600, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--feature-map", default="elu", help="attention feature map")
    parser.add_argument(
        "--conv-size",
        type=int,
        default=4,
        help="short causal convolution on q/k/v (LinearAttention's conv_size); 0 for none",
    )
    parser.add_argument(
        "--decay",
        default="scalar",
        choices=("none", "fixed", "scalar", "channel"),
        help="decay gate of the attention state (LinearAttention's decay)",
    )
    parser.add_argument(
        "--window-size", type=int, default=0, help="sliding softmax window (LinearAttention's window_size); 0 for none"
    )
    parser.add_argument("--max-chars", type=int, default=600_000, help="characters of corpus used")
    parser.add_argument("--generate-length", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backup-dir",
        default=None,
        help="back up training after every epoch; rerun the same command after a crash to resume",
    )
    return parser


def _banner(text):
    print(f"\n=== {text} ===", flush=True)


def main(argv=None):
    args = build_parser().parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()

    _banner("1/4 data: Python standard library source (local)")
    corpus = data.load_stdlib_corpus(max_chars=args.max_chars)
    vocab = data.CharVocabulary.from_text(corpus, max_size=128)
    ids = vocab.encode(corpus)
    train_ids, val_ids = data.split_ids(ids, validation_fraction=0.05)
    train = data.windows(train_ids, args.sequence_length, args.batch_size, shuffle=True, seed=args.seed)
    val = data.windows(val_ids, args.sequence_length, args.batch_size)
    print(f"{len(corpus):,} characters, vocabulary {vocab.size}, {len(train_ids):,} training ids")

    mechanisms = dict(
        conv_size=args.conv_size or None,
        decay=None if args.decay == "none" else args.decay,
        window_size=args.window_size or None,
    )
    described = ", ".join(f"{k}={v}" for k, v in mechanisms.items() if v is not None) or "no recall mechanism"
    _banner(f"2/4 train: LinearCausalLM, feature map {args.feature_map!r}, {described}, jit_compile=True (XLA)")
    model = models.LinearCausalLM(
        vocabulary_size=vocab.size,
        num_layers=2,
        hidden_dim=128,
        num_heads=4,
        intermediate_dim=256,
        feature_map=args.feature_map,
        chunk_size=64,
        **mechanisms,
    )
    compile_lm(model)
    steps_per_epoch = max(1, min(100, args.steps))
    epochs = max(1, args.steps // steps_per_epoch)
    stream, callbacks = train.repeat(), []
    if args.backup_dir:
        model(np.zeros((1, args.sequence_length), "int32"))  # built: the backup restores into the weights
        backup = BackupAndRestore(args.backup_dir)
        if backup.initial_epoch:
            print(f"resuming from {args.backup_dir} at epoch {backup.initial_epoch}")
        # one fixed-seed stream: skip the batches of the epochs the backup holds
        stream = stream.skip(backup.initial_epoch * steps_per_epoch)
        callbacks.append(backup)
    t0 = time.time()
    history = model.fit(
        stream,
        steps_per_epoch=steps_per_epoch,
        epochs=epochs,
        callbacks=callbacks,
        validation_data=val,
        validation_steps=5,
        verbose=2 if os.environ.get("CI") else 1,
        shuffle=False,  # `train` is a tf.data pipeline that shuffles itself
    )
    train_s = time.time() - t0
    val_loss = history.history.get("val_loss", [float("nan")])[-1]  # NaN: the backup was complete
    print(
        f"trained {epochs * steps_per_epoch} steps in {train_s:.0f} s; "
        f"validation loss {val_loss:.3f} nats/char ({val_loss / np.log(2):.2f} bits/char), "
        f"accuracy {history.history.get('val_accuracy', [float('nan')])[-1]:.3f}"
    )
    model_path = os.path.join(args.out, "char_lm.keras")
    model.save(model_path)

    _banner("3/4 generate: parallel prefill, then recurrent steps (state size independent of length)")
    prompt = "def "
    prompt_ids = vocab.encode(prompt)[None, :]
    t0 = time.time()
    tokens = model.generate(
        prompt_ids,
        max_length=len(prompt) + args.generate_length,
        sampler=samplers.get("top_k", k=10, temperature=0.8),
        seed=args.seed,
        verbose=True,
    )
    gen_s = time.time() - t0
    sample = vocab.decode(tokens[0])
    print("-" * 60 + "\n" + sample + "\n" + "-" * 60)

    _banner("4/4 export: SavedModel (TF Serving layout) + ONNX, verified against Keras")
    serving_dir = os.path.join(args.out, "serving", "char_lm")
    version_dir = export.export_saved_model(model, serving_dir)
    onnx_path = os.path.join(args.out, "onnx", "char_lm.onnx")
    onnx_paths = export.export_onnx(model, onnx_path)
    print("verifying both exports against Keras (outputs, step, greedy generate)...", flush=True)
    report = export.verify(
        model,
        saved_model_dir=version_dir,
        onnx_path=onnx_paths["model"],
        onnx_step_path=onnx_paths.get("step"),
        raise_on_failure=False,
    )
    print(report.table())

    _banner("summary")
    rows = [
        (
            "training",
            f"{epochs * steps_per_epoch} steps, XLA, {train_s:.0f} s, val {val_loss / np.log(2):.2f} bits/char",
        ),
        ("sample", f"{args.generate_length} chars in {gen_s:.1f} s (incl. compilation)"),
        ("Keras model", model_path),
        ("SavedModel", f"{version_dir} (serve: see export/README.md)"),
        ("ONNX", ", ".join(str(p) for p in onnx_paths.values())),
        ("verification", "passed" if report.ok else "FAILED"),
        ("total time", f"{time.time() - t_start:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
