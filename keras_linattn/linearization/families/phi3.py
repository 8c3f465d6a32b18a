"""Phi-3 (`Phi3Backbone`): Llama's architecture under its own layer names, an untied head.

Phi-3's "su" RoPE scaling (the 128k-context checkpoints: one factor per
frequency, short and long) raises TypeError naming it.
"""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_attention

__all__ = ["copy_phi3", "phi3_config"]


def phi3_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `Phi3Backbone` config.

    Raises:
        TypeError: for ``rope_scaling_type="su"`` (not mapped).
    """
    if config.get("rope_scaling_type") is not None:
        raise TypeError(
            "Phi-3's su-scaled RoPE (rope_scaling_type) is not mapped. "
            f"Received: rope_scaling_type={config['rope_scaling_type']!r}"
        )
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=bool(backbone.token_embedding.tie_weights),
        activation="silu",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        rope_max_wavelength=config.get("rope_max_wavelength", 10000),
    )


def copy_phi3(copy, student, backbone):
    """Copies every Phi-3 weight."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        copy_attention(copy, block.attention, f"{p}/attention", bias=False)
        copy(block._attention_norm.scale, f"{p}/pre_attention_layernorm/scale")
        copy(block._ffn_norm.scale, f"{p}/post_attention_layernorm/scale")
        for ours, theirs in (
            (block._ffn_gate, "feedforward_gate_dense"),
            (block._ffn_intermediate, "feedforward_intermediate_dense"),
            (block._ffn_output, "feedforward_output_dense"),
        ):
            copy(ours.kernel, f"{p}/{theirs}/kernel")
    copy(student.final_norm.scale, "sequence_output_layernorm/scale")


register(Family(name="phi3", backbones=("Phi3Backbone",), config=phi3_config, weights=copy_phi3, attention="attention"))
