"""Saving a compiled LM that never trained writes no optimizer slots, and reloads without a warning."""

import os
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

from keras_linattn.models import LinearCausalLM

pytestmark = pytest.mark.tf_only("saves a .keras file with TensorFlow variables")


def _lm():
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=30, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)
    lm(np.zeros((1, 4), "int32"))
    return lm


def _optimizer_arrays(path):
    with zipfile.ZipFile(path) as z, z.open("model.weights.h5") as f, h5py.File(f, "r") as h5:
        if "optimizer" not in h5:
            return 0
        count = []
        h5["optimizer"].visititems(lambda name, obj: count.append(1) if isinstance(obj, h5py.Dataset) else None)
        return len(count)


def test_an_untrained_lm_saves_no_optimizer_slots_and_reloads_quietly(tmp_path):
    lm = _lm()
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    assert not lm.optimizer.built
    # Adam's slots would be two arrays per trainable weight; an unbuilt optimizer saves its counters only.
    assert _optimizer_arrays(path) < len(lm.trainable_weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    assert not [w for w in caught if "optimizer" in str(w.message)], [str(w.message) for w in caught]
    ids = np.random.default_rng(0).integers(0, 30, size=(4, 6)).astype("int32")
    loaded.fit(ids[:, :-1], ids[:, 1:], epochs=1, batch_size=2, verbose=0)  # builds the optimizer then
    assert loaded.optimizer.built


def test_a_trained_lm_still_saves_and_restores_its_optimizer(tmp_path):
    lm = _lm()
    ids = np.random.default_rng(0).integers(0, 30, size=(4, 6)).astype("int32")
    lm.fit(ids[:, :-1], ids[:, 1:], epochs=1, batch_size=2, verbose=0)
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    assert _optimizer_arrays(path) >= 2 * len(lm.trainable_weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = keras.saving.load_model(path)
    assert not [w for w in caught if "optimizer" in str(w.message)], [str(w.message) for w in caught]
    assert int(loaded.optimizer.iterations) == int(lm.optimizer.iterations) == 2
    for a, b in zip(loaded.optimizer.variables, lm.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
