"""Helpers shared by the example scripts: a small encoder classifier, timing, summaries.

XLA on CPU: ``model.compile(jit_compile="auto")`` (Keras' default) does NOT
enable XLA on a CPU-only TensorFlow; every example therefore passes
``jit_compile=True`` explicitly (``--no-jit`` turns it off). Sequences are
padded to one fixed length so that the XLA train step is traced and compiled
once, not once per batch shape.

Shape legend: B batch, T sequence length, E model width (hidden_dim).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras_linattn  # noqa: E402 - a light import: TensorFlow loads in `quiet`

keras_linattn.quiet()  # TensorFlow's start-up lines and known-harmless warnings stay out of stderr

import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
from keras import ops  # noqa: E402

from keras_linattn import feature_maps  # noqa: E402
from keras_linattn.layers import LinearAttention  # noqa: E402

XLA_NOTE = (
    "XLA: jit_compile=True is passed explicitly; Keras' default jit_compile='auto' "
    "does not enable XLA on CPU-only TensorFlow."
)

#: Name used for softmax attention (keras.layers.MultiHeadAttention) in the examples.
SOFTMAX = "softmax"


def add_training_args(parser, *, steps, batch_size, learning_rate=1e-3):
    """Adds the arguments every training example shares to an argparse parser."""
    parser.add_argument("--steps", type=int, default=steps, help="training steps per run (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="batch size (default %(default)s)")
    parser.add_argument(
        "--learning-rate", type=float, default=learning_rate, help="AdamW learning rate (default %(default)s)"
    )
    parser.add_argument(
        "--no-jit",
        dest="jit_compile",
        action="store_false",
        help="disable XLA (by default jit_compile=True, which Keras' 'auto' would not do on CPU)",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=["float32", "mixed_bfloat16", "mixed_float16"],
        default="float32",
        help="Keras dtype policy (default %(default)s); mixed_float16 gets loss scaling automatically",
    )
    parser.add_argument("--verbose", type=int, default=1, choices=[0, 1, 2], help="Keras fit verbosity")
    add_backup_args(parser)
    return parser


def add_backup_args(parser):
    """``--backup-dir`` / ``--backup-every``: resumable training (`keras_linattn.callbacks.BackupAndRestore`)."""
    parser.add_argument(
        "--backup-dir",
        default=None,
        help="back up the training state here; rerunning the same command after a crash resumes "
        "where the last backup was (same final weights as an uninterrupted run)",
    )
    parser.add_argument(
        "--backup-every",
        type=int,
        default=None,
        help="steps between backups (default: after every evaluation epoch)",
    )
    return parser


def make_backup(backup_dir, backup_every=None):
    """`keras_linattn.callbacks.BackupAndRestore` for ``--backup-dir`` (None without one)."""
    if not backup_dir:
        return None
    from keras_linattn.callbacks import BackupAndRestore

    return BackupAndRestore(backup_dir, save_freq=backup_every or "epoch")


def apply_dtype_policy(args):
    """Sets the global Keras dtype policy from ``--mixed-precision`` (nothing to do for float32)."""
    if args.mixed_precision != "float32":
        keras.config.set_dtype_policy(args.mixed_precision)


def xla_message(jit_compile):
    """The line the examples print about XLA: `XLA_NOTE`, or that ``--no-jit`` turned it off."""
    return XLA_NOTE if jit_compile else "XLA disabled (--no-jit)."


def feature_map_factory(name, **kwargs):
    """A zero-argument callable making a fresh feature map (one per layer).

    Args:
        name: a registered feature-map name (see `keras_linattn.feature_maps.available()`).
        **kwargs: constructor arguments of that feature map.
    """
    feature_maps.get(name, **kwargs)  # Fails early on an unknown name or bad arguments.

    def make():
        return feature_maps.get(name, **kwargs)

    return make


@keras.saving.register_keras_serializable(package="keras_linattn_examples")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding plus a learned absolute position embedding.

    Args:
        vocabulary_size: number of token ids (id 0 is padding).
        sequence_length: maximum sequence length T.
        hidden_dim: embedding width E.

    Call arguments:
        token_ids: ``[B, T]`` int token ids.

    Returns:
        ``[B, T, E]`` embeddings.
    """

    def __init__(self, vocabulary_size, sequence_length, hidden_dim, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.sequence_length = sequence_length
        self.hidden_dim = hidden_dim
        self.token_embedding = keras.layers.Embedding(vocabulary_size, hidden_dim, dtype=self.dtype_policy)
        self.position_embedding = keras.layers.Embedding(sequence_length, hidden_dim, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build((input_shape[1],))
        self.built = True

    def call(self, token_ids):
        length = ops.shape(token_ids)[1]
        positions = self.position_embedding(ops.arange(length))  # [T, E]
        return self.token_embedding(token_ids) + positions[None]  # [B, T, E]

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocabulary_size": self.vocabulary_size,
                "sequence_length": self.sequence_length,
                "hidden_dim": self.hidden_dim,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="keras_linattn_examples")
class EncoderBlock(keras.layers.Layer):
    """Pre-LayerNorm transformer encoder block with softmax or linear attention.

    Args:
        hidden_dim: model width E.
        num_heads: attention heads.
        intermediate_dim: width of the feedforward sublayer.
        feature_map: a feature-map name or instance for linear attention, or
            ``"softmax"`` for `keras.layers.MultiHeadAttention`.
        dropout: dropout rate after attention and feedforward.

    Call arguments:
        x: ``[B, T, E]``.
        padding_mask: ``[B, T]`` boolean, True for real tokens.
        training: Python boolean.

    Returns:
        ``[B, T, E]``.
    """

    def __init__(self, hidden_dim, num_heads, intermediate_dim, feature_map="elu", dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(
                f"`hidden_dim` must be divisible by `num_heads`. Received: hidden_dim={hidden_dim}, "
                f"num_heads={num_heads}"
            )
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        key_dim = hidden_dim // num_heads
        if isinstance(feature_map, str) and feature_map == SOFTMAX:
            self.feature_map = SOFTMAX
            self.attention = keras.layers.MultiHeadAttention(
                num_heads, key_dim, dtype=self.dtype_policy, name="attention"
            )
        else:
            self.feature_map = feature_maps.get(feature_map)
            self.attention = LinearAttention(
                num_heads,
                key_dim,
                feature_map=self.feature_map,
                conv_size=None,  # the figures on record are of the feature map alone
                dtype=self.dtype_policy,
                name="attention",
            )
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.ffn_in = keras.layers.Dense(intermediate_dim, activation="gelu", dtype=self.dtype_policy)
        self.ffn_out = keras.layers.Dense(hidden_dim, dtype=self.dtype_policy)
        self.drop = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.norm1.build(input_shape)
        self.norm2.build(input_shape)
        self.attention.build(input_shape, input_shape)
        self.ffn_in.build(input_shape)
        self.ffn_out.build(tuple(input_shape[:-1]) + (self.intermediate_dim,))
        self.built = True

    def call(self, x, padding_mask=None, training=None):
        h = self.norm1(x)  # [B, T, E]
        if self.feature_map == SOFTMAX:
            attention_mask = None if padding_mask is None else padding_mask[:, None, :]  # [B, 1, T]
            h = self.attention(h, h, attention_mask=attention_mask, training=training)  # [B, T, E]
        else:
            h = self.attention(h, h, key_mask=padding_mask, training=training)  # [B, T, E]
        x = x + self.drop(h, training=training)
        h = self.ffn_out(self.ffn_in(self.norm2(x)))  # [B, T, E]
        return x + self.drop(h, training=training)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "hidden_dim": self.hidden_dim,
                "num_heads": self.num_heads,
                "intermediate_dim": self.intermediate_dim,
                "feature_map": (SOFTMAX if self.feature_map == SOFTMAX else feature_maps.serialize(self.feature_map)),
                "dropout": self.dropout,
            }
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config["feature_map"] != SOFTMAX:
            config["feature_map"] = feature_maps.get(config["feature_map"])
        return cls(**config)


def build_classifier(
    vocabulary_size,
    sequence_length,
    num_classes,
    feature_map="elu",
    num_layers=1,
    hidden_dim=64,
    num_heads=2,
    intermediate_dim=128,
    dropout=0.0,
    name=None,
):
    """A small sequence classifier: embeddings, encoder blocks, masked mean pooling, softmax.

    Token id 0 is padding (masked out of attention keys and of the pooling).

    Args:
        vocabulary_size: number of token ids, padding included.
        sequence_length: the fixed (padded) input length T.
        num_classes: number of output classes.
        feature_map: ``"softmax"`` for `keras.layers.MultiHeadAttention`, a
            feature-map name, or a zero-argument callable returning a fresh
            `FeatureMap` (see `feature_map_factory`; each layer gets its own).
        num_layers, hidden_dim, num_heads, intermediate_dim, dropout: model size.

    Returns:
        An uncompiled `keras.Model` mapping ``[B, T]`` int32 ids to ``[B, num_classes]`` logits.
    """
    if isinstance(feature_map, feature_maps.FeatureMap) and num_layers > 1:
        raise ValueError(
            "A FeatureMap instance would be shared by every layer; pass a name or a factory "
            f"(`feature_map_factory`) with num_layers > 1. Received: feature_map={feature_map!r}, "
            f"num_layers={num_layers}"
        )
    token_ids = keras.Input((sequence_length,), dtype="int32", name="token_ids")
    padding_mask = keras.layers.Lambda(lambda t: ops.not_equal(t, 0), name="padding_mask")(token_ids)  # [B, T]
    x = TokenAndPositionEmbedding(vocabulary_size, sequence_length, hidden_dim, name="embedding")(token_ids)
    for i in range(num_layers):
        fm = feature_map() if callable(feature_map) and not isinstance(feature_map, str) else feature_map
        x = EncoderBlock(hidden_dim, num_heads, intermediate_dim, fm, dropout, name=f"block_{i}")(
            x, padding_mask=padding_mask
        )  # [B, T, E]
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x, mask=padding_mask)  # [B, E]
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)  # [B, num_classes]
    return keras.Model(token_ids, logits, name=name)


