"""keras_linattn: kernelized linear attention layers for Keras 3 (TensorFlow backend).

>>> import keras_linattn as kla
>>> layer = kla.layers.LinearAttention(num_heads=8, key_dim=64, feature_map="elu")
>>> layer.num_heads, layer.key_dim
(8, 64)

Importing the package changes no environment variable: pick the Keras backend
with ``KERAS_BACKEND`` before importing Keras (TensorFlow is Keras' default).
The export toolchain (tf2onnx, onnx, onnxruntime) is imported only by the
functions that need it, and keras-hub only by `keras_linattn.models` (loaded
on first use: ``keras_linattn.models`` or ``from keras_linattn.models import ...``).
"""

import importlib

from keras_linattn import (
    callbacks,
    distill,
    export,
    feature_maps,
    layers,
    linearization,
    ops,
    recurrences,
    regularizers,
    samplers,
)
from keras_linattn.linearization import attention_transfer, linearize
from keras_linattn.version import __version__

__all__ = [
    "__version__",
    "attention_transfer",
    "callbacks",
    "distill",
    "export",
    "feature_maps",
    "layers",
    "linearization",
    "linearize",
    "models",
    "ops",
    "recurrences",
    "regularizers",
    "samplers",
]


def _register_model_loaders():
    """Lets Keras load `.keras` files of the models before `keras_linattn.models` is imported.

    The model classes register themselves when `keras_linattn.models` is
    imported (which imports keras_hub). Until then, their registered names
    point to a loader whose `from_config` imports the module and hands the
    config to the real class; the real registration then replaces it.
    """
    import keras

    def loader(module, name):
        def from_config(cls, config):
            # The class itself, not the registry: a load in progress may hold a copy of the registry with this loader.
            return getattr(importlib.import_module(module), name).from_config(config)

        return type(f"_Load{name}", (), {"from_config": classmethod(from_config), "get_config": lambda self: {}})

    registry = keras.saving.get_custom_objects()
    for module, name in (
        ("keras_linattn.models.backbone", "LinearBackbone"),
        ("keras_linattn.models.causal_lm", "LinearCausalLM"),
        ("keras_linattn.models.preprocessor", "LinearCausalLMPreprocessor"),
    ):
        registry.setdefault(f"keras_linattn>{name}", loader(module, name))
    # The class keras_linattn 0.1's flat LM files record: refused with the converter's name.
    registry.setdefault("keras_linattn>_Round2LinearCausalLM", _FlatFileRefusal)


class _FlatFileRefusal:
    """Loads nothing: a file of keras_linattn 0.1's flat `LinearCausalLM` names the converter instead."""

    @classmethod
    def from_config(cls, config):
        raise ValueError(
            "This file holds a LinearCausalLM of keras_linattn 0.1 (one flat model): convert it once with "
            "`python -m keras_linattn.upgrade OLD NEW` (keras_linattn.upgrade)."
        )


_register_model_loaders()


def __getattr__(name):
    # `keras_linattn.models` imports keras_hub (and tensorflow-text): loaded when first used.
    if name == "models":
        return importlib.import_module("keras_linattn.models")
    raise AttributeError(f"module 'keras_linattn' has no attribute {name!r}")
