"""Keras layers built on linear attention."""

from keras_linattn.layers.linear_attention import LinearAttention

__all__ = ["LinearAttention"]
