"""Softmax Transformer -> linear attention by attention distillation, end to end.

1. Train a small Transformer classifier with `keras.layers.MultiHeadAttention`
   on a synthetic task that needs sharp attention ("does the first token
   occur again?", read out at position 0).
2. Build the same architecture with `LinearAttention(feature_map=<trainable
   map>)` and copy every weight over (the query/key/value kernels are
   ``[dim, H, D]`` and the output kernel ``[H, M, dim]`` in both layers;
   the script checks every shape).
3. Report: softmax accuracy, linear accuracy before distillation, attention
   KL(softmax || linear) per layer before/after distillation, accuracy after
   distillation, and after a short fine-tune of the whole linear model
   (with, as a control, the same fine-tune without distillation). An ``elu``
   linear model with the copied weights is reported for reference.

Everything is generated locally; a CPU run takes a few minutes:

    python -m examples.distillation.run

Shape legend: B batch, T sequence length, E model width.
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

from keras_linattn import distill, feature_maps  # noqa: E402
from keras_linattn.layers import LinearAttention  # noqa: E402


def make_recall_data(n, seq_len, vocab, rng):
    """Token sequences and labels: 1 iff token 0 occurs again later (balanced).

    Tokens are 1..vocab-1. Positives get 1-2 extra copies of the first token
    at random later positions; negatives never repeat it.
    """
    x = np.zeros((n, seq_len), "int32")
    y = rng.integers(0, 2, size=n).astype("int32")
    for i in range(n):
        first = rng.integers(1, vocab)
        others = np.setdiff1d(np.arange(1, vocab), [first])
        x[i, 0] = first
        x[i, 1:] = rng.choice(others, size=seq_len - 1)
        if y[i]:
            where = rng.choice(np.arange(1, seq_len), size=rng.integers(1, 3), replace=False)
            x[i, where] = first
    return x, y


@keras.saving.register_keras_serializable(package="examples_distillation")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of the position: ``[B, T, E] -> [B, T, E]``."""

    def __init__(self, max_length, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.max_length, input_shape[-1]), initializer="glorot_uniform"
        )

    def call(self, x):
        length = ops.shape(x)[1]
        return x + ops.cast(self.embeddings[:length], x.dtype)[None]  # [B, T, E]

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


def build_classifier(attention_factory, seq_len, vocab, dim, num_layers, seed):
    """Pre-norm encoder, logits read at position 0. Layer names are fixed so
    the softmax and linear builds line up name by name."""
    init = lambda i: keras.initializers.GlorotUniform(seed=seed + i)  # noqa: E731
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab, dim, name="token_embedding")(tokens)  # [B, T, E]
    x = PositionEmbedding(seq_len, name="position_embedding")(x)  # [B, T, E]
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(name=f"norm_attention_{i}")(x)
        x = x + attention_factory(f"attention_{i}")(h, h)  # [B, T, E]
        h = keras.layers.LayerNormalization(name=f"norm_ffn_{i}")(x)
        h = keras.layers.Dense(2 * dim, activation="gelu", kernel_initializer=init(2 * i), name=f"ffn_in_{i}")(h)
        x = x + keras.layers.Dense(dim, kernel_initializer=init(2 * i + 1), name=f"ffn_out_{i}")(h)
    first = keras.layers.LayerNormalization(name="norm_out")(x)[:, 0]  # [B, E]
    logits = keras.layers.Dense(2, name="classifier")(first)  # [B, 2]
    return keras.Model(tokens, logits)


def copy_weights(source, target):
    """Copies every weight of `source` into the same-named layers of `target`.

    `MultiHeadAttention` -> `LinearAttention`: the four projections are
    copied kernel by kernel after checking their shapes; the feature map of
    the linear layer keeps its own (initial) weights.
    """
    for layer in source.layers:
        if not layer.weights:
            continue
        twin = target.get_layer(layer.name)
        if isinstance(layer, keras.layers.MultiHeadAttention):
            for part in ("query_dense", "key_dense", "value_dense", "output_dense"):
                src, dst = getattr(layer, part), getattr(twin, part)
                for w_src, w_dst in zip(src.weights, dst.weights, strict=True):
                    if tuple(w_src.shape) != tuple(w_dst.shape):
                        raise ValueError(
                            f"{layer.name}.{part}: shape mismatch {tuple(w_src.shape)} vs {tuple(w_dst.shape)}"
                        )
                    w_dst.assign(w_src)
                if len(src.weights) != len(dst.weights):
                    raise ValueError(f"{layer.name}.{part}: different numbers of weights")
        else:
            twin.set_weights(layer.get_weights())


