"""GPT-NeoX (`GPTNeoXBackbone`): parallel residual, partial rotary, a fused q/k/v kernel, LayerNorm, biases.

- ``x + Attn(LN1(x)) + FFN(LN2(x))``: the student's ``parallel_residual``.
- RoPE on the first ``head_dim * rotary_percentage`` entries of each head
  (the student's ``rope_rotary_dim``).
- keras-hub's ``query_key_value`` kernel is ``[dim, H, 3 D]`` (per head:
  query, key, value), split into the three projections; the output kernel
  ``[H * D, dim]`` is reshaped to ``[H, D, dim]``.
"""

from keras_linattn.linearization.families import Family, register

__all__ = ["copy_gpt_neox", "gpt_neox_config"]


def gpt_neox_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `GPTNeoXBackbone` config.

    Raises:
        TypeError: for a rotary part that is not an even number of entries.
    """
    head_dim = config["hidden_dim"] // config["num_heads"]
    rotary_dim = int(head_dim * config.get("rotary_percentage", 0.25))
    if rotary_dim % 2 or rotary_dim == 0:
        raise TypeError(
            "GPT-NeoX's rotary part must be an even, positive number of entries per head. "
            f"Received: rotary_percentage={config.get('rotary_percentage')} with head dim {head_dim}"
        )
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=bool(backbone.token_embedding.tie_weights),
        activation="gelu_approximate",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        use_bias=True,
        parallel_residual=True,
        rope_max_wavelength=config.get("rotary_max_wavelength", 10000),
        rope_rotary_dim=None if rotary_dim == head_dim else rotary_dim,
    )


def copy_gpt_neox(copy, student, backbone):
    """Copies every GPT-NeoX weight (the fused q/k/v kernel split, the output kernel reshaped)."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for i, block in enumerate(student.decoder_blocks):
        p = f"transformer_layer_{i}"
        attention = block.attention
        d = attention.key_dim
        fused = f"{p}/self_attention/query_key_value"
        for part, dense in enumerate((attention.query_dense, attention.key_dense, attention.value_dense)):
            sl = slice(part * d, (part + 1) * d)
            copy(dense.kernel, f"{fused}/kernel", lambda w, sl=sl: w[..., sl])  # [dim, H, D]
            copy(dense.bias, f"{fused}/bias", lambda b, sl=sl: b[..., sl])  # [H, D]
        output = attention.output_dense
        shape = tuple(output.kernel.shape)  # [H, D, dim]
        copy(output.kernel, f"{p}/self_attention/attention_output/kernel", lambda w, shape=shape: w.reshape(shape))
        copy(output.bias, f"{p}/self_attention/attention_output/bias")
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


register(Family(name="gpt_neox", backbones=("GPTNeoXBackbone",), config=gpt_neox_config, weights=copy_gpt_neox))
