"""Qwen1.5-MoE / Qwen 2 MoE (`QwenMoeBackbone`): Qwen 2's layout with top-k experts and a shared expert.

Sparse layers become `keras_linattn.layers.MixtureOfExperts` with the
shared expert and its sigmoid gate; the top-k weights are renormalized
only with ``norm_top_k_prob``; layers in ``mlp_only_layers`` (or off
``decoder_sparse_step``) keep a dense SwiGLU feed-forward of
``intermediate_dim``. q/k/v biases as in `qwen`.
"""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import rms_decoder_config
from keras_linattn.linearization.families._moe import copy_moe_decoder, layer_moe
from keras_linattn.linearization.families.mistral import local_window

__all__ = ["copy_qwen_moe", "qwen_moe_config"]


def qwen_moe_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `QwenMoeBackbone` config (a sliding window as in `mistral.local_window`)."""
    sliding = config.get("sliding_window_size") if config.get("use_sliding_window_attention") else None
    return rms_decoder_config(
        config,
        backbone,
        use_bias=True,
        moe=layer_moe(
            backbone,
            config["moe_intermediate_dim"],
            normalize_top_k=config["norm_top_k_prob"],
            shared_expert_dim=config["shared_expert_intermediate_dim"],
        ),
        **local_window(sliding, window_size),
    )


def copy_qwen_moe(copy, student, backbone):
    """Copies every Qwen MoE weight; the student's attention output bias (and dense layers' biases) are zero."""
    copy_moe_decoder(copy, student, backbone, attention_bias="qkv")


register(Family(name="qwen_moe", backbones=("QwenMoeBackbone",), config=qwen_moe_config, weights=copy_qwen_moe))
