"""keras_linattn: kernelized linear attention layers for Keras 3 (TensorFlow backend).

>>> import keras_linattn as kla
>>> layer = kla.layers.LinearAttention(num_heads=8, key_dim=64, feature_map="elu")
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from keras_linattn import callbacks  # noqa: E402
from keras_linattn import distill  # noqa: E402
from keras_linattn import export  # noqa: E402
from keras_linattn import feature_maps, layers, ops  # noqa: E402
from keras_linattn import regularizers  # noqa: E402
from keras_linattn import models, samplers  # noqa: E402
from keras_linattn.version import __version__  # noqa: E402

__all__ = ["__version__", "callbacks", "distill", "export", "feature_maps", "layers", "models", "ops", "regularizers", "samplers"]
