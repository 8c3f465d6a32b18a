"""The family registry of `linearize` (keras_linattn/linearization/families)."""

import keras
import keras_hub
import pytest

from keras_linattn.linearization import families
from keras_linattn.linearization._keras_hub import linearize_keras_hub


def test_every_family_module_registers_itself():
    covered = families.names()
    assert covered["GPT2Backbone"] == "gpt2"
    assert covered["LlamaBackbone"] == covered["Llama3Backbone"] == "llama"


def test_a_registered_family_is_found_for_a_subclass_and_a_clash_is_refused(monkeypatch):
    class ToyBackbone:
        pass

    class ToySubclass(ToyBackbone):
        pass

    monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))
    toy = families.Family(name="toy", backbones=("ToyBackbone",), config=dict, weights=lambda *a: None)
    families.register(toy)
    assert families.get(ToySubclass()) is toy
    with pytest.raises(ValueError, match="ToyBackbone.*already covered by family 'toy'.*Received: family='other'"):
        families.register(families.Family(name="other", backbones=("ToyBackbone",), config=dict, weights=dict))


def test_a_family_without_a_module_names_its_missing_piece():
    keras.utils.set_random_seed(0)
    opt = keras_hub.models.OPTBackbone(
        vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=16
    )
    with pytest.raises(TypeError, match="OPTBackbone is not supported.*offset of 2.*Supported: .*GPT2Backbone"):
        linearize_keras_hub(opt)
