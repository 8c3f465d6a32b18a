"""The trainer shared by distillation and attention transfer: `fit`'s callbacks reach it from `distill_attention`."""

import keras
import numpy as np
import pytest

from keras_linattn import distill
from keras_linattn.layers import LinearAttention


class _Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append((epoch, sorted(logs)))


def _model():
    inputs = keras.Input((8, 12))
    attention = LinearAttention(2, 4, feature_map="hedgehog", name="attention")
    return keras.Model(inputs, attention(inputs, inputs, use_causal_mask=True))


def test_distill_attention_passes_callbacks_to_fit_and_resumes(tmp_path):
    x = np.random.default_rng(0).normal(size=(8, 8, 12)).astype("float32")

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("interrupted")

    def run(callbacks):
        keras.utils.set_random_seed(0)
        model = _model()
        try:
            distill.distill_attention(model, x, epochs=2, batch_size=8, callbacks=callbacks, verbose=0)
        except RuntimeError:
            pass
        return [np.asarray(v).copy() for v in model.weights]

    uninterrupted = run([])
    backup = str(tmp_path / "backup")
    run([keras.callbacks.BackupAndRestore(backup), Stop()])
    epochs = _Epochs()
    resumed = run([keras.callbacks.BackupAndRestore(backup), epochs])
    # The callbacks reach fit, with the trainer's logs; resumed after the saved first
    # epoch, only the second one runs, from the saved state.
    assert epochs.seen == [(1, ["kl", "kl/attention", "loss"])]
    for a, b in zip(resumed, uninterrupted, strict=True):
        np.testing.assert_array_equal(a, b)


def test_distill_attention_refuses_empty_data():
    model = _model()
    with pytest.raises(ValueError, match="no batch"):
        distill.distill_attention(model, np.zeros((0, 8, 12), "float32"), verbose=0)
