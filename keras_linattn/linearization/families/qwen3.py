"""Qwen 3 (`Qwen3Backbone`): Llama's layout with a per-head RMSNorm on queries and keys, a head dim of its own."""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_rms_decoder, rms_decoder_config

__all__ = ["copy_qwen3", "qwen3_config"]


def qwen3_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `Qwen3Backbone` config.

    Raises:
        TypeError: for a sliding window (keras-hub's Qwen 3 converter reads
            ``sliding_window_size`` but its attention applies it only when
            asked; not mapped).
    """
    layer = backbone.get_layer("transformer_layer_0")._self_attention_layer
    if getattr(layer, "use_sliding_window_attention", False):
        raise TypeError(
            "Qwen 3 sliding-window attention is not mapped. "
            f"Received: sliding_window_size={config.get('sliding_window_size')}"
        )
    return rms_decoder_config(
        config,
        backbone,
        key_dim=config["head_dim"],
        # keras-hub's Qwen 3 decoder does not pass its epsilon to the attention's q/k norms (1e-5 there):
        # the teacher layer's own value.
        qk_norm_epsilon=layer._query_dense_layer_norm.epsilon,
    )


def copy_qwen3(copy, student, backbone):
    """Copies every Qwen 3 weight: the Llama layout plus each layer's query and key norms."""
    copy_rms_decoder(copy, student)
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}/self_attention"
        copy(block.attention.query_norm.scale, f"{p}/query_dense_layernorm/scale")
        copy(block.attention.key_norm.scale, f"{p}/key_dense_layernorm/scale")


register(Family(name="qwen3", backbones=("Qwen3Backbone",), config=qwen3_config, weights=copy_qwen3))
