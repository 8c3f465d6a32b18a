"""SmolLM3 (`SmolLM3Backbone`, alias `SmolLMBackbone`): Llama's architecture, some layers without RoPE.

keras-hub's SmolLM3 layers have their own names (``self_attn/q_proj``,
``mlp/up_proj``, ``input_layernorm``) and a Dense ``[dim, H * D]`` query,
key and value kernel; some paths repeat across layers (``o_proj/kernel``),
so the weights are copied variable by variable. A layer whose entry of
``rope_layer_enabled_list`` is False (``no_rope_layers`` 0 in the
checkpoint) gets ``{"rope_max_wavelength": None}`` in the student's
``layer_attention``.
"""

from keras_linattn.linearization.families import Family, register

__all__ = ["copy_smollm3", "smollm3_config"]


def smollm3_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `SmolLM3Backbone` config.

    Raises:
        TypeError: for partial rotary embeddings, attention or MLP biases,
            or a sliding-window layer type (not mapped).
    """
    unmapped = {
        "partial_rotary_factor": config.get("partial_rotary_factor", 1.0) != 1.0,
        "attention_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "layer_types": any(kind != "full_attention" for kind in config.get("layer_types", ())),
    }
    for key, bad in unmapped.items():
        if bad:
            raise TypeError(f"SmolLM3's `{key}` is not mapped. Received: {key}={config[key]!r}")
    enabled = list(config["rope_layer_enabled_list"])
    enabled += [True] * (config["num_layers"] - len(enabled))  # keras-hub: layers past the list use RoPE
    return dict(
        vocabulary_size=config["vocabulary_size"],
        num_layers=config["num_layers"],
        hidden_dim=config["hidden_dim"],
        num_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_dim=config["intermediate_dim"],
        dropout=config.get("attention_dropout", 0.0),
        max_sequence_length=None,
        tie_embeddings=bool(backbone.token_embedding.tie_weights),
        activation="silu",
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-6),
        normalization="rms_norm",
        feedforward="gated",
        use_bias=False,
        rope_max_wavelength=config["rope_theta"],
        layer_attention=[{} if on else {"rope_max_wavelength": None} for on in enabled],
    )


def copy_smollm3(copy, student, backbone):
    """Copies every SmolLM3 weight, layer object by layer object (its paths repeat)."""
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for block, layer in zip(student.decoder_blocks, backbone.transformer_layers, strict=True):
        attention, theirs = block.attention, layer.self_attn
        for ours, dense in (
            (attention.query_dense, theirs.q_proj),
            (attention.key_dense, theirs.k_proj),
            (attention.value_dense, theirs.v_proj),
        ):
            # [dim, heads * D] -> [dim, heads, D]
            copy.variable(ours.kernel, dense.kernel, lambda w, shape=tuple(ours.kernel.shape): w.reshape(shape))
        copy.variable(attention.output_dense.kernel, theirs.o_proj.kernel)
        for weight in theirs.rotary_embedding.weights:
            copy.derived(weight)  # the inverse frequencies, from rope_theta
        copy.variable(block._attention_norm.scale, layer.input_layernorm.scale)
        copy.variable(block._ffn_norm.scale, layer.post_attention_layernorm.scale)
        for ours, dense in (
            (block._ffn_gate, layer.mlp.gate_proj),
            (block._ffn_intermediate, layer.mlp.up_proj),
            (block._ffn_output, layer.mlp.down_proj),
        ):
            copy.variable(ours.kernel, dense.kernel)
    copy(student.final_norm.scale, "sequence_output_layernorm/scale")


register(
    Family(
        name="smollm3",
        backbones=("SmolLM3Backbone",),
        config=smollm3_config,
        weights=copy_smollm3,
        attention="self_attn",
    )
)