def accuracy(model, x, y):
    logits = model.predict(x, batch_size=256, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == y))


def compile_model(model, learning_rate, jit):
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20, help="softmax teacher epochs")
    parser.add_argument("--feature-map", default="hedgehog", help="a trainable registered feature map")
    parser.add_argument("--distill-epochs", type=int, default=4)
    parser.add_argument("--distill-steps", type=int, default=100, help="distillation steps per epoch")
    parser.add_argument("--distill-lr", type=float, default=1e-2)
    parser.add_argument("--finetune-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-jit", action="store_true", help="train without XLA")
    parser.add_argument("--output", help="optional JSON file for the figures")
    args = parser.parse_args(argv)
    jit = not args.no_jit
    keras.utils.set_random_seed(args.seed)
    if args.feature_map not in feature_maps.available():
        parser.error(f"--feature-map {args.feature_map!r} is not registered; available: {feature_maps.available()}")

    rng = np.random.default_rng(args.seed)
    x_train, y_train = make_recall_data(args.train_size, args.seq_len, args.vocab, rng)
    x_test, y_test = make_recall_data(args.test_size, args.seq_len, args.vocab, rng)
    key_dim = args.dim // args.heads
    build = lambda factory: build_classifier(  # noqa: E731
        factory, args.seq_len, args.vocab, args.dim, args.layers, args.seed
    )
    results = {"args": vars(args)}
    start = time.time()

    teacher = build(lambda name: keras.layers.MultiHeadAttention(args.heads, key_dim, name=name))
    compile_model(teacher, 1e-3, jit)
    teacher.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    results["softmax_accuracy"] = accuracy(teacher, x_test, y_test)
    print(f"softmax (MultiHeadAttention) test accuracy: {results['softmax_accuracy']:.4f}")

    def linear(feature_map):
        model = build(
            # No short convolution: the student copies the teacher's projections, and a random one would
            # change what they compute.
            lambda name: LinearAttention(
                args.heads, key_dim, feature_map=feature_maps.get(feature_map), conv_size=None, name=name
            )
        )
        copy_weights(teacher, model)
        compile_model(model, 1e-3, jit)
        return model

    attention_names = [f"attention_{i}" for i in range(args.layers)]
    elu = linear("elu")
    results["elu_accuracy"] = accuracy(elu, x_test, y_test)
    results["elu_kl"] = distill.attention_kl(elu, x_test, batch_size=256, layers=attention_names)
    print(f"linear (elu, copied weights) test accuracy: {results['elu_accuracy']:.4f}, KL {results['elu_kl']}")

    student = linear(args.feature_map)
    results["linear_accuracy_before"] = accuracy(student, x_test, y_test)
    print(f"linear ({args.feature_map}, copied weights) test accuracy: {results['linear_accuracy_before']:.4f}")
    history = distill.distill_attention(
        student,
        x_train,
        epochs=args.distill_epochs,
        steps_per_epoch=args.distill_steps,
        batch_size=args.batch_size,
        learning_rate=args.distill_lr,
        validation_data=x_test,
        jit_compile=jit,
        verbose=2,
    )
    results["kl_before"] = history.kl_before
    results["kl_after"] = history.kl_after
    results["linear_accuracy_distilled"] = accuracy(student, x_test, y_test)
    print(f"attention KL before distillation: {history.kl_before}")
    print(f"attention KL after distillation:  {history.kl_after}")
    print(f"linear ({args.feature_map}) test accuracy after distillation: {results['linear_accuracy_distilled']:.4f}")

    def finetune(model):
        """Trains the whole `model` for --finetune-epochs at a low learning rate; returns its test accuracy."""
        compile_model(model, 3e-4, jit)
        model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.finetune_epochs, verbose=2)
        return accuracy(model, x_test, y_test)

    if args.finetune_epochs:
        results["linear_accuracy_finetuned"] = finetune(student)
        print(
            f"linear ({args.feature_map}) test accuracy after distillation + {args.finetune_epochs} "
            f"fine-tune epoch(s): {results['linear_accuracy_finetuned']:.4f}"
        )
        # Control: the same fine-tune from the copied weights, without distillation.
        results["linear_accuracy_finetuned_without_distillation"] = finetune(linear(args.feature_map))
        print(
            f"control: linear ({args.feature_map}) test accuracy after {args.finetune_epochs} fine-tune "
            f"epoch(s) without distillation: {results['linear_accuracy_finetuned_without_distillation']:.4f}"
        )
    results["seconds"] = round(time.time() - start, 1)
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
