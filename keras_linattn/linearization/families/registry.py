"""keras-hub families `linearize` knows: one small declarative module per family, found by a registry.

A family module (``families/<name>.py``) describes a keras-hub decoder in two
functions and registers them::

    register(Family(
        name="llama",
        backbones=("LlamaBackbone", "Llama3Backbone"),
        config=llama_config,     # (teacher config, teacher backbone, window) -> LinearBackbone kwargs
        weights=copy_llama,      # (copy, student, teacher backbone) -> None; copy(variable, "teacher/path")
    ))

Every module of this package is imported on the first lookup, so adding a
family is adding one file: no other file lists the families. A keras-hub
backbone the registry does not hold raises TypeError naming the missing
piece (`_pending.MISSING`) where one is known.
"""

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

from keras_linattn.linearization.families import _pending

__all__ = ["Family", "attention_layers", "get", "names", "register"]

_PACKAGE = "keras_linattn.linearization.families"


@dataclasses.dataclass(frozen=True)
class Family:
    """One keras-hub decoder family: how its config and weights map onto a `LinearBackbone`.

    Attributes:
        name: short name (the module's), e.g. ``"llama"``.
        backbones: the keras-hub backbone class names it covers (a subclass
            of one of them is covered too).
        config: ``config(teacher_config, teacher_backbone, window_size) ->
            dict``: the `LinearBackbone` arguments of the architecture (the
            attention arguments `linearize` adds itself; `window_size` is
            the student's requested window, for a teacher whose attention is
            already local). Raises TypeError for a configuration the student
            cannot reproduce, naming the key.
        weights: ``weights(copy, student, teacher_backbone)``: calls
            ``copy(student_variable, "teacher/weight/path", transform=None)``
            for every teacher weight (``copy.zero(variable)`` for a student
            weight with no teacher counterpart that must be zero, e.g. a bias
            the teacher lacks). Every teacher weight must be copied once.
        attention: the attribute of each of the teacher's
            ``transformer_layers`` that holds its attention layer (default
            ``"_self_attention_layer"``): `attention_transfer` pairs it with
            the student's attention of the same block.
    """

    name: str
    backbones: tuple
    config: Callable
    weights: Callable
    attention: str = "_self_attention_layer"


_REGISTRY = {}
_LOADED = False


def register(family):
    """Adds `family` to the registry (one call at the bottom of each family module).

    Raises:
        ValueError: if another family already covers one of its backbones.
    """
    for backbone in family.backbones:
        other = _REGISTRY.get(backbone)
        if other is not None and other.name != family.name:
            raise ValueError(
                f"keras-hub backbone {backbone} is already covered by family {other.name!r}. "
                f"Received: family={family.name!r}"
            )
        _REGISTRY[backbone] = family
    return family


def _load():
    """Imports every module of this package once (each registers its family)."""
    global _LOADED
    if _LOADED:
        return
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{_PACKAGE}.{module.name}")
    _LOADED = True


def names():
    """``{keras-hub backbone class name: family name}`` of every registered family."""
    _load()
    return {backbone: family.name for backbone, family in sorted(_REGISTRY.items())}


def get(backbone):
    """The `Family` of a keras-hub backbone instance (its class or a base class registered).

    Raises:
        TypeError: for a backbone no family covers, naming what is missing
            where it is known (`_pending.MISSING`) and the covered backbones.
    """
    _load()
    for base in type(backbone).__mro__:
        if base.__name__ in _REGISTRY:
            return _REGISTRY[base.__name__]
    name = type(backbone).__name__
    reason = _pending.MISSING.get(name)
    raise TypeError(
        f"keras-hub backbone {name} is not supported by `linearize`"
        + (f": {reason}." if reason else ".")
        + f" Supported: {sorted(_REGISTRY)}."
    )


def attention_layers(teacher):
    """The attention layer of each block of a keras-hub teacher (`CausalLM` or backbone) of a registered family.

    Returns:
        A list of layers, in block order; empty for a model no family covers.
    """
    backbone = getattr(teacher, "backbone", teacher)
    try:
        family = get(backbone)
    except TypeError:
        return []
    return [getattr(layer, family.attention) for layer in getattr(backbone, "transformer_layers", ())]
