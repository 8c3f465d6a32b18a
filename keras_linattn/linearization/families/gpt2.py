"""GPT-2 (`GPT2Backbone`): learned positions, LayerNorm, GELU (tanh form), biases everywhere, tied head."""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_attention

__all__ = ["copy_gpt2", "gpt2_config"]


def gpt2_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `GPT2Backbone` config."""
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=config["max_sequence_length"],
        tie_embeddings=True,
        activation="gelu_approximate",
        layer_norm_epsilon=1e-5,
    )


def copy_gpt2(copy, student, backbone):
    """Copies every `GPT2Backbone` weight into the student."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    copy(student.position_embedding.embeddings, "position_embedding/embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        copy_attention(copy, block.attention, f"{p}/self_attention", bias=True)
        for ours, theirs in (
            (block._attention_norm, "self_attention_layer_norm"),
            (block._ffn_norm, "feedforward_layer_norm"),
        ):
            copy(ours.gamma, f"{p}/{theirs}/gamma")
            copy(ours.beta, f"{p}/{theirs}/beta")
        for ours, theirs in (
            (block._ffn_intermediate, "feedforward_intermediate_dense"),
            (block._ffn_output, "feedforward_output_dense"),
        ):
            copy(ours.kernel, f"{p}/{theirs}/kernel")
            copy(ours.bias, f"{p}/{theirs}/bias")
    copy(student.final_norm.gamma, "layer_norm/gamma")
    copy(student.final_norm.beta, "layer_norm/beta")


register(Family(name="gpt2", backbones=("GPT2Backbone",), config=gpt2_config, weights=copy_gpt2))
