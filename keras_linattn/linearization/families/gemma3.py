"""Gemma 3 (`Gemma3Backbone`, text): Gemma plus q/k norms, post norms and local/global layers with two RoPE bases.

- Five local layers (sliding window, RoPE base 10,000) then one global
  layer (base 1,000,000), as keras-hub builds them (``i % 6 < 5`` is
  local): per-layer arguments in the student's ``layer_attention``.
- A local window no longer than the student's stays exact softmax over the
  same window (the window alone, ``linear_weight=0``); a longer one is
  linearized like a global layer, with its own RoPE base.
- Norms multiply by ``1 + scale`` (the student's norms get that scale),
  the q/k norms included; post-attention and post-feed-forward norms are
  the student's ``post_norms``.
- Kernels ``[heads, dim, D]`` are transposed, the embeddings scaled by
  ``sqrt(hidden_dim)``.

Soft caps, a query scale other than ``1 / sqrt(head_dim)``, bidirectional
attention, embedding models and a vision encoder raise TypeError naming the key.
"""

import math

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families.gemma import _heads_first, _one_plus
from keras_linattn.recurrences import WindowRecurrence, registry

__all__ = ["copy_gemma3", "gemma3_config"]

# Keys the student does not reproduce, with the value it does.
_MAPPED = {
    "attention_logit_soft_cap": None,
    "final_logit_soft_cap": None,
    "query_head_dim_normalize": True,
    "use_query_key_norm": True,
    "use_post_ffw_norm": True,
    "use_post_attention_norm": True,
    "use_bidirectional_attention": False,
    "is_embedding_model": False,
    "vision_encoder": None,
}


def _layer_attention(config, window_size):
    """Each layer's RoPE base and scaling, and a local layer's own window where it fits in the student's."""
    local_window = config["sliding_window_size"]
    exact = window_size is not None and local_window <= window_size
    layers = []
    for i in range(config["num_layers"]):
        if config["use_sliding_window_attention"] and i % 6 < 5:
            entry = {"rope_max_wavelength": 10_000.0, "rope_scaling_factor": config["local_rope_scaling_factor"]}
            if exact:
                window = WindowRecurrence(local_window, linear_weight=0.0)
                entry["recurrence"] = registry.serialize(window)
        else:
            entry = {"rope_max_wavelength": 1_000_000.0, "rope_scaling_factor": config["global_rope_scaling_factor"]}
        layers.append(entry)
    return layers


def gemma3_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a text `Gemma3Backbone` config.

    Raises:
        TypeError: for a key in `_MAPPED` with another value (named).
    """
    for key, mapped in _MAPPED.items():
        if config.get(key, mapped) != mapped:
            raise TypeError(f"Gemma 3's `{key}` is not mapped. Received: {key}={config[key]!r}")
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        key_dim=config["head_dim"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=True,
        activation="gelu_approximate",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        post_norms=True,
        embedding_scale=math.sqrt(config["hidden_dim"]),
        qk_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        rope_max_wavelength=1_000_000.0,
        layer_attention=_layer_attention(config, window_size),
    )


def copy_gemma3(copy, student, backbone):
    """Copies every Gemma 3 text weight (kernels transposed, norm scales as ``1 + scale``)."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"decoder_block_{i}"
        attention = block.attention
        for name, dense in (("query", attention.query_dense), ("key", attention.key_dense)):
            copy(dense.kernel, f"{p}/attention/{name}/kernel", _heads_first)
        copy(attention.value_dense.kernel, f"{p}/attention/value/kernel", _heads_first)
        copy(attention.output_dense.kernel, f"{p}/attention/attention_output/kernel")
        copy(attention.query_norm.scale, f"{p}/attention/query_norm/scale", _one_plus)
        copy(attention.key_norm.scale, f"{p}/attention/key_norm/scale", _one_plus)
        for ours, theirs in (
            (block._attention_norm, "pre_attention_norm"),
            (block._attention_post_norm, "post_attention_norm"),
            (block._ffn_norm, "pre_ffw_norm"),
            (block._ffn_post_norm, "post_ffw_norm"),
        ):
            copy(ours.scale, f"{p}/{theirs}/scale", _one_plus)
        copy(block._ffn_gate.kernel, f"{p}/ffw_gating/kernel")
        copy(block._ffn_intermediate.kernel, f"{p}/ffw_gating_2/kernel")
        copy(block._ffn_output.kernel, f"{p}/ffw_linear/kernel")
    copy(student.final_norm.scale, "final_normalization/scale", _one_plus)


register(
    Family(
        name="gemma3", backbones=("Gemma3Backbone",), config=gemma3_config, weights=copy_gemma3, attention="attention"
    )
)
