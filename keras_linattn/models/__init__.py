"""keras-hub-shaped models built from keras_linattn layers; `keras_linattn.generation` is the decode contract.

`LinearBackbone` (embeddings, blocks, final norm, decode state),
`LinearCausalLM` (head, `generate`, samplers) and
`LinearCausalLMPreprocessor` (any keras-hub tokenizer, left padding)
subclass keras-hub's `Backbone`, `CausalLM` and `CausalLMPreprocessor`.
This is the one part of the package that imports keras_hub.
"""

from keras_linattn.models import backbone, causal_lm, preprocessor
from keras_linattn.models.backbone import LinearBackbone
from keras_linattn.models.causal_lm import LinearCausalLM
from keras_linattn.models.preprocessor import LinearCausalLMPreprocessor

__all__ = [*backbone.__all__, *causal_lm.__all__, *preprocessor.__all__]
