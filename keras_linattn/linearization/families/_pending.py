"""keras-hub decoder families without a family module yet, and what each is missing.

`families.get` names the missing piece in its TypeError. A family module
that registers one of these backbones takes precedence over its entry here.
"""

MISSING = {
    "BloomBackbone": "ALiBi positions (a per-head decay) and the embedding LayerNorm are not mapped",
    "FalconBackbone": "the parallel attention/MLP residual and ALiBi/rotary variants are not mapped",
    "Gemma4Backbone": "per-layer embeddings and its local/global attention layers are not mapped",
    "GptOssBackbone": "attention sinks, its mixture-of-experts feed-forward and YaRN RoPE are not mapped",
    "OPTBackbone": "learned positions with an offset of 2 and ReLU feed-forwards are not mapped",
    "Qwen3_5Backbone": "its Gated DeltaNet layers (the delta rule) and gated attention are not mapped",
    "Qwen3_5MoeBackbone": "its Gated DeltaNet layers and its mixture-of-experts feed-forward are not mapped",
}
