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

    monkeypatch.setattr(families.registry, "_REGISTRY", dict(families.registry._REGISTRY))
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


# The text decoders of keras-hub 0.32 (docs/linearize.md, "The 22 keras-hub decoder families"). SmolLM and
# Qwen 2 are aliases (`SmolLMBackbone is SmolLM3Backbone`, `Qwen2Backbone is QwenBackbone`).
DECODERS = (
    "BloomBackbone", "FalconBackbone", "GPT2Backbone", "GPTNeoXBackbone", "GemmaBackbone", "Gemma3Backbone",
    "Gemma4Backbone", "GptOssBackbone", "LlamaBackbone", "Llama3Backbone", "MistralBackbone", "MixtralBackbone",
    "OPTBackbone", "Phi3Backbone", "QwenBackbone", "Qwen3Backbone", "QwenMoeBackbone", "Qwen3MoeBackbone",
    "Qwen3_5Backbone", "Qwen3_5MoeBackbone", "SmolLMBackbone", "SmolLM3Backbone",
)  # fmt: skip


def test_every_decoder_family_is_mapped_or_names_its_missing_piece():
    from keras_linattn.linearization.families import _pending

    covered = families.names()
    for name in DECODERS:
        cls = getattr(keras_hub.models, name)
        assert (cls.__name__ in covered) != (cls.__name__ in _pending.MISSING), name
    assert not set(covered) & set(_pending.MISSING)  # a family module removes its pending entry


def test_the_family_table_matches_the_registry():
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "linearize.md").read_text()
    rows = re.findall(r"^\| [^|]+ \| `(\w+Backbone)`[^|]* \| (✔|✘)[^|]* \|", doc, flags=re.M)
    assert len(rows) == 22  # the 21 keras-hub decoders by class (two aliases share a row) and this package's
    covered = families.names()
    for backbone, status in rows:
        if backbone != "LinearBackbone":
            assert (status == "✔") == (backbone in covered), backbone
