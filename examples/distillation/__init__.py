"""Attention distillation: softmax Transformer -> linear attention."""
