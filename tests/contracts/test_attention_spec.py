"""One attention config, validated once and carried by the LM, the blocks and the layer."""

import pytest

from keras_linattn import recurrences
from keras_linattn.layers import LinearAttention, LinearTransformerDecoder, LinearTransformerEncoder
from keras_linattn.models import LinearCausalLM


def test_round2_arguments_and_recurrence_give_the_same_layer_config():
    old = LinearAttention(2, 8, decay="scalar", conv_size=3)
    new = LinearAttention(2, 8, recurrence=recurrences.get("decay", gate="scalar"), conv_size=3)
    for key in ("recurrence", "conv_size"):
        assert old.get_config()[key] == new.get_config()[key]
    assert [e.name for e in old.state_spec()] == [e.name for e in new.state_spec()]


def test_the_lm_hands_one_config_to_every_block_and_layer():
    lm = LinearCausalLM(20, 2, 16, 2, 32, update="delta", normalize=False, decay="fixed", conv_size=2)
    expected = lm.backbone.get_config()["recurrence"]  # the LM is a keras-hub task over its backbone
    assert expected["class_name"] == "DeltaRecurrence" and expected["config"] == {"gate": "fixed"}
    for block in lm.decoder_blocks:
        assert block.get_config()["recurrence"] == expected and block.get_config()["conv_size"] == 2
        layer = block.attention
        assert layer.get_config()["recurrence"] == expected and layer.conv_size == 2
        # Each layer owns its recurrence (bound to its own weights).
        assert layer.recurrence.layer is layer
    assert lm.decoder_blocks[0].attention.recurrence is not lm.decoder_blocks[1].attention.recurrence


@pytest.mark.parametrize("cls", [LinearAttention, LinearTransformerDecoder, LinearCausalLM])
def test_recurrence_and_round2_arguments_are_not_mixed(cls):
    args = {LinearAttention: (2, 8), LinearTransformerDecoder: (2, 32), LinearCausalLM: (20, 1, 16, 2, 32)}[cls]
    with pytest.raises(ValueError, match="Pass either `recurrence` or the round-2 arguments"):
        cls(*args, recurrence="additive", window_size=4)


def test_the_encoder_refuses_a_causal_recurrence_by_name():
    with pytest.raises(ValueError, match="this attention is not causal"):
        LinearTransformerEncoder(2, 32, recurrence=recurrences.get("window", window_size=4))
    block = LinearTransformerEncoder(2, 32, recurrence="additive")
    assert block.get_config()["recurrence"]["class_name"] == "AdditiveRecurrence"


def test_unknown_recurrence_names_the_argument():
    with pytest.raises(ValueError, match="Unknown recurrence. Received: recurrence='lstm'"):
        LinearAttention(2, 8, recurrence="lstm")
