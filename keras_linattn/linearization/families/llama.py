"""Llama 2 and Llama 3 (`LlamaBackbone`, `Llama3Backbone`): RMSNorm, SwiGLU, RoPE, GQA, no biases."""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_rms_decoder

__all__ = ["copy_llama", "llama_config", "rope_frequency_adjustment"]


def llama_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `LlamaBackbone` / `Llama3Backbone` config.

    Llama 3.1-3.3's RoPE scaling (keras-hub's ``rope_frequency_adjustment_factor``
    and its three companions) becomes ``rope_frequency_adjustment``.
    """
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        # keras-hub's Llama `get_config` omits `tie_word_embeddings` (Llama 3.2 ties them): the embedding
        # layer knows.
        tie_embeddings=bool(config.get("tie_word_embeddings", backbone.token_embedding.tie_weights)),
        activation="silu",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        rope_max_wavelength=config.get("rope_max_wavelength", 10000),
        # keras-hub's Llama rotary embedding does not apply `rope_position_scaling_factor`.
        rope_scaling_factor=1.0,
        rope_frequency_adjustment=rope_frequency_adjustment(config),
    )


def rope_frequency_adjustment(config):
    """``(factor, low, high, pretraining length)`` of a keras-hub Llama-style config, or None without one."""
    keys = (
        "rope_frequency_adjustment_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_pretraining_sequence_length",
    )
    if config.get(keys[0]) is None:
        return None
    return tuple(config[key] for key in keys)


def copy_llama(copy, student, backbone):
    """Copies every Llama weight into the student (`copy_rms_decoder`)."""
    copy_rms_decoder(copy, student)


register(Family(name="llama", backbones=("LlamaBackbone", "Llama3Backbone"), config=llama_config, weights=copy_llama))
