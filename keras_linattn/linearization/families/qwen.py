"""Qwen 2 / 2.5 (`QwenBackbone`, alias `Qwen2Backbone`): Llama's layout with q/k/v biases and no output bias.

The student's ``use_bias`` covers every projection and feed-forward layer,
so the biases the teacher lacks (attention output, feed-forward) are set to
zero: the same function, a few zero weights more.
"""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_rms_decoder, rms_decoder_config
from keras_linattn.linearization.families.mistral import local_window

__all__ = ["copy_qwen", "qwen_config"]


def qwen_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `QwenBackbone` config (a sliding window as in `mistral.local_window`)."""
    sliding = config.get("sliding_window_size") if config.get("use_sliding_window_attention") else None
    return rms_decoder_config(
        config,
        backbone,
        use_bias=True,
        **local_window(sliding, window_size),
    )


def copy_qwen(copy, student, backbone):
    """Copies every Qwen weight; the student's output and feed-forward biases are zero."""
    copy_rms_decoder(copy, student, attention_bias="qkv", zero_feedforward_bias=True)


register(Family(name="qwen", backbones=("QwenBackbone",), config=qwen_config, weights=copy_qwen))
