"""keras-hub-shaped models built from keras_linattn layers; `keras_linattn.generation` is the decode contract.

`LinearBackbone` (embeddings, blocks, final norm, decode state),
`LinearCausalLM` (head, `generate`, samplers) and
`LinearCausalLMPreprocessor` (any keras-hub tokenizer, left padding)
subclass keras-hub's `Backbone`, `CausalLM` and `CausalLMPreprocessor`.
This is the one part of the package that imports keras_hub: each name loads
its module on first use (the decode contract, `keras_linattn.generation`,
runs without it). Once keras_hub is imported (by these modules or by
the user), keras-hub's `from_preset` finds the three classes.
"""

from keras_linattn import _lazy

_NAMES = {
    "LinearBackbone": "backbone",
    "LinearCausalLM": "causal_lm",
    "LinearCausalLMPreprocessor": "preprocessor",
}
_SUBMODULES = ("backbone", "causal_lm", "preprocessor")

__all__ = sorted(_NAMES)


__getattr__, __dir__ = _lazy.package_attributes(__name__, _NAMES, _SUBMODULES)
