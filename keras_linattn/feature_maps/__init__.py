"""Feature maps ``phi`` for kernelized attention, and their registry.

>>> from keras_linattn import feature_maps
>>> feature_maps.available()
['elu', 'relu', 'taylor', ...]
>>> fm = feature_maps.get("relu", epsilon=1e-3)
"""

from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.aoglu import AOGLUFeatureMap
from keras_linattn.feature_maps.elu import EluFeatureMap
from keras_linattn.feature_maps.ffn import FFNFeatureMap
from keras_linattn.feature_maps.glu import GLUFeatureMap
from keras_linattn.feature_maps.favor import FavorPlusFeatureMap
from keras_linattn.feature_maps.favor_trig import FavorTrigFeatureMap
from keras_linattn.feature_maps.hedgehog import HedgehogFeatureMap
from keras_linattn.feature_maps.registry import available, deserialize, get, register, serialize
from keras_linattn.feature_maps.oglu import OGLUFeatureMap
from keras_linattn.feature_maps.relu import ReluFeatureMap
from keras_linattn.feature_maps.taylor import TaylorFeatureMap

__all__ = [
    "AOGLUFeatureMap",
    "FFNFeatureMap",
    "GLUFeatureMap",
    "OGLUFeatureMap",
    "EluFeatureMap",
    "FavorPlusFeatureMap",
    "FavorTrigFeatureMap",
    "HedgehogFeatureMap",
    "FeatureMap",
    "ReluFeatureMap",
    "TaylorFeatureMap",
    "available",
    "deserialize",
    "get",
    "register",
    "serialize",
]
