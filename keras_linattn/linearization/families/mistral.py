"""Mistral (`MistralBackbone`): Llama's layout, an untied head, an optional sliding window on every layer."""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import copy_rms_decoder

__all__ = ["copy_mistral", "local_window", "mistral_config"]


def local_window(sliding_window, window_size):
    """The attention arguments for a teacher whose layers attend to the last `sliding_window` tokens only.

    A teacher window no longer than the student's (`window_size`) is kept as
    it is: exact softmax over the last `sliding_window` tokens, without
    linear terms (``linear_weight=0``). A longer one, or none, is linearized
    like global attention (the student's window plus linear attention).

    Returns:
        ``{}`` or ``{"window_size": sliding_window, "linear_weight": 0.0}``.
    """
    if sliding_window is None or window_size is None or sliding_window > window_size:
        return {}
    return {"window_size": int(sliding_window), "linear_weight": 0.0}


def mistral_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `MistralBackbone` config."""
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        key_dim=config.get("head_dim"),
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
        rope_scaling_factor=config.get("rope_scaling_factor", 1.0),
        **local_window(config.get("sliding_window"), window_size),
    )


def copy_mistral(copy, student, backbone):
    """Copies every Mistral weight (`copy_rms_decoder`)."""
    copy_rms_decoder(copy, student)


register(Family(name="mistral", backbones=("MistralBackbone",), config=mistral_config, weights=copy_mistral))
