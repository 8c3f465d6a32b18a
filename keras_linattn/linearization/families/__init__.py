"""keras-hub families `linearize` knows: one small declarative module per family (`registry` finds them).

A family module (``families/<name>.py``) describes a keras-hub decoder in two
functions and registers them with `register(Family(...))`; see
`keras_linattn.linearization.families.registry` and CONTRIBUTING.md.
"""

from keras_linattn.linearization.families.registry import Family, attention_layers, get, names, register

__all__ = ["Family", "attention_layers", "get", "names", "register"]
