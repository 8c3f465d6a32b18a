"""`BackupAndRestore` with ``steps_per_execution`` that does not divide ``steps_per_epoch``.

Keras 3.15 (`keras/src/trainers/epoch_iterator.py`) runs the executions
``range(0, steps_per_epoch, steps_per_execution)`` per epoch, each drawing
``steps_per_execution`` batches: ``steps_per_epoch=6, steps_per_execution=4``
draws 8 batches per epoch (executions 0-3 and 4-7), and with
``steps_per_epoch`` set the next epoch continues the same iterator. The
batch hooks get the execution's first step (``on_train_batch_begin``) and
last step (``on_train_batch_end``). Before: the documented
``stream.skip(initial_epoch * steps_per_epoch)`` resumed 2 batches early per
finished epoch, and a backup after the first execution of an epoch was
recorded as the epoch's end (``batch + steps_per_execution >= steps``), so
the resumed run skipped the rest of the epoch. Both gave weights that differ
from the uninterrupted run's, silently.
"""

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.callbacks import BackupAndRestore, RedrawRandomFeatures, batches_per_epoch
from keras_linattn.layers import LinearAttention
from tests.conftest import TEST_SEED
from tests.training.test_resume import _assert_same_weights

STEPS, PER_EXECUTION, BATCH, LENGTH = 6, 4, 2, 8


def _model(per_execution=PER_EXECUTION):
    keras.utils.set_random_seed(TEST_SEED)
    inputs = keras.Input((LENGTH, 6))
    fm = feature_maps.get("favor+", num_features=6, seed=0)
    h = inputs + LinearAttention(2, 3, feature_map=fm, chunk_size=4)(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(6)(h))
    # Eager: tracing the train step costs more than the few steps taken here.
    model.compile(keras.optimizers.Adam(1e-2), "mse", run_eagerly=True, steps_per_execution=per_execution)
    return model


def _stream(rng):
    x = rng.normal(size=(8, LENGTH, 6)).astype("float32")

    def make():  # one dataset object per run (see docs/faults.md)
        ds = tf.data.Dataset.from_tensor_slices((x, np.roll(x, 1, axis=1)))
        return ds.shuffle(8, seed=1, reshuffle_each_iteration=True).repeat().batch(BATCH)  # 4 batches per pass

    return make


class _Interrupt(keras.callbacks.Callback):
    """Raises after the `at`-th execution of the fit call (an in-process crash)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("interrupted by the test")


def _fit(model, stream, backup=None, interrupt_at=None, epochs=3, skip=0):
    callbacks = [RedrawRandomFeatures(every_n_steps=1)]
    callbacks += [backup] if backup is not None else []
    callbacks += [_Interrupt(interrupt_at)] if interrupt_at is not None else []
    model.fit(stream().skip(skip), epochs=epochs, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0)


def _weights(model):
    return [np.asarray(w) for w in model.weights]


def _n(
    epochs,
):  # reduction length of a weight after all the batches trained (error model, tests/training/test_resume.py)
    return epochs * batches_per_epoch(STEPS, PER_EXECUTION) * BATCH * LENGTH


def test_batches_per_epoch():
    assert batches_per_epoch(6, 4) == 8
    assert batches_per_epoch(8, 4) == 8
    assert batches_per_epoch(6) == 6
    with pytest.raises(ValueError, match="steps_per_execution"):
        batches_per_epoch(6, 0)


def test_epoch_backup_resumes_equal_with_steps_per_execution(tmp_path, rng):
    stream = _stream(rng)
    reference = _model()
    _fit(reference, stream)
    expected = _weights(reference)

    backup_dir = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):  # 2 executions per epoch: killed after the first of epoch 1
        _fit(_model(), stream, BackupAndRestore(backup_dir, delete_checkpoint=False), interrupt_at=3)
    backup = BackupAndRestore(backup_dir, delete_checkpoint=False)
    assert backup.resume_point() == (1, 0)
    assert backup.batches_to_skip == 8  # not initial_epoch * steps_per_epoch = 6

    copy = str(tmp_path / "copy")
    shutil.copytree(backup_dir, copy)  # the resumed fit writes its own backups into backup_dir

    resumed = _model()
    _fit(resumed, stream, backup, skip=backup.batches_to_skip)
    _assert_same_weights(_weights(resumed), expected, n=_n(3), what="resumed")

    # The old recipe resumes 2 batches early: the comparison tells the two apart.
    wrong = _model()
    _fit(wrong, stream, BackupAndRestore(copy), skip=backup.initial_epoch * STEPS)
    assert max(np.abs(a - b).max() for a, b in zip(_weights(wrong), expected, strict=True)) > 1e-3


def test_mid_epoch_backup_resumes_equal_with_steps_per_execution(tmp_path, rng):
    """A backup after every execution; killed after the first execution of epoch 1."""
    stream = _stream(rng)
    reference = _model()
    _fit(reference, stream, epochs=2)
    expected = _weights(reference)

    backup_dir = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _fit(_model(), stream, BackupAndRestore(backup_dir, save_freq=4), interrupt_at=3, epochs=2)
    backup = BackupAndRestore(backup_dir, save_freq=4)
    assert backup.resume_point() == (1, 4)  # epoch 1, after steps 0-3 (was (2, 0): the epoch taken as done)
    resumed = _model()
    _fit(resumed, stream, backup, epochs=2, skip=backup.batches_to_skip)
    _assert_same_weights(_weights(resumed), expected, n=_n(2), what="mid-epoch")


def test_resuming_with_other_steps_per_execution_is_refused(tmp_path, rng):
    stream = _stream(rng)
    backup_dir = str(tmp_path / "backup")
    _fit(_model(), stream, BackupAndRestore(backup_dir, delete_checkpoint=False), epochs=1)
    with pytest.raises(ValueError, match="steps_per_execution=4"):
        _fit(_model(per_execution=2), stream, BackupAndRestore(backup_dir), epochs=2)
