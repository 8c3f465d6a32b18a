"""Gemma 1 and 2 (`GemmaBackbone`): embedding scale, RMSNorm ``(1 + scale)``, GeGLU, MQA, ``[H, dim, D]`` kernels.

- The token embeddings are multiplied by ``sqrt(hidden_dim)``
  (`LinearBackbone(embedding_scale=...)`); the tied head reads the table.
- Gemma's RMSNorm multiplies by ``1 + scale``: the student's norm gets the
  scale ``1 + scale`` (the float32 sum the teacher forms itself).
- The query, key and value kernels are laid out ``[heads, dim, D]``: they
  are transposed to ``[dim, heads, D]``.
- keras-hub interleaves the halves of the rotated queries and keys after
  RoPE; both get the same permutation of D, so every dot product, and with
  it the attention, is unchanged: the student rotates in halves.

Gemma 2's additions, as keras-hub's `GemmaBackbone` exposes them:

- ``attention_logit_soft_cap`` c: the student's softmax window caps its
  scores, ``c * tanh(s / c)`` (`logit_soft_cap`). The linear part cannot
  cap (its terms are a kernel of the query and the key, not of a score):
  the student is the teacher exactly where the window covers the sequence,
  and beyond it the linear terms stand in for the capped scores of the keys
  that left. With ``window_size=None`` there is no softmax to cap.
- ``final_logit_soft_cap``: the head's logits are capped
  (`LinearBackbone(final_logit_soft_cap=...)`), in `call`, `score`,
  `step` and the exports alike.
- ``use_post_attention_norm`` / ``use_post_ffw_norm``: the student's
  ``post_norms`` (both or neither; one alone raises TypeError).
- ``use_sliding_window_attention``: keras-hub makes every even layer local
  (``sliding_window_size`` tokens, its own included). A local window no
  longer than the student's stays exact softmax over that window (the
  window alone, ``linear_weight=0``, soft cap included); a longer one is
  linearized like a global layer.
- ``query_head_dim_normalize``: the query scale is read from each teacher
  attention layer (``1 / sqrt(head_dim)``, or ``1 / sqrt(hidden_dim /
  num_query_heads)`` when False) and a scale other than the student's
  ``1 / sqrt(head_dim)`` is folded into the copied query kernel (a scale of
  the query commutes with RoPE). keras-hub 0.32's `GemmaDecoderBlock` builds
  its attention with ``query_head_dim_normalize=True`` whatever the
  backbone's value, so its layers compute ``1 / sqrt(head_dim)``: the
  student follows the layers, not the config.
"""

import math

from keras_linattn.linearization.families import Family, register
from keras_linattn.recurrences import WindowRecurrence, registry

__all__ = ["copy_gemma", "gemma_config"]


def _layer_attention(backbone, window_size):
    """Each layer's own window where the teacher's layer is local and fits in the student's; None if none does."""
    entries = []
    for layer in backbone.transformer_layers:
        attention = layer.attention
        local = attention.use_sliding_window_attention
        if local and window_size is not None and attention.sliding_window_size <= window_size:
            window = WindowRecurrence(int(attention.sliding_window_size), linear_weight=0.0)
            entries.append({"recurrence": registry.serialize(window)})
        else:
            entries.append({})
    return entries if any(entries) else None


def gemma_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `GemmaBackbone` config (Gemma 1 and Gemma 2).

    Raises:
        TypeError: for a post-attention norm without a post-feed-forward
            norm or the reverse (named with the values received).
    """
    post_attention = bool(config.get("use_post_attention_norm", False))
    post_ffw = bool(config.get("use_post_ffw_norm", False))
    if post_attention != post_ffw:
        raise TypeError(
            "Gemma's post norms map onto the student's `post_norms` (both or neither). Received: "
            f"use_post_attention_norm={post_attention}, use_post_ffw_norm={post_ffw}"
        )
    arguments = dict(
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
        post_norms=post_attention,
        final_logit_soft_cap=config.get("final_logit_soft_cap"),
        layer_attention=_layer_attention(backbone, window_size),
    )
    cap = config.get("attention_logit_soft_cap")
    if cap is not None and window_size is not None:  # without a window there is no softmax score to cap
        arguments["logit_soft_cap"] = float(cap)
    return arguments


def _heads_first(kernel):
    """``[heads, dim, D] -> [dim, heads, D]``."""
    return kernel.transpose(1, 0, 2)


def _one_plus(scale):
    return 1.0 + scale


def _query_rescale(attention):
    """The factor that turns the student's query scale ``1 / sqrt(head_dim)`` into the teacher layer's."""
    if attention.query_head_dim_normalize:
        return 1.0
    return math.sqrt(attention.head_dim) / math.sqrt(attention.hidden_dim // attention.num_query_heads)


def copy_gemma(copy, student, backbone):
    """Copies every Gemma weight (kernels transposed, norm scales as ``1 + scale``, the query scale folded in)."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    for i, (block, teacher_layer) in enumerate(zip(student.decoder_blocks, backbone.transformer_layers, strict=True)):
        p = f"decoder_block_{i}"
        attention = block.attention
        rescale = _query_rescale(teacher_layer.attention)
        copy(attention.query_dense.kernel, f"{p}/attention/query/kernel", lambda k, r=rescale: _heads_first(k) * r)
        copy(attention.key_dense.kernel, f"{p}/attention/key/kernel", _heads_first)
        copy(attention.value_dense.kernel, f"{p}/attention/value/kernel", _heads_first)
        copy(attention.output_dense.kernel, f"{p}/attention/attention_output/kernel")
        copy(block._attention_norm.scale, f"{p}/pre_attention_norm/scale", _one_plus)
        copy(block._ffn_norm.scale, f"{p}/pre_ffw_norm/scale", _one_plus)
        if student.post_norms:
            copy(block._attention_post_norm.scale, f"{p}/post_attention_norm/scale", _one_plus)
            copy(block._ffn_post_norm.scale, f"{p}/post_ffw_norm/scale", _one_plus)
        copy(block._ffn_gate.kernel, f"{p}/ffw_gating/kernel")
        copy(block._ffn_intermediate.kernel, f"{p}/ffw_gating_2/kernel")
        copy(block._ffn_output.kernel, f"{p}/ffw_linear/kernel")
    copy(student.final_norm.scale, "final_normalization/scale", _one_plus)


register(
    Family(name="gemma", backbones=("GemmaBackbone",), config=gemma_config, weights=copy_gemma, attention="attention")
)
