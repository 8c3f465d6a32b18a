"""Keras layers built on linear attention."""

from keras_linattn.layers.efficient_attention import EfficientAttention
from keras_linattn.layers.linear_attention import LinearAttention
from keras_linattn.layers.linear_attention_cell import LinearAttentionCell
from keras_linattn.layers.transformer_decoder import LinearTransformerDecoder
from keras_linattn.layers.transformer_encoder import LinearTransformerEncoder

__all__ = ["EfficientAttention", "LinearAttention", "LinearAttentionCell", "LinearTransformerDecoder", "LinearTransformerEncoder"]
