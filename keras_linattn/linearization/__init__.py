"""Linearizing pretrained softmax Transformers: `linearize`, then `attention_transfer`.

See docs/linearize.md. `linearize` and `attention_transfer` are also
exported at the package's top level.
"""

from keras_linattn.linearization.convert import linearize
from keras_linattn.linearization.lora import enable_lora, lora_variables, merge_lora
from keras_linattn.linearization.transfer import (
    DivergenceWarning,
    NonFiniteLossError,
    attention_pairs,
    attention_transfer,
    transfer_variables,
)

__all__ = [
    "DivergenceWarning",
    "NonFiniteLossError",
    "attention_pairs",
    "attention_transfer",
    "enable_lora",
    "linearize",
    "lora_variables",
    "merge_lora",
    "transfer_variables",
]
