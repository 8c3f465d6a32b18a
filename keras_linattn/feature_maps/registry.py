"""Registry of feature maps: names -> classes, and (de)serialization."""

import keras

from keras_linattn._registry import NameRegistry
from keras_linattn.feature_maps.base import FeatureMap

__all__ = ["available", "deserialize", "get", "register", "serialize"]


_REGISTRY = NameRegistry("feature map", "feature_map", FeatureMap)


def register(name):
    """Class decorator: registers a `FeatureMap` under `name` and with Keras.

    Registered maps can be referred to by name (``LinearAttention(...,
    feature_map="elu")``) and are deserializable with ``safe_mode=True``.
    """
    return _REGISTRY.register(name)


def available():
    """Sorted list of registered feature-map names."""
    return _REGISTRY.available()


def get(identifier, **kwargs):
    """Returns a `FeatureMap` for a name, a serialized config or an instance.

    Args:
        identifier: a registered name (see `available()`), a dict from
            `serialize`, or a `FeatureMap` instance (returned as is).
        **kwargs: constructor arguments when `identifier` is a name.

    Raises:
        ValueError: for an unknown name or an object that is not a feature map.
    """
    return _REGISTRY.get(identifier, kwargs, deserialize)


def serialize(feature_map):
    """Serializes a feature map to a Keras config dict."""
    return keras.saving.serialize_keras_object(feature_map)


def deserialize(config):
    """Inverse of `serialize`; refuses anything that is not a registered feature map."""
    return _REGISTRY.deserialize(config)
