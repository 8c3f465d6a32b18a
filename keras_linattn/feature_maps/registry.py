"""Registry of feature maps: names -> classes, and (de)serialization."""

import keras

from keras_linattn.feature_maps.base import FeatureMap

_REGISTRY = {}


def register(name):
    """Class decorator: registers a `FeatureMap` under `name` and with Keras.

    Registered maps can be referred to by name (``LinearAttention(...,
    feature_map="elu")``) and are deserializable with ``safe_mode=True``.
    """

    def decorator(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"Feature map name {name!r} is already registered.")
        if not issubclass(cls, FeatureMap):
            raise TypeError(f"{cls.__name__} must subclass FeatureMap to be registered.")
        _REGISTRY[name] = cls
        cls.registry_name = name
        return keras.saving.register_keras_serializable(package="keras_linattn")(cls)

    return decorator


def available():
    """Sorted list of registered feature-map names."""
    return sorted(_REGISTRY)


def get(identifier, **kwargs):
    """Returns a `FeatureMap` for a name, a serialized config or an instance.

    Args:
        identifier: a registered name (see `available()`), a dict from
            `serialize`, or a `FeatureMap` instance (returned as is).
        **kwargs: constructor arguments when `identifier` is a name.

    Raises:
        ValueError: for an unknown name or an object that is not a feature map.
    """
    if isinstance(identifier, FeatureMap):
        if kwargs:
            raise ValueError(
                "Constructor arguments can only be given with a feature-map name. "
                f"Received: identifier={identifier!r}, kwargs={kwargs}"
            )
        return identifier
    if isinstance(identifier, str):
        cls = _REGISTRY.get(identifier)
        if cls is None:
            raise ValueError(
                f"Unknown feature map. Received: feature_map={identifier!r}. "
                f"Available: {available()}"
            )
        return cls(**kwargs)
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise ValueError(
        "`feature_map` must be a name, a serialized config or a FeatureMap instance. "
        f"Received: feature_map={identifier!r}"
    )


def serialize(feature_map):
    """Serializes a feature map to a Keras config dict."""
    return keras.saving.serialize_keras_object(feature_map)


def deserialize(config):
    """Inverse of `serialize`; refuses anything that is not a registered feature map."""
    class_name = config.get("class_name") if isinstance(config, dict) else None
    known = {cls.__name__ for cls in _REGISTRY.values()}
    if class_name not in known:
        raise ValueError(
            "Unknown feature map in config. "
            f"Received: class_name={class_name!r}. Known: {sorted(known)}"
        )
    obj = keras.saving.deserialize_keras_object(config)
    if not isinstance(obj, FeatureMap):
        raise ValueError(f"Config does not describe a FeatureMap. Received: {config!r}")
    return obj
