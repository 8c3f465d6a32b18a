"""The defaults are the recommended attention (taylor + a short convolution); old configs keep their own values."""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import AttentionSpec, LinearAttention, LinearTransformerDecoder, LinearTransformerEncoder
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.tolerance import assert_close

# The arguments 0.3.0 built every attention with by default, given explicitly.
OLD_DEFAULTS = {"feature_map": "elu", "conv_size": None}
# What 0.3.0's `get_config` wrote for them: the elu map serialized, and the convolution recorded as off.
OLD_CONFIG_ENTRIES = {"feature_map": ("keras_linattn>EluFeatureMap", "EluFeatureMap"), "conv_size": None}
TINY_LM = dict(vocabulary_size=32, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)


def _entries(config):
    """The feature-map and convolution entries of a config, as `OLD_CONFIG_ENTRIES` states them."""
    feature_map = config["feature_map"]
    return {
        "feature_map": (feature_map["registered_name"], feature_map["class_name"]),
        "conv_size": config["conv_size"],
    }


def _is_taylor_with_conv(spec):
    return spec.feature_map["class_name"] == "TaylorFeatureMap" and spec.conv_size == 4


def test_spec_default_is_taylor_with_a_short_convolution():
    spec = AttentionSpec.create()
    assert _is_taylor_with_conv(spec)
    assert AttentionSpec.create(conv_size=None).conv_size is None  # None is an explicit choice, not "absent"


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearAttention(2, 8),
        lambda: LinearTransformerEncoder(num_heads=2, intermediate_dim=16),
        lambda: LinearTransformerDecoder(num_heads=2, intermediate_dim=16),
        lambda: LinearBackbone(**TINY_LM),
    ],
    ids=["attention", "encoder", "decoder", "backbone"],
)
def test_every_entry_point_defaults_to_taylor_with_conv_and_records_it(make):
    layer = make()
    assert _is_taylor_with_conv(layer.attention_spec)
    config = layer.get_config()
    assert config["feature_map"]["class_name"] == "TaylorFeatureMap" and config["conv_size"] == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda **a: LinearAttention(2, 8, **a),
        lambda **a: LinearTransformerEncoder(num_heads=2, intermediate_dim=16, **a),
        lambda **a: LinearTransformerDecoder(num_heads=2, intermediate_dim=16, **a),
        lambda **a: LinearBackbone(**TINY_LM, **a),
    ],
    ids=["attention", "encoder", "decoder", "backbone"],
)
def test_the_seed_map_is_one_argument_away_and_none_values_are_recorded(make):
    assert make(feature_map="elu").attention_spec.conv_size == 4  # the convolution stays unless turned off
    config = make(**OLD_DEFAULTS).get_config()
    assert _entries(config) == OLD_CONFIG_ENTRIES


def test_a_spec_with_the_default_feature_map_given_again_is_not_a_conflict():
    spec = AttentionSpec.create("elu", conv_size=None)
    assert LinearAttention(2, 8, spec=spec).attention_spec == spec
    with pytest.raises(ValueError, match=r"\['conv_size'\]"):
        LinearAttention(2, 8, spec=spec, conv_size=None)


def test_an_old_default_attention_config_loads_to_the_same_outputs(rng):
    """A config with 0.3.0's defaults written out (elu, no convolution) rebuilds that layer, not the new default."""
    old = LinearAttention(2, 8, **OLD_DEFAULTS)
    x = rng.standard_normal((2, 6, 16)).astype("float32")  # [B, T, dim]
    expected = np.asarray(old(x, x, use_causal_mask=True))
    config = old.get_config()
    assert _entries(config) == OLD_CONFIG_ENTRIES
    new = LinearAttention.from_config(config)
    new(x, x, use_causal_mask=True)
    new.set_weights(old.get_weights())  # same shapes: no convolution weights appeared
    assert [entry.name for entry in new.state_spec()] == ["S", "z"]
    # Same layer, same weights, same order of operations: equal up to one float32 rounding per reduction.
    assert_close(new(x, x, use_causal_mask=True), expected, n=16 + 8 + 6)


def test_an_old_default_lm_round_trips_through_a_keras_file(tmp_path, rng):
    keras.utils.set_random_seed(0)
    lm = LinearCausalLM(**TINY_LM, **OLD_DEFAULTS)
    ids = rng.integers(1, 32, (2, 5)).astype("int32")
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    expected = np.asarray(lm(inputs))
    config = lm.backbone.get_config()
    assert _entries(config) == OLD_CONFIG_ENTRIES
    path = str(tmp_path / "old_defaults.keras")
    lm.save(path)
    loaded = keras.saving.load_model(path)
    spec = loaded.backbone.attention_spec
    assert spec.feature_map["class_name"] == "EluFeatureMap" and spec.conv_size is None
    np.testing.assert_array_equal(np.asarray(loaded(inputs)), expected)  # the same graph and weights


def test_linearize_defaults_window_gamma_and_no_convolution():
    """The student keeps the teacher's function where the window covers T: no random convolution."""
    inputs = keras.Input((6, 8))
    attention = keras.layers.MultiHeadAttention(2, 4, name="att")
    teacher = keras.Model(inputs, attention(inputs, inputs, use_causal_mask=True))
    layer = keras_linattn.linearize(teacher, window_size=6).get_layer("att")
    assert layer.conv_size is None
    assert layer.attention_spec.recurrence["config"]["gamma"] == pytest.approx(0.9)
    assert keras_linattn.linearize(teacher, window_size=6, conv_size=2).get_layer("att").conv_size == 2


@pytest.mark.tf_only("traces with an unknown length through tf.function(input_signature=...)")
def test_distillation_of_the_default_layer_takes_a_length_known_only_at_run_time(rng):
    """`distill_attention` compares weights after the short convolution, whose output length is not static
    in a traced function: the reference weights read the length at run time."""
    import tensorflow as tf

    from keras_linattn.ops import reference

    spec = tf.TensorSpec((None, None, 2, 4), tf.float32)  # [B, T, H, D], T unknown
    q, k = (rng.standard_normal((1, 5, 2, 4)).astype("float32") for _ in range(2))
    for weights in (reference.softmax_attention_weights, reference.kernel_attention_weights):
        traced = tf.function(lambda a, b, weights=weights: weights(a, b, causal=True), input_signature=[spec, spec])
        # Positive features for the kernel weights (exp), raw ones for softmax: the same ops in graph and eager.
        a, b = (np.exp(q), np.exp(k)) if weights is reference.kernel_attention_weights else (q, k)
        assert_close(traced(a, b), weights(a, b, causal=True), n=4 + 5, paths=2)


@pytest.mark.parametrize("method", ["depthwise", "shifted"])
def test_the_short_convolution_of_an_empty_batch_is_empty(method):
    """The default layer's convolution on a batch of 0 (TensorFlow's depthwise kernel returned the padded length)."""
    from keras_linattn.ops import short_conv

    x = np.zeros((0, 3, 2, 4), "float32")  # [B = 0, T, H, D]
    y, buffer = short_conv.causal_conv(x, np.ones((4, 2, 4), "float32"), return_buffer=True, method=method)
    assert tuple(y.shape) == (0, 3, 2, 4) and tuple(buffer.shape) == (0, 3, 2, 4)
