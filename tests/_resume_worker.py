"""A tiny training run that tests/training/test_resume.py kills and reruns.

    python -m tests._resume_worker --feature-map favor+ --backup-dir DIR --out weights.npz --progress

`train` is also called in-process for the uninterrupted reference. The data
is one repeating stream shuffled with a fixed seed; a resumed run skips the
batches of the epochs its backup holds (`BackupAndRestore.initial_epoch`)
and the callback passes over the batches of the resumed epoch that the
backup holds, so both runs see the same batches in the same order.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_linattn import _atomic, feature_maps  # noqa: E402
from keras_linattn.callbacks import BackupAndRestore, RedrawRandomFeatures  # noqa: E402
from keras_linattn.layers import LinearAttention  # noqa: E402

SEED = 7
BATCH, LENGTH, DIM, HEADS, KEY_DIM = 4, 8, 6, 2, 4
EXAMPLES = 16
STEPS_PER_EPOCH = EXAMPLES // BATCH  # 4
EPOCHS = 3
SAVE_FREQ = 3  # backups after steps 3, 6, 9, 12: two of them inside an epoch
REDRAW_EVERY = 2
DROPOUT = 0.1  # the dropout seed state is part of the backup


def build(feature_map):
    keras.utils.set_random_seed(SEED)
    kwargs = {"num_features": 8, "seed": 1} if feature_map in ("favor+", "favor_trig") else {}
    inputs = keras.Input((LENGTH, DIM))
    attention = LinearAttention(
        HEADS, KEY_DIM, feature_map=feature_maps.get(feature_map, **kwargs), chunk_size=4, dropout=DROPOUT
    )
    h = attention(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(DIM)(h))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


def stream():
    """Batches of ``(x [B, T, D], y [B, T, D])``: the same sequence in every process."""
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(EXAMPLES, LENGTH, DIM)).astype("float32")
    y = np.roll(x, 1, axis=1)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(EXAMPLES, seed=SEED, reshuffle_each_iteration=True)
    return ds.repeat().batch(BATCH)


class _Progress(keras.callbacks.Callback):
    """Prints ``step <n>`` after every trained batch (what the killing test waits for)."""

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {self.epoch * STEPS_PER_EPOCH + batch + 1}", flush=True)
        time.sleep(self.delay)


def train(feature_map, backup_dir=None, progress=False, step_delay=0.0):
    """Trains and returns the final weights (a list of arrays)."""
    model = build(feature_map)
    callbacks = []
    if feature_map in ("favor+", "favor_trig"):
        callbacks.append(RedrawRandomFeatures(every_n_steps=REDRAW_EVERY))
    data = stream()
    if backup_dir is not None:
        backup = BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
        data = data.skip(backup.initial_epoch * STEPS_PER_EPOCH)
        callbacks.append(backup)
    if progress:
        callbacks.append(_Progress(step_delay))
    model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, callbacks=callbacks, verbose=0, shuffle=False)
    return [np.asarray(w) for w in model.weights]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--feature-map", required=True)
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    weights = train(args.feature_map, args.backup_dir, progress=args.progress, step_delay=args.step_delay)
    with _atomic.staging_dir(os.path.dirname(os.path.abspath(args.out))) as tmp:
        staged = os.path.join(tmp, "weights.npz")
        np.savez(staged, *weights)
        _atomic.publish(staged, args.out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
