"""`LinearBackbone` arguments for pretrained families: `layer_attention` (SmolLM3), `embedding_scale` (Gemma)."""

import json

import keras
import numpy as np
import pytest

from keras_linattn.models import LinearBackbone, LinearCausalLM
from keras_linattn.recurrences import WindowRecurrence, registry
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

ARGS = dict(vocabulary_size=40, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=24, chunk_size=4)


def _lm(**kwargs):
    keras.utils.set_random_seed(0)
    return LinearCausalLM(**ARGS, feature_map="hedgehog", window_size=3, rope_max_wavelength=1e4, **kwargs)


def test_a_layer_without_rope_steps_like_the_parallel_pass_and_round_trips():
    lm = _lm(layer_attention=[{}, {"rope_max_wavelength": None}])
    blocks = lm.backbone.decoder_blocks
    assert [b.attention.rope_max_wavelength for b in blocks] == [1e4, None]
    ids = np.random.default_rng(0).integers(0, 40, (2, 9)).astype("int32")
    parallel = np.asarray(lm(ids))
    state = lm.get_initial_state(2)
    for t in range(9):
        logits, state = lm.step(ids[:, t], state)
        assert_close(np.asarray(logits), parallel[:, t], paths=8, n=16)
    config = json.loads(json.dumps(lm.backbone.get_config()))
    assert config["layer_attention"] == [{}, {"rope_max_wavelength": None}]
    again = LinearBackbone.from_config(config)
    again.set_weights(lm.backbone.get_weights())
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(lm.backbone(ids)))
    # RoPE in both layers is another function.
    assert np.abs(np.asarray(_lm()(ids)) - parallel).max() > 1e-4


def test_layer_attention_absent_from_configs_without_it_and_checked():
    assert "layer_attention" not in _lm().backbone.get_config()
    with pytest.raises(ValueError, match="list of 2 dicts.*Received: layer_attention=\\[\\{\\}\\]"):
        _lm(layer_attention=[{}])
    with pytest.raises(ValueError, match="Received: \\{'window_size': 2\\}"):
        _lm(layer_attention=[{}, {"window_size": 2}])


def test_embedding_scale_multiplies_the_input_embeddings_not_the_tied_head():
    ids = np.random.default_rng(1).integers(0, 40, (1, 5)).astype("int32")
    keras.utils.set_random_seed(0)
    scaled = LinearBackbone(**ARGS, embedding_scale=4.0)
    keras.utils.set_random_seed(0)
    plain = LinearBackbone(**ARGS)
    plain.set_weights(scaled.get_weights())
    # Scaling the table by 4 in the plain backbone gives the same hidden states.
    table = np.asarray(plain.token_embedding.embeddings)
    plain.token_embedding.embeddings.assign(table * 4.0)
    assert_close(np.asarray(scaled(ids)), np.asarray(plain(ids)), paths=8, n=16)
    config = json.loads(json.dumps(scaled.get_config()))
    assert config["embedding_scale"] == 4.0 and "embedding_scale" not in LinearBackbone(**ARGS).get_config()
    np.testing.assert_array_equal(np.asarray(scaled.token_embedding.embeddings), table)  # the head's table


def test_post_norms_are_built_last_and_round_trip():
    lm = _lm(
        post_norms=True,
        parallel_residual=True,
        layer_attention=[{}, {"recurrence": registry.serialize(WindowRecurrence(2))}],
    )
    block = lm.backbone.decoder_blocks[0]
    # LayerNorm: gamma and beta each.
    names = [w.path.split("/")[-2] for w in block.weights[-4:]]
    assert names == ["post_attention_norm"] * 2 + ["post_feedforward_norm"] * 2
    assert lm.backbone.decoder_blocks[1].attention.recurrence.window_size == 2
    config = json.loads(json.dumps(lm.backbone.get_config()))
    assert config["post_norms"] is True and config["parallel_residual"] is True
    assert not {"post_norms", "parallel_residual"} & set(_lm().backbone.get_config())
    ids = np.random.default_rng(2).integers(0, 40, (1, 6)).astype("int32")
    again = LinearBackbone.from_config(config)
    again.set_weights(lm.backbone.get_weights())
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(lm.backbone(ids)))
