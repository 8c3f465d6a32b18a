"""LoRA on `LinearBackbone` itself, with keras-hub's `Backbone.enable_lora` signature, recorded in its config."""

import inspect

import keras
import keras_hub
import numpy as np
import pytest

from keras_linattn.models import LinearBackbone
from tests.tolerance import assert_close

PROJECTIONS = ("query", "key", "value", "attention_output")


def _backbone():
    keras.utils.set_random_seed(0)
    return LinearBackbone(vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)


def _adapted(backbone):
    attention = backbone.decoder_blocks[0].attention
    denses = (attention.query_dense, attention.key_dense, attention.value_dense, attention.output_dense)
    return {name: dense.lora_enabled for name, dense in zip(PROJECTIONS, denses, strict=True)}


def test_enable_lora_has_keras_hubs_signature():
    ours = inspect.signature(LinearBackbone.enable_lora).parameters
    theirs = inspect.signature(keras_hub.models.Backbone.enable_lora).parameters
    assert list(theirs) == ["self", "rank", "target_layer_names"]
    assert list(ours)[:3] == list(theirs)
    assert ours["target_layer_names"].default is None


def test_enable_lora_adapts_every_projection_and_the_config_records_it():
    backbone = _backbone()
    adapters = backbone.enable_lora(2)
    assert _adapted(backbone) == dict.fromkeys(PROJECTIONS, True)
    assert {id(v) for v in backbone.trainable_variables} == {id(v) for v in adapters}
    assert len(adapters) == 2 * 4
    assert backbone.get_config()["lora"] == {"rank": 2, "alpha": 2}  # alpha = rank, keras-hub's default
    assert backbone.default_lora_layer_names() == list(PROJECTIONS)


def test_target_layer_names_are_recorded_and_restored():
    backbone = _backbone()
    backbone.enable_lora(2, ["value", "query"], alpha=4)
    assert _adapted(backbone) == {"query": True, "key": False, "value": True, "attention_output": False}
    config = backbone.get_config()
    assert config["lora"] == {"rank": 2, "alpha": 4, "target_layer_names": ["query", "value"]}
    again = LinearBackbone.from_config(config)
    assert _adapted(again) == _adapted(backbone)
    assert again.get_config()["lora"] == config["lora"]


def test_merge_lora_folds_the_adapters_in_place():
    backbone = _backbone()
    backbone.enable_lora(2, alpha=4)
    dense = backbone.decoder_blocks[0].attention.query_dense
    dense.lora_kernel_b.assign(np.full(dense.lora_kernel_b.shape, 0.5, "float32"))
    ids = np.arange(12, dtype="int32").reshape(2, 6) % 16
    want = np.asarray(backbone(ids), "float64")
    backbone.merge_lora()
    assert _adapted(backbone) == dict.fromkeys(PROJECTIONS, False)
    assert "lora" not in backbone.get_config()
    assert all(v.trainable for v in backbone.variables)
    # One more rounding of the merged kernel (W + s A B in float32), through 1 block.
    assert_close(np.asarray(backbone(ids)), want, paths=4, n=8)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        backbone.merge_lora()


def test_bad_arguments_name_the_value():
    backbone = _backbone()
    with pytest.raises(ValueError, match="target_layer_names"):
        backbone.enable_lora(2, ["query_dense"])
    with pytest.raises(ValueError, match="rank"):
        backbone.enable_lora(0)
    with pytest.raises(ValueError, match="alpha"):
        backbone.enable_lora(2, alpha=0)
    backbone.enable_lora(2)
    with pytest.raises(ValueError, match="already enabled"):
        backbone.enable_lora(2)


def test_keras_hubs_lora_weights_file_round_trips(tmp_path):
    backbone = _backbone()
    backbone.enable_lora(2)  # alpha = rank: the rule of keras-hub's file, which records the rank only
    for v in backbone.trainable_variables:
        v.assign(np.random.default_rng(1).normal(size=v.shape).astype("float32"))
    path = str(tmp_path / "adapters.lora.h5")
    backbone.save_lora_weights(path)
    other = _backbone()  # the same seed: the same frozen weights
    other.load_lora_weights(path)
    assert _adapted(other) == dict.fromkeys(PROJECTIONS, True)
    ids = np.arange(12, dtype="int32").reshape(2, 6) % 16
    np.testing.assert_array_equal(np.asarray(other(ids)), np.asarray(backbone(ids)))


def test_the_causal_lm_enables_and_merges_on_its_backbone():
    from keras_linattn.models import LinearCausalLM

    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16)
    adapters = lm.enable_lora(2, ["query", "value"])
    assert {id(v) for v in lm.trainable_variables} == {id(v) for v in adapters}
    assert lm.backbone.get_config()["lora"] == {"rank": 2, "alpha": 2, "target_layer_names": ["query", "value"]}
    lm.merge_lora()
    assert lm.backbone.lora_rank is None and all(v.trainable for v in lm.variables)
