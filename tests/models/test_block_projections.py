"""Each block of a seeded `LinearCausalLM` draws its own random projection, reproducibly from the one seed.

Before, every block copied the template map with its seed, so all blocks
held the same matrix (and redrew the same one): a 3-block favor+ LM had one
projection, not three.
"""

import keras
import numpy as np
import pytest

from keras_linattn.callbacks import random_feature_layers
from keras_linattn.feature_maps.favor import FavorPlusFeatureMap
from keras_linattn.feature_maps.favor_trig import FavorTrigFeatureMap
from keras_linattn.models.causal_lm import LinearCausalLM

MAPS = {"favor+": FavorPlusFeatureMap, "favor_trig": FavorTrigFeatureMap}


def _lm(map_name, seed, global_seed=0, **kwargs):
    keras.utils.set_random_seed(global_seed)  # the projections must not depend on it
    return LinearCausalLM(
        vocabulary_size=16,
        num_layers=3,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=16,
        feature_map=MAPS[map_name](num_features=8, seed=seed),
        **kwargs,
    )


def _projections(lm):
    return [np.array(block.attention.feature_map.projection.numpy()) for block in lm.decoder_blocks]


def _redraw(lm):
    """What `RedrawRandomFeatures` does at a redraw step."""
    for layer in random_feature_layers(lm):
        if layer.built:
            layer.redraw()


def _assert_pairwise_distinct(projections):
    for i in range(len(projections)):
        for j in range(i + 1, len(projections)):
            assert not np.allclose(projections[i], projections[j]), f"blocks {i} and {j} share a projection"


@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_blocks_draw_distinct_projections_reproducibly(map_name):
    first = _lm(map_name, seed=7, global_seed=1)
    second = _lm(map_name, seed=7, global_seed=2)
    _assert_pairwise_distinct(_projections(first))
    for a, b in zip(_projections(first), _projections(second), strict=True):
        np.testing.assert_array_equal(a, b)  # a function of the map's seed only
    # Block 0 keeps the template's seed: a lone map built with it draws the same matrix.
    lone = MAPS[map_name](num_features=8, seed=7)
    lone.build((None, None, 2, 8))
    np.testing.assert_array_equal(_projections(first)[0], lone.projection.numpy())
    # Another seed gives other matrices in every block.
    other = _lm(map_name, seed=8)
    for a, b in zip(_projections(first), _projections(other), strict=True):
        assert not np.allclose(a, b)


@pytest.mark.parametrize("map_name", sorted(MAPS))
def test_redraws_stay_distinct_and_reproducible(map_name):
    first, second = _lm(map_name, seed=7), _lm(map_name, seed=7)
    initial = _projections(first)
    for _ in range(2):
        _redraw(first)
        _redraw(second)
        redrawn = _projections(first)
        _assert_pairwise_distinct(redrawn)
        for a, b in zip(redrawn, _projections(second), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(redrawn, initial, strict=True):
            assert not np.allclose(a, b)
    indices = [int(block.attention.feature_map.draw_index.numpy()) for block in first.decoder_blocks]
    assert indices == [2, 2, 2]


def test_from_config_rebuilds_the_same_block_projections():
    lm = _lm("favor+", seed=5)
    rebuilt = LinearCausalLM.from_config(lm.get_config())
    for a, b in zip(_projections(lm), _projections(rebuilt), strict=True):
        np.testing.assert_array_equal(a, b)


def test_seeded_trainable_map_blocks_start_from_distinct_weights():
    from keras_linattn import feature_maps

    def weights(global_seed):
        keras.utils.set_random_seed(global_seed)
        lm = LinearCausalLM(
            vocabulary_size=16,
            num_layers=3,
            hidden_dim=16,
            num_heads=2,
            intermediate_dim=16,
            feature_map=feature_maps.get("glu", seed=3),
        )
        return [[np.array(w.numpy()) for w in block.attention.feature_map.weights] for block in lm.decoder_blocks]

    first, second = weights(1), weights(2)
    for i in range(3):
        for j in range(i + 1, 3):
            same = [
                np.allclose(x, y) for x, y in zip(first[i], first[j], strict=True) if np.std(x) > 0
            ]  # not constant inits
            assert same and not any(same), f"blocks {i} and {j} start from the same weights"
    for a, b in zip(first, second, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
