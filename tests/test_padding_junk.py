"""NaN and Inf at padded positions never reach real outputs, in every layer.

Masking with a product would not do: ``0 * NaN`` is NaN, and a padded key
reaches every real key through statistics over keys (the non-causal
stabilizer of favor+/favor_trig) or through sums over the sequence.
"""

import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn.layers import EfficientAttention, LinearAttention, LinearTransformerEncoder


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 10, 8)).astype("float32")  # [B, T, dim]
    mask = np.ones((2, 10), bool)
    mask[1, 6:] = False  # right padding on the second row
    junk = x.copy()
    junk[1, 6:8] = np.nan
    junk[1, 8:] = np.inf
    return x, junk, mask


def _map(name):
    if name in ("favor+", "favor_trig"):
        return feature_maps.get(name, num_features=8, seed=0)
    return feature_maps.get(name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", feature_maps.available())
def test_linear_attention_ignores_junk_in_padded_keys_and_values(name, causal):
    x, junk, mask = _inputs()
    layer = LinearAttention(2, 4, feature_map=_map(name))
    clean = np.asarray(layer(x, x, key_mask=mask, use_causal_mask=causal))
    dirty = np.asarray(layer(x, junk, key_mask=mask, use_causal_mask=causal))
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("projection", [None, "random", "learned"])
def test_efficient_attention_ignores_junk_in_padded_keys_and_values(projection):
    x, junk, mask = _inputs()
    kwargs = {} if projection is None else dict(projection=projection, projection_dim=4, max_length=16)
    layer = EfficientAttention(2, 4, seed=0, **kwargs)
    clean = np.asarray(layer(x, x, key_mask=mask))
    dirty = np.asarray(layer(x, junk, key_mask=mask))
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("name", ["elu", "favor+"])
def test_encoder_block_real_tokens_ignore_junk_tokens(name):
    x, junk, mask = _inputs()
    block = LinearTransformerEncoder(2, 16, feature_map=_map(name))
    clean = np.asarray(block(x, padding_mask=mask))
    dirty = np.asarray(block(junk, padding_mask=mask))
    np.testing.assert_array_equal(dirty[0], clean[0])
    np.testing.assert_array_equal(dirty[1, :6], clean[1, :6])
