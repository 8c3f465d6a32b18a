"""Presets of this package: a sha256 manifest written at save and checked at load, a clean target directory."""

import json
import os
import warnings

import h5py
import keras
import keras_hub
import numpy as np
import pytest

from keras_linattn.models import LinearBackbone, LinearCausalLM, LinearCausalLMPreprocessor
from tests.models.test_keras_hub_shape import char_tokenizer

# Plain linear attention: the layer counts the messages below name are of the model without a convolution.
SMALL = dict(vocabulary_size=258, hidden_dim=16, num_heads=2, intermediate_dim=32, feature_map="elu", conv_size=None)


def _lm(seed=0, num_layers=2):
    keras.utils.set_random_seed(seed)
    backbone = LinearBackbone(num_layers=num_layers, **SMALL)
    return LinearCausalLM(backbone, preprocessor=LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=16))


def _ids():
    return np.random.default_rng(0).integers(1, 258, (2, 12)).astype("int32")


def _saved(tmp_path, lm=None):
    preset = str(tmp_path / "preset")
    (lm or _lm()).save_to_preset(preset)
    return preset


def test_a_sharded_save_over_an_unsharded_one_loads_the_new_weights(tmp_path):
    preset = _saved(tmp_path)
    new = _lm(seed=1)
    # Shards of at most ~21 kB: the 258 x 16 embedding fits one, the whole model does not.
    new.save_to_preset(preset, max_shard_size=0.00002)
    assert not os.path.exists(os.path.join(preset, "model.weights.h5"))  # the earlier save's file is gone
    loaded = LinearCausalLM.from_preset(preset)
    np.testing.assert_array_equal(np.asarray(loaded(_ids())), np.asarray(new(_ids())))


def test_a_flipped_weight_bit_is_refused_naming_the_file(tmp_path):
    preset = _saved(tmp_path)
    path = os.path.join(preset, "model.weights.h5")
    with h5py.File(path, "r") as f:
        offset = f["layers/reversible_embedding/vars/0"].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 3)  # the high byte of the first float32: its sign and exponent
        byte = f.read(1)[0]
        f.seek(offset + 3)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(ValueError, match="'model.weights.h5' changed"):
        LinearCausalLM.from_preset(preset)
    with pytest.raises(ValueError, match="'model.weights.h5' changed"):
        keras_hub.models.CausalLM.from_preset(preset)  # keras-hub's own entry point too


def test_a_config_edited_to_fewer_layers_is_refused(tmp_path):
    preset = _saved(tmp_path)
    path = os.path.join(preset, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["config"]["num_layers"] = 1
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="'config.json' changed"):
        LinearBackbone.from_preset(preset)
    with pytest.raises(ValueError, match="'config.json' changed"):
        keras_hub.models.Backbone.from_preset(preset)


def test_loading_weights_into_a_model_with_fewer_layers_is_loud(tmp_path):
    path = str(tmp_path / "two.weights.h5")
    _lm().backbone.save_weights(path)
    keras.utils.set_random_seed(0)
    one = LinearBackbone(num_layers=1, **SMALL)
    with pytest.raises(ValueError, match=r"18 layers.*10 layers with weights.*num_layers"):
        one.load_weights(path)


def test_a_permuted_vocabulary_is_refused_naming_the_file(tmp_path):
    preset = _saved(tmp_path)
    path = os.path.join(preset, "assets", "tokenizer", "vocabulary.json")
    with open(path) as f:
        vocabulary = json.load(f)
    tokens = list(vocabulary)
    ids = list(vocabulary.values())
    ids[1], ids[2] = ids[2], ids[1]
    with open(path, "w") as f:
        json.dump(dict(zip(tokens, ids, strict=True)), f)
    with pytest.raises(ValueError, match="'assets/tokenizer/vocabulary.json' changed"):
        LinearCausalLM.from_preset(preset)
    with pytest.raises(ValueError, match="'assets/tokenizer/vocabulary.json' changed"):
        LinearCausalLMPreprocessor.from_preset(preset)


def test_a_preset_without_manifest_loads_with_a_warning(tmp_path):
    lm = _lm()
    preset = _saved(tmp_path, lm)
    os.remove(os.path.join(preset, "linattn_manifest.json"))
    with pytest.warns(UserWarning, match="no linattn_manifest.json"):
        loaded = LinearCausalLM.from_preset(preset)
    np.testing.assert_array_equal(np.asarray(loaded(_ids())), np.asarray(lm(_ids())))


def test_an_intact_preset_loads_without_a_warning(tmp_path):
    lm = _lm()
    preset = _saved(tmp_path, lm)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*linattn_manifest")
        loaded = keras_hub.models.CausalLM.from_preset(preset)
    np.testing.assert_array_equal(np.asarray(loaded(_ids())), np.asarray(lm(_ids())))
