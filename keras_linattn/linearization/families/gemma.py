"""Gemma (`GemmaBackbone`): embedding scale, RMSNorm with ``(1 + scale)``, GeGLU, MQA, ``[H, dim, D]`` kernels.

- The token embeddings are multiplied by ``sqrt(hidden_dim)``
  (`LinearBackbone(embedding_scale=...)`); the tied head reads the table.
- Gemma's RMSNorm multiplies by ``1 + scale``: the student's norm gets the
  scale ``1 + scale`` (the float32 sum the teacher forms itself).
- The query, key and value kernels are laid out ``[heads, dim, D]``: they
  are transposed to ``[dim, heads, D]``.
- keras-hub interleaves the halves of the rotated queries and keys after
  RoPE; both get the same permutation of D, so every dot product, and with
  it the attention, is unchanged: the student rotates in halves.

Gemma 2's additions (logit soft caps, post-attention and post-feed-forward
norms, sliding-window layers, the query scale of ``query_pre_attn_scalar``)
raise TypeError naming the key.
"""

import math

from keras_linattn.linearization.families import Family, register

__all__ = ["copy_gemma", "gemma_config"]

# Gemma 2's configuration keys the student does not reproduce, with the value that is Gemma 1's.
_GEMMA_1 = {
    "attention_logit_soft_cap": None,
    "final_logit_soft_cap": None,
    "use_post_ffw_norm": False,
    "use_post_attention_norm": False,
    "use_sliding_window_attention": False,
    "query_head_dim_normalize": True,
}


def gemma_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a (Gemma 1-style) `GemmaBackbone` config.

    Raises:
        TypeError: for Gemma 2's soft caps, post norms, sliding window or
            query scale (named with the value received).
    """
    for key, gemma_1 in _GEMMA_1.items():
        if config.get(key, gemma_1) != gemma_1:
            raise TypeError(f"Gemma's `{key}` (Gemma 2) is not mapped. Received: {key}={config[key]!r}")
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_query_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        key_dim=config["head_dim"],
        # keras-hub's `intermediate_dim` is twice each GeGLU branch's width.
        intermediate_dim=config["intermediate_dim"] // 2,
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=True,
        activation="gelu_approximate",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        # keras-hub's Gemma attention fixes its RoPE base.
        rope_max_wavelength=10000.0,
        embedding_scale=math.sqrt(config["hidden_dim"]),
    )


def _heads_first(kernel):
    """``[heads, dim, D] -> [dim, heads, D]``."""
    return kernel.transpose(1, 0, 2)


def _one_plus(scale):
    return 1.0 + scale


def copy_gemma(copy, student, backbone):
    """Copies every Gemma weight (kernels transposed, norm scales as ``1 + scale``)."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"decoder_block_{i}"
        attention = block.attention
        copy(attention.query_dense.kernel, f"{p}/attention/query/kernel", _heads_first)
        copy(attention.key_dense.kernel, f"{p}/attention/key/kernel", _heads_first)
        copy(attention.value_dense.kernel, f"{p}/attention/value/kernel", _heads_first)
        copy(attention.output_dense.kernel, f"{p}/attention/attention_output/kernel")
        copy(block._attention_norm.scale, f"{p}/pre_attention_norm/scale", _one_plus)
        copy(block._ffn_norm.scale, f"{p}/pre_ffw_norm/scale", _one_plus)
        copy(block._ffn_gate.kernel, f"{p}/ffw_gating/kernel")
        copy(block._ffn_intermediate.kernel, f"{p}/ffw_gating_2/kernel")
        copy(block._ffn_output.kernel, f"{p}/ffw_linear/kernel")
    copy(student.final_norm.scale, "final_normalization/scale", _one_plus)


register(
    Family(name="gemma", backbones=("GemmaBackbone",), config=gemma_config, weights=copy_gemma, attention="attention")
)
