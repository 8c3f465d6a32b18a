"""Keras layers built on linear attention.

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those.
"""

from keras_linattn.layers import (
    efficient_attention,
    linear_attention,
    linear_attention_cell,
    mixture_of_experts,
    spec,
    transformer_decoder,
    transformer_encoder,
)
from keras_linattn.layers.efficient_attention import EfficientAttention
from keras_linattn.layers.linear_attention import LinearAttention
from keras_linattn.layers.linear_attention_cell import LinearAttentionCell
from keras_linattn.layers.mixture_of_experts import MixtureOfExperts
from keras_linattn.layers.spec import AttentionSpec
from keras_linattn.layers.transformer_decoder import LinearTransformerDecoder
from keras_linattn.layers.transformer_encoder import LinearTransformerEncoder

__all__ = [
    *efficient_attention.__all__,
    *linear_attention.__all__,
    *linear_attention_cell.__all__,
    *mixture_of_experts.__all__,
    *spec.__all__,
    *transformer_decoder.__all__,
    *transformer_encoder.__all__,
]