def build_classifier_from_args(args, vocabulary_size, sequence_length, num_classes, feature_map, name):
    """`build_classifier` with the model size read from the parsed command line.

    Uses ``args.num_layers``, ``args.hidden_dim``, ``args.num_heads``,
    ``args.intermediate_dim`` and ``args.dropout``; the other arguments are
    those of `build_classifier`.
    """
    return build_classifier(
        vocabulary_size,
        sequence_length,
        num_classes,
        feature_map=feature_map,
        num_layers=args.num_layers,
        hidden_dim=args.hidden_dim,
        num_heads=args.num_heads,
        intermediate_dim=args.intermediate_dim,
        dropout=args.dropout,
        name=name,
    )


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training batch (the first one includes compilation)."""

    def __init__(self):
        super().__init__()
        self.times = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    @property
    def median_step_seconds(self):
        """Median step time excluding the first (compiling) step; NaN with fewer than 2 steps."""
        rest = self.times[1:]
        return statistics.median(rest) if rest else float("nan")


def warmup_cosine_schedule(steps, learning_rate):
    """Linear warm-up over the first tenth of `steps` to `learning_rate`, then cosine decay to 0."""
    warmup = max(1, steps // 10)
    return keras.optimizers.schedules.CosineDecay(
        0.0, max(1, steps - warmup), warmup_target=learning_rate, warmup_steps=warmup
    )


def compile_for_training(model, learning_rate, jit_compile):
    """Compiles `model` as the training examples do.

    AdamW (weight decay 0.01, gradient clipping by norm 1.0), sparse
    categorical cross-entropy on logits, accuracy metric.

    Args:
        model: a `keras.Model` producing logits.
        learning_rate: a float or a `keras.optimizers.schedules.LearningRateSchedule`.
        jit_compile: passed to `model.compile` (XLA when True).
    """
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate, weight_decay=0.01, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )


def fit_timed(model, train_ds, steps, eval_every, verbose, validation_data=None, backup=None, callbacks=()):
    """Trains for about `steps` steps in epochs of `eval_every` steps, timing every step.

    Runs ``max(1, steps // eval_every)`` epochs of `eval_every` steps each
    (validation, if given, runs after every epoch).

    `train_ds` must be one repeating stream whose batches do not depend on
    the process (shuffled with a fixed seed). With a `backup`
    (`keras_linattn.callbacks.BackupAndRestore`, see `make_backup`), the
    model resumes from the backup and the stream skips the batches of the
    epochs the backup already holds, so a resumed run sees the batches the
    uninterrupted one would have. The model must be built.

    Returns:
        ``(history, timer, seconds)``: the `model.fit` history (of the epochs
        run by this call), the `StepTimer` with per-step times, and the wall
        time of the whole fit.
    """
    timer = StepTimer()
    callbacks = [timer, *callbacks]
    earlier = {}
    if backup is not None:
        start_epoch, start_batch = backup.resume_point()
        if start_epoch or start_batch:
            print(
                f"resuming from the backup in {backup.backup_dir}: epoch {start_epoch}, batch {start_batch}", flush=True
            )
        train_ds = train_ds.skip(start_epoch * eval_every)
        epoch_log = EpochLog(os.path.join(backup.backup_dir, EpochLog.FILE))
        earlier = {e: logs for e, logs in epoch_log.read().items() if e < start_epoch}
        callbacks += [epoch_log, backup]  # the log is written before the backup that covers its epoch
    start = time.perf_counter()
    history = model.fit(
        train_ds,
        epochs=max(1, steps // eval_every),
        steps_per_epoch=eval_every,
        validation_data=validation_data,
        callbacks=callbacks,
        verbose=verbose,
        shuffle=False,  # the datasets shuffle themselves; Keras warns that fit's shuffle ignores them
    )
    if earlier:  # a resumed run: prepend the epochs finished before the crash
        merged = {}
        for key, values in history.history.items():
            merged[key] = [earlier[e].get(key, float("nan")) for e in sorted(earlier)] + list(values)
        history.history = merged
    return history, timer, time.perf_counter() - start


class EpochLog(keras.callbacks.Callback):
    """Writes each epoch's logs to a JSON file (atomically), so a resumed run reports its whole history."""

    FILE = "epoch_logs.json"

    def __init__(self, path):
        super().__init__()
        self.path = path

    def read(self):
        """``{epoch: logs}`` written so far ({} when there is no file)."""
        if not os.path.exists(self.path):
            return {}
        import json

        try:
            with open(self.path) as f:
                return {int(k): v for k, v in json.load(f).items()}
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"The epoch log is unreadable ({e}). Received: path={self.path!r}") from e

    def on_epoch_end(self, epoch, logs=None):
        import json

        from keras_linattn import _atomic

        entries = self.read()
        entries[epoch] = {k: float(v) for k, v in (logs or {}).items()}
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        _atomic.write_bytes_atomic(self.path, json.dumps({str(k): v for k, v in sorted(entries.items())}))


def format_table(header, rows):
    """A GitHub-markdown table from a header list and rows of cells."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
