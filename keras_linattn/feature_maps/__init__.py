"""Feature maps ``phi`` for kernelized attention, and their registry.

>>> from keras_linattn import feature_maps
>>> {"elu", "relu", "taylor", "favor+", "hedgehog"} <= set(feature_maps.available())
True
>>> fm = feature_maps.get("relu", epsilon=1e-3)
>>> type(fm).__name__, fm.epsilon
('ReluFeatureMap', 0.001)

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those.
"""

from keras_linattn.feature_maps import (
    aoglu,
    base,
    elu,
    favor,
    favor_trig,
    ffn,
    glu,
    hedgehog,
    oglu,
    random_features,
    registry,
    relu,
    taylor,
)
from keras_linattn.feature_maps.aoglu import AOGLUFeatureMap
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.feature_maps.elu import EluFeatureMap
from keras_linattn.feature_maps.favor import FavorPlusFeatureMap
from keras_linattn.feature_maps.favor_trig import FavorTrigFeatureMap
from keras_linattn.feature_maps.ffn import FFNFeatureMap
from keras_linattn.feature_maps.glu import GLUFeatureMap
from keras_linattn.feature_maps.hedgehog import HedgehogFeatureMap
from keras_linattn.feature_maps.oglu import OGLUFeatureMap
from keras_linattn.feature_maps.random_features import RandomFeatureMap
from keras_linattn.feature_maps.registry import available, deserialize, get, register, serialize
from keras_linattn.feature_maps.relu import ReluFeatureMap
from keras_linattn.feature_maps.taylor import TaylorFeatureMap

__all__ = [
    *aoglu.__all__,
    *base.__all__,
    *elu.__all__,
    *favor.__all__,
    *favor_trig.__all__,
    *ffn.__all__,
    *glu.__all__,
    *hedgehog.__all__,
    *oglu.__all__,
    *random_features.__all__,
    *registry.__all__,
    *relu.__all__,
    *taylor.__all__,
]
