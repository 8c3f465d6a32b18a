"""Hugging Face-format checkpoint directories written locally: published `config.json` values, random weights.

`write_checkpoint(dir, config)` writes ``config.json`` and
``model.safetensors`` (the tensors a Llama-layout checkpoint of that config
holds, small random values); `load(cls_name, dir)` loads it through
keras-hub's own converter (`from_preset(<dir>)`), so the teacher sees
exactly the keys a user's checkpoint carries. Nothing is downloaded.

`PUBLISHED` holds each model's published ``config.json``; `small(name)`
keeps every key and shrinks the sizes (layers, width, heads, vocabulary)
for unit tests.
"""

import json
import pathlib

import keras_hub
import numpy as np
from safetensors.numpy import save_file

# Published config.json values (Hugging Face model pages), every key kept.
PUBLISHED = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Mistral-7B-v0.3": {
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0",
        "use_cache": True,
        "vocab_size": 32768,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "SmolLM3-3B": {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 128012,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "layer_types": ["full_attention"] * 36,
        "max_position_embeddings": 65536,
        "max_window_layers": 28,
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        # RoPE off (0) in every fourth layer.
        "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(36)],
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 4,
        "pad_token_id": 128004,
        "pretraining_tp": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 5000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": 128256,
    },
    "gemma-2b": {
        "architectures": ["GemmaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "head_dim": 256,
        "hidden_act": "gelu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 16384,
        "max_position_embeddings": 8192,
        "model_type": "gemma",
        "num_attention_heads": 8,
        "num_hidden_layers": 18,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.38.0.dev0",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "initializer_range": 0.02,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "torch_dtype": "float32",
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "gemma-3-1b-pt": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": 262144,
    },
    # Mixture-of-experts configs: the model cards' config.json values, typed here (not downloaded).
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 1408,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 5632,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

# The sizes a unit test shrinks (every other key keeps its published value).
SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
}


def small(name, **sizes):
    """`PUBLISHED[name]` with the sizes in `SMALL` (and `sizes`) replaced; ``head_dim`` follows the width."""
    config = json.loads(json.dumps(PUBLISHED[name]))
    config.update(SMALL, **sizes)
    for key in ("no_rope_layers", "layer_types"):  # per-layer lists keep their first layers' entries
        if key in config:
            config[key] = config[key][: config["num_hidden_layers"]]
    if "head_dim" in config and "head_dim" not in sizes:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def llama_layout_tensors(config, seed=0, attention_bias=False, qk_norm=False, sandwich_norms=False):
    """``{name: float32 array}``: the tensors of a Llama-layout checkpoint (Llama, Mistral, Qwen 2/3, Gemma 1/3).

    Projection weights are N(0, 0.02) (``initializer_range``), norm weights
    1 + N(0, 0.1) and biases N(0, 0.1), so that every weight matters.
    """
    rng = np.random.default_rng(seed)
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads

    def dense(*shape):
        return rng.normal(0.0, 0.02, shape).astype("float32")

    def norm(n):
        return (1.0 + rng.normal(0.0, 0.1, (n,))).astype("float32")

    tensors = {"model.embed_tokens.weight": dense(vocab, d), "model.norm.weight": norm(d)}
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = dense(vocab, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm(d)
        tensors[p + "post_attention_layernorm.weight"] = norm(d)
        for name, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
            tensors[p + f"self_attn.{name}_proj.weight"] = dense(rows, d)
            if attention_bias:
                tensors[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.1, (rows,)).astype("float32")
        tensors[p + "self_attn.o_proj.weight"] = dense(d, heads * head_dim)
        if qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if sandwich_norms:  # Gemma 2 / 3: norms before and after the feed-forward too
            tensors[p + "pre_feedforward_layernorm.weight"] = norm(d)
            tensors[p + "post_feedforward_layernorm.weight"] = norm(d)
        tensors[p + "mlp.gate_proj.weight"] = dense(inter, d)
        tensors[p + "mlp.up_proj.weight"] = dense(inter, d)
        tensors[p + "mlp.down_proj.weight"] = dense(d, inter)
    return tensors


def write_checkpoint(directory, config, tensors):
    """Writes ``config.json`` and ``model.safetensors`` into `directory`; returns it as a str."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def load(causal_lm_class, directory):
    """``keras_hub.models.<causal_lm_class>.from_preset(directory, preprocessor=None)``: keras-hub's converter."""
    return getattr(keras_hub.models, causal_lm_class).from_preset(directory, preprocessor=None)


# The mixture-of-experts sizes a unit test shrinks on top of `SMALL`: few experts, top-2, narrow experts.
SMALL_MOE = {
    "num_local_experts": 4,  # Mixtral's name
    "num_experts": 4,  # Qwen's
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 80,
}


def small_moe(name, **sizes):
    """`small(name)` with the mixture-of-experts sizes of `SMALL_MOE` (only the keys the published config has)."""
    config = small(name, **sizes)
    for key, value in SMALL_MOE.items():
        if key in PUBLISHED[name] and key not in sizes:
            config[key] = value
    return config


def moe_tensors(config, seed=0, attention_bias=False, qk_norm=False):
    """``{name: float32 array}`` of a mixture-of-experts checkpoint (Mixtral, Qwen MoE, Qwen 3 MoE).

    The Llama-layout tensors (`llama_layout_tensors`) with each sparse
    layer's dense MLP replaced by a router and experts: Mixtral's
    ``block_sparse_moe.{gate, experts.<e>.w1/w2/w3}``, Qwen's
    ``mlp.{gate, experts.<e>.gate_proj/up_proj/down_proj}`` and, where the
    config has ``shared_expert_intermediate_size``, Qwen MoE's shared expert
    and its sigmoid gate. Router weights are N(0, 0.5) so that the top-k
    choice differs across tokens.
    """
    tensors = llama_layout_tensors(config, seed=seed, attention_bias=attention_bias, qk_norm=qk_norm)
    rng = np.random.default_rng(seed + 1)
    d = config["hidden_size"]
    mixtral = "num_local_experts" in config
    experts = config["num_local_experts"] if mixtral else config["num_experts"]
    inter = config["intermediate_size"] if mixtral else config["moe_intermediate_size"]
    step = config.get("decoder_sparse_step", 1)
    dense_layers = set(config.get("mlp_only_layers") or [])

    def dense(*shape):
        return rng.normal(0.0, 0.02, shape).astype("float32")

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if i in dense_layers or (i + 1) % step:
            continue  # a dense layer keeps its Llama-layout MLP
        for name in ("gate_proj", "up_proj", "down_proj"):
            del tensors[p + f"mlp.{name}.weight"]
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        tensors[moe + "gate.weight"] = rng.normal(0.0, 0.5, (experts, d)).astype("float32")
        for e in range(experts):
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            tensors[moe + f"experts.{e}.{names[0]}.weight"] = dense(inter, d)
            tensors[moe + f"experts.{e}.{names[1]}.weight"] = dense(inter, d)
            tensors[moe + f"experts.{e}.{names[2]}.weight"] = dense(d, inter)
        shared = config.get("shared_expert_intermediate_size")
        if shared:
            tensors[moe + "shared_expert.gate_proj.weight"] = dense(shared, d)
            tensors[moe + "shared_expert.up_proj.weight"] = dense(shared, d)
            tensors[moe + "shared_expert.down_proj.weight"] = dense(d, shared)
            tensors[moe + "shared_expert_gate.weight"] = rng.normal(0.0, 0.5, (1, d)).astype("float32")
    return tensors
