"""What the mixture-of-experts families (Mixtral, Qwen MoE, Qwen 3 MoE) share: each layer's `moe` entry and the copy.

keras-hub 0.32's sparse MoE blocks (``MixtralSparseMoeBlock``,
``QwenSparseMoeBlock``, ``Qwen3SparseMoeBlock``) have no `get_config` and
return ``(output, router_logits)``; the student's feed-forward is the
package's `keras_linattn.layers.MixtureOfExperts` with the same weights
(router, experts, Qwen MoE's shared expert and its gate), which returns the
output alone. The router's load-balancing loss is not part of the student.
The blocks' auto-numbered names (``mixtral_sparse_moe_block_1``) make their
paths depend on what else was built, so these weights are copied by
variable (`Copier.variable`), not by path.
"""

from keras_linattn.linearization.families._common import copy_attention

__all__ = ["copy_moe_decoder", "layer_moe", "sparse_block"]


def sparse_block(layer):
    """The keras-hub decoder layer's sparse MoE block, or None for a dense layer (Qwen MoE's ``mlp_only_layers``)."""
    for name in ("_sparse_moe_block", "mlp"):
        block = getattr(layer, name, None)
        if block is not None and hasattr(block, "expert_bank"):
            return block
    return None


def layer_moe(backbone, expert_dim, normalize_top_k, shared_expert_dim=None):
    """The student's `moe` argument: one `MixtureOfExperts` dict per teacher layer (None for a dense layer)."""
    out = []
    for layer in backbone.transformer_layers:
        block = sparse_block(layer)
        if block is None:
            out.append(None)
            continue
        entry = {
            "num_experts": int(block.num_experts),
            "top_k": int(block.top_k),
            "expert_dim": int(expert_dim),
            "normalize_top_k": bool(normalize_top_k),
        }
        if shared_expert_dim is not None:
            entry["shared_expert_dim"] = int(shared_expert_dim)
        out.append(entry)
    return out


def _copy_experts(copy, moe, block):
    """Router, experts (Mixtral's three kernels, or Qwen's fused gate/up kernel split) and the shared expert."""
    copy.variable(moe.router_kernel, block._sparse_feedforward_gate_dense.kernel)
    bank = block.expert_bank
    if hasattr(bank, "_expert_feedforward_intermediate_dense"):  # Mixtral: gate and up apart
        copy.variable(moe.gate_kernel, bank._expert_feedforward_gate_dense)
        copy.variable(moe.up_kernel, bank._expert_feedforward_intermediate_dense)
    else:  # Qwen: [E, dim, 2 I], the gate's half first (keras-hub's `ops.split(gate_up, 2)`)
        inter = moe.expert_dim
        copy.variable(moe.gate_kernel, bank._expert_feedforward_gate_dense, lambda v: v[..., :inter])
        copy.variable(moe.up_kernel, bank._expert_feedforward_gate_dense, lambda v: v[..., inter:])
    copy.variable(moe.down_kernel, bank._expert_feedforward_output_dense)
    if moe.shared_expert_dim is not None:
        shared = block.shared_expert_dense
        copy.variable(moe.shared_gate_kernel, shared._feedforward_gate_dense.kernel)
        copy.variable(moe.shared_up_kernel, shared._feedforward_intermediate_dense.kernel)
        copy.variable(moe.shared_down_kernel, shared._feedforward_output_dense.kernel)
        copy.variable(moe.shared_weight_kernel, block.shared_expert_gate_dense.kernel)


def copy_moe_decoder(copy, student, backbone, attention_bias=False, qk_norm=False):
    """Copies every weight of a Llama-layout decoder whose feed-forwards are sparse MoE blocks (or dense MLPs).

    Args:
        copy: the `Copier`.
        student: the `LinearBackbone` (its blocks' `moe` from `layer_moe`).
        backbone: the keras-hub teacher backbone.
        attention_bias: passed to `copy_attention` as `bias` (``"qkv"`` for Qwen MoE).
        qk_norm: copy each attention's per-head query and key norms (Qwen 3 MoE).
    """
    copy(student.token_embedding.embeddings, "token_embedding/embeddings")
    if not student.tie_embeddings:
        copy(student.token_embedding.reverse_embeddings, "token_embedding/reverse_embeddings")
    for i, (block, layer) in enumerate(zip(student.decoder_blocks, backbone.transformer_layers, strict=True)):
        copy_attention(copy, block.attention, f"transformer_layer_{i}/self_attention", bias=attention_bias)
        if qk_norm:
            attention = layer._self_attention_layer
            copy.variable(block.attention.query_norm.scale, attention._query_dense_layer_norm.scale)
            copy.variable(block.attention.key_norm.scale, attention._key_dense_layer_norm.scale)
        copy.variable(block._attention_norm.scale, layer._self_attention_layernorm.scale)
        copy.variable(block._ffn_norm.scale, layer._feedforward_layernorm.scale)
        sparse = sparse_block(layer)
        if sparse is not None:
            _copy_experts(copy, block._moe, sparse)
            continue
        for ours, theirs in (  # a dense layer (Qwen MoE's `mlp_only_layers`, `decoder_sparse_step`)
            (block._ffn_gate, layer.mlp._feedforward_gate_dense),
            (block._ffn_intermediate, layer.mlp._feedforward_intermediate_dense),
            (block._ffn_output, layer.mlp._feedforward_output_dense),
        ):
            copy.variable(ours.kernel, theirs.kernel)
            if ours.use_bias:
                copy.zero(ours.bias)
    copy(student.final_norm.scale, "sequence_output_layernorm/scale")
