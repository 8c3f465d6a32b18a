"""Qwen 3 MoE (`Qwen3MoeBackbone`): Qwen 3's layout (per-head q/k RMSNorm, own head dim) with top-k experts.

Sparse layers become `keras_linattn.layers.MixtureOfExperts` (no shared
expert; the top-k weights renormalized with ``norm_top_k_prob``); dense
layers (``mlp_only_layers``) keep a SwiGLU feed-forward.
"""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import rms_decoder_config
from keras_linattn.linearization.families._moe import copy_moe_decoder, layer_moe
from keras_linattn.linearization.families.mistral import local_window

__all__ = ["copy_qwen3_moe", "qwen3_moe_config"]


def qwen3_moe_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `Qwen3MoeBackbone` config.

    keras-hub's Qwen 3 MoE attention applies ``sliding_window_size``
    whenever it is set (the published configs set it to null): a window
    within the student's stays exact softmax (`mistral.local_window`).
    """
    attention = backbone.transformer_layers[0]._self_attention_layer
    return rms_decoder_config(
        config,
        backbone,
        key_dim=config["head_dim"],
        qk_norm_epsilon=attention._query_dense_layer_norm.epsilon,
        moe=layer_moe(backbone, config["moe_intermediate_dim"], normalize_top_k=config["norm_top_k_prob"]),
        **local_window(config.get("sliding_window_size"), window_size),
    )


def copy_qwen3_moe(copy, student, backbone):
    """Copies every Qwen 3 MoE weight, the query and key norms included."""
    copy_moe_decoder(copy, student, backbone, qk_norm=True)


register(Family(name="qwen3_moe", backbones=("Qwen3MoeBackbone",), config=qwen3_moe_config, weights=copy_qwen3_moe))
