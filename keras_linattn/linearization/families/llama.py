"""Llama 2 and Llama 3 (`LlamaBackbone`, `Llama3Backbone`): RMSNorm, SwiGLU, RoPE, GQA, no biases."""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_rms_decoder, rms_decoder_config

__all__ = ["copy_llama", "llama_config", "rope_frequency_adjustment"]


def llama_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `LlamaBackbone` / `Llama3Backbone` config.

    Llama 3.1-3.3's RoPE scaling (keras-hub's ``rope_frequency_adjustment_factor``
    and its three companions) becomes ``rope_frequency_adjustment``.
    """
    return rms_decoder_config(
        config,
        backbone,
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
