"""One attention spec, validated once, passed unchanged from the LM to the blocks and the layers."""

import dataclasses

import numpy as np
import pytest

from keras_linattn import feature_maps, recurrences
from keras_linattn.layers import (
    AttentionSpec,
    LinearAttention,
    LinearTransformerDecoder,
    LinearTransformerEncoder,
)
from keras_linattn.models import LinearBackbone, LinearCausalLM


def test_shorthand_arguments_and_recurrence_give_the_same_layer_config():
    old = LinearAttention(2, 8, decay="scalar", conv_size=3)
    new = LinearAttention(2, 8, recurrence=recurrences.get("decay", gate="scalar"), conv_size=3)
    for key in ("recurrence", "conv_size"):
        assert old.get_config()[key] == new.get_config()[key]
    assert [e.name for e in old.state_spec()] == [e.name for e in new.state_spec()]


def test_the_lm_hands_one_spec_to_every_block_and_layer():
    lm = LinearCausalLM(
        vocabulary_size=20,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        update="delta",
        normalize=False,
        decay="fixed",
        conv_size=2,
    )
    spec = lm.backbone.attention_spec
    assert lm.attention_spec is spec
    expected = lm.backbone.get_config()["recurrence"]  # the LM is a keras-hub task over its backbone
    assert expected["class_name"] == "DeltaRecurrence" and expected["config"] == {"gate": "fixed"}
    for block in lm.decoder_blocks:
        # The very object, not a copy rebuilt from arguments (an unseeded map: no per-block seed).
        assert block.attention_spec is spec and block.attention.attention_spec is spec
        assert block.get_config()["recurrence"] == expected and block.get_config()["conv_size"] == 2
        layer = block.attention
        assert layer.get_config()["recurrence"] == expected and layer.conv_size == 2
        # Each layer owns its recurrence (bound to its own weights).
        assert layer.recurrence.layer is layer
    assert lm.decoder_blocks[0].attention.recurrence is not lm.decoder_blocks[1].attention.recurrence


def test_a_seeded_map_gives_each_block_its_own_seed_in_its_own_spec():
    backbone = LinearBackbone(20, 3, 16, 2, 32, feature_map=feature_maps.get("favor+", seed=5))
    seeds = [block.attention.feature_map.seed for block in backbone.decoder_blocks]
    assert seeds[0] == 5 and len(set(seeds)) == 3
    # Block 0 gets the backbone's spec itself; the others a copy with only the seed changed.
    assert backbone.decoder_blocks[0].attention_spec is backbone.attention_spec
    other = backbone.decoder_blocks[1].attention_spec
    assert dataclasses.replace(other, feature_map_config=backbone.attention_spec.feature_map_config) == (
        backbone.attention_spec
    )


def test_the_spec_is_frozen_and_holds_configs_not_layers():
    spec = AttentionSpec.create("hedgehog", window_size=4, conv_size=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.conv_size = 4
    config = spec.feature_map
    config["config"]["feature_dim"] = 999  # a copy: the spec is unchanged
    assert spec.feature_map != config
    a, b = spec.make_feature_map(), spec.make_feature_map()
    assert a is not b and not a.built


def test_spec_round_trips_through_its_config():
    spec = AttentionSpec.create(
        "favor+", chunk_size=16, epsilon=1e-4, window_size=8, window_gamma=0.25, num_key_value_heads=2,
        rope_max_wavelength=10000,
    )  # fmt: skip
    assert AttentionSpec.from_config(spec.get_config()) == spec


def test_layer_from_a_spec_equals_the_layer_from_its_arguments():
    spec = AttentionSpec.create("elu", chunk_size=8, window_size=3)
    x = np.random.default_rng(0).normal(size=(2, 10, 16)).astype("float32")
    by_spec = LinearAttention(2, 8, spec=spec)
    by_args = LinearAttention(2, 8, feature_map="elu", chunk_size=8, window_size=3)
    by_spec(x, x, use_causal_mask=True)
    by_args(x, x, use_causal_mask=True)
    by_args.set_weights(by_spec.get_weights())
    np.testing.assert_array_equal(by_spec(x, x, use_causal_mask=True), by_args(x, x, use_causal_mask=True))
    # Equal configs, up to the auto-generated names of the layers and their maps.
    a, b = by_spec.get_config(), by_args.get_config()
    assert {k: v for k, v in a.items() if k not in ("name", "feature_map")} == {
        k: v for k, v in b.items() if k not in ("name", "feature_map")
    }
    assert a["feature_map"]["class_name"] == b["feature_map"]["class_name"] == "EluFeatureMap"


@pytest.mark.parametrize(
    "extra",
    [{"window_size": 4}, {"recurrence": "additive"}, {"feature_map": "relu"}, {"chunk_size": 8}, {"conv_size": 2}],
)
def test_a_spec_with_separate_arguments_raises(extra):
    spec = AttentionSpec.create("elu")
    with pytest.raises(ValueError, match="With `spec`, the spec holds the attention arguments"):
        LinearAttention(2, 8, spec=spec, **extra)


def test_spec_must_be_a_spec():
    with pytest.raises(ValueError, match="`spec` must be an AttentionSpec"):
        LinearTransformerDecoder(2, 32, spec={"window_size": 4})


def test_unknown_attention_argument_is_named():
    with pytest.raises(TypeError, match="Unknown attention arguments: \\['windowsize'\\]"):
        AttentionSpec.create("elu", windowsize=4)


@pytest.mark.parametrize("cls", [LinearAttention, LinearTransformerDecoder, LinearCausalLM])
def test_recurrence_and_shorthand_arguments_are_not_mixed(cls):
    lm = dict(vocabulary_size=20, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)
    args, kwargs = {LinearAttention: ((2, 8), {}), LinearTransformerDecoder: ((2, 32), {}), LinearCausalLM: ((), lm)}[
        cls
    ]
    with pytest.raises(ValueError, match="Pass either `recurrence` or the shorthand arguments"):
        cls(*args, recurrence="additive", window_size=4, **kwargs)


def test_the_encoder_refuses_a_causal_recurrence_by_name_or_spec():
    with pytest.raises(ValueError, match="this attention is not causal"):
        LinearTransformerEncoder(2, 32, recurrence=recurrences.get("window", window_size=4))
    with pytest.raises(ValueError, match="this attention is not causal"):
        LinearTransformerEncoder(2, 32, spec=AttentionSpec.create("elu", window_size=4))
    block = LinearTransformerEncoder(2, 32, recurrence="additive")
    assert block.get_config()["recurrence"]["class_name"] == "AdditiveRecurrence"


def test_unknown_recurrence_names_the_argument():
    with pytest.raises(ValueError, match="Unknown recurrence. Received: recurrence='lstm'"):
        LinearAttention(2, 8, recurrence="lstm")


def test_window_size_is_validated_by_the_window_recurrence_alone():
    with pytest.raises(ValueError, match="`window_size` must be a positive int"):
        AttentionSpec.create("elu", window_size=0)


def test_block_and_backbone_keep_a_non_default_epsilon_in_their_config():
    block = LinearTransformerDecoder(2, 32, epsilon=1e-3)
    assert block.get_config()["epsilon"] == 1e-3
    block.build((None, None, 16))
    assert block.attention.epsilon == 1e-3
    assert "epsilon" not in LinearTransformerDecoder(2, 32).get_config()  # default configs unchanged
    backbone = LinearBackbone(20, 1, 16, 2, 32, epsilon=1e-3)
    assert LinearBackbone.from_config(backbone.get_config()).decoder_blocks[0].attention.epsilon == 1e-3
