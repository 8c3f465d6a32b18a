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


def __getattr__(name):
    # `keras_linattn.models` imports keras_hub (and tensorflow-text): loaded when first used.
    if name == "models":
        return importlib.import_module("keras_linattn.models")
    raise AttributeError(f"module 'keras_linattn' has no attribute {name!r}")
