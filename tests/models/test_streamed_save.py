"""`.keras` save and load of a large LinearCausalLM stream the weights through a file on disk (issue 58)."""

import os
import tempfile

import keras
import numpy as np
import pytest
from keras.src.saving import saving_lib

from keras_linattn.models import LinearBackbone, LinearCausalLM, _saving

pytestmark = pytest.mark.tf_only("saves a .keras file with TensorFlow variables")


@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(0)
    model = LinearCausalLM(vocabulary_size=30, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)
    model(np.zeros((1, 4), "int32"))
    return model


def _spy(monkeypatch, name):
    """Records each call of ``tempfile.<name>`` (Keras' on-disk branch of a save or a load)."""
    calls = []
    original = getattr(tempfile, name)

    def spy(*args, **kwargs):
        calls.append(kwargs.get("dir"))
        return original(*args, **kwargs)

    monkeypatch.setattr(tempfile, name, spy)
    return calls


def test_a_large_lm_saves_and_loads_through_a_file_on_disk(lm, tmp_path, monkeypatch):
    # Every model of this package counts as large here; the rule itself is the threshold (next test).
    monkeypatch.setattr(_saving, "STREAM_BYTES", 0)
    saved = _spy(monkeypatch, "NamedTemporaryFile")
    extracted = _spy(monkeypatch, "TemporaryDirectory")
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    assert saved == [tmp_path]  # the weights' HDF5 file written beside the archive, not in memory
    restored = keras.saving.load_model(path, compile=False)
    assert extracted == [tmp_path]
    assert os.listdir(tmp_path) == ["lm.keras"]  # the temporary files are gone
    assert len(restored.weights) == len(lm.weights)
    for a, b in zip(lm.weights, restored.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


def test_only_this_packages_models_past_the_threshold_stream(lm, monkeypatch):
    keras_rule = saving_lib.is_memory_sufficient.__wrapped__
    assert not _saving.streams_weights(lm)  # a small model keeps Keras' in-memory path
    assert saving_lib.is_memory_sufficient(lm) == keras_rule(lm)
    monkeypatch.setattr(_saving, "STREAM_BYTES", 0)
    assert _saving.streams_weights(lm)
    assert saving_lib.is_memory_sufficient(lm) is False
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert not _saving.streams_weights(plain)
    assert saving_lib.is_memory_sufficient(plain) == keras_rule(plain)


def test_install_is_idempotent():
    wrapped = saving_lib.is_memory_sufficient
    classes = list(_saving._BACKBONE_CLASSES)
    _saving.install(LinearBackbone)
    assert saving_lib.is_memory_sufficient is wrapped
    assert _saving._BACKBONE_CLASSES == classes
