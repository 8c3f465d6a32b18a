"""NaN and Inf at padded positions never reach real outputs, in every layer.

Masking with a product would not do: ``0 * NaN`` is NaN, and a padded key
reaches every real key through statistics over keys (the non-causal
stabilizer of favor+/favor_trig) or through sums over the sequence.
"""

import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn.layers import EfficientAttention, LinearAttention, LinearTransformerEncoder
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


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


def test_a_masked_step_keeps_the_state_even_with_nan_key_and_value():
    from keras_linattn import ops as la

    rng = np.random.default_rng(4)
    state = la.core._zero_state(2, 1, 3, 2)
    state = (state[0] + 1.0, state[1] + 1.0)
    q = rng.uniform(0.1, 1, (2, 1, 3)).astype("float32")
    k = np.full((2, 1, 3), np.nan, "float32")
    v = np.full((2, 1, 2), np.inf, "float32")
    out, (s, z) = la.linear_attention_step(q, k, v, state, key_mask_t=np.array([False, False]))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(state[0]))
    np.testing.assert_array_equal(np.asarray(z), np.asarray(state[1]))
    assert np.isfinite(np.asarray(out)).all()


def _float_and_bool_masks():
    """A non-0/1 float mask and the boolean mask it means (nonzero = real key)."""
    values = np.array([[1.0, 0.5, 0.0, 2.0, 0.0, 1.0], [0.25, 0.0, 3.0, 1.0, 1.0, 0.0]], "float32")
    return values, values != 0


@pytest.mark.parametrize("causal", [False, True])
def test_float_masks_mean_nonzero_is_real_in_the_ops_and_the_oracle(causal):
    from keras_linattn import ops as la

    rng = np.random.default_rng(5)
    q = rng.uniform(0.1, 1, (2, 6, 2, 3)).astype("float32")
    k = rng.uniform(0.1, 1, (2, 6, 2, 3)).astype("float32")
    v = rng.normal(size=(2, 6, 2, 4)).astype("float32")
    as_float, as_bool = _float_and_bool_masks()
    expected = np.asarray(la.linear_attention(q, k, v, causal=causal, key_mask=as_bool, chunk_size=4))
    got = np.asarray(la.linear_attention(q, k, v, causal=causal, key_mask=as_float, chunk_size=4))
    np.testing.assert_array_equal(got, expected)
    # The float64 oracle reads the float mask the same way.
    oracle = np.asarray(la.kernel_attention_reference(q, k, v, causal=causal, key_mask=as_float))
    s, c = 6, 3
    assert_close(expected, oracle, n=s + c, what="oracle")  # S keys + C features
    # Stepping with the float mask gives the same outputs.
    state = la.core._zero_state(2, 2, 3, 4)
    if causal:
        steps = []
        for t in range(6):
            out_t, state = la.linear_attention_step(q[:, t], k[:, t], v[:, t], state, key_mask_t=as_float[:, t])
            steps.append(np.asarray(out_t))
        # Two float32 computations (recurrent, chunked): paths=2.
        assert_close(np.stack(steps, axis=1), expected, n=s + c, paths=2, what="steps")  # S keys + C features


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearAttention(2, 4),
        lambda: EfficientAttention(2, 4, seed=0),
        lambda: EfficientAttention(2, 4, projection="learned", projection_dim=3, max_length=8, seed=0),
    ],
    ids=["LinearAttention", "EfficientAttention", "EfficientAttention-learned"],
)
def test_float_masks_mean_nonzero_is_real_in_the_layers(make):
    x = np.random.default_rng(6).normal(size=(2, 6, 8)).astype("float32")
    as_float, as_bool = _float_and_bool_masks()
    layer = make()
    np.testing.assert_array_equal(np.asarray(layer(x, x, key_mask=as_float)), np.asarray(layer(x, x, key_mask=as_bool)))


def test_causal_lm_reads_a_float_padding_mask_as_nonzero_is_real():
    from keras_linattn.models import LinearCausalLM

    lm = LinearCausalLM(
        vocabulary_size=11, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, max_sequence_length=8
    )
    tokens = np.array([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]], "int32")
    as_bool = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
    as_float = np.where(as_bool, 0.5, 0.0).astype("float32")  # learned positions count real tokens
    np.testing.assert_array_equal(
        np.asarray(lm(tokens, padding_mask=as_float)), np.asarray(lm(tokens, padding_mask=as_bool))
    )
