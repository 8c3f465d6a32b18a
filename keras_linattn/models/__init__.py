"""Ready-made models built from keras_linattn layers; `keras_linattn.models.generation` is the decode contract."""

from keras_linattn.models import causal_lm
from keras_linattn.models.causal_lm import LinearCausalLM

__all__ = [*causal_lm.__all__]
