"""Ready-made models built from keras_linattn layers."""

from keras_linattn.models.causal_lm import LinearCausalLM

__all__ = ["LinearCausalLM"]
