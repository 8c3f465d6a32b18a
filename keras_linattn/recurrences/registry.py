"""Registry of recurrences: names -> classes, and (de)serialization."""

import keras

from keras_linattn._registry import NameRegistry
from keras_linattn.recurrences.base import Recurrence

__all__ = ["available", "deserialize", "get", "get_class", "register", "serialize"]


_REGISTRY = NameRegistry("recurrence", "recurrence", Recurrence)


def register(name):
    """Class decorator: registers a `Recurrence` under `name` and with Keras.

    Registered recurrences can be named in ``LinearAttention(...,
    recurrence=name)``, are deserializable with ``safe_mode=True``, and are
    run through the contract battery of tests/contracts.
    """
    return _REGISTRY.register(name)


def available():
    """Sorted list of registered recurrence names."""
    return _REGISTRY.available()


def get_class(name):
    """The `Recurrence` subclass registered under `name`."""
    classes = {cls.registry_name: cls for cls in _REGISTRY.by_class_name().values()}
    if name not in classes:
        raise ValueError(f"Unknown recurrence. Received: name={name!r}. Available: {available()}")
    return classes[name]


def get(identifier, **kwargs):
    """Returns a `Recurrence` for a name (built with `kwargs`), a serialized config or an instance.

    Raises:
        ValueError: for an unknown name or an object that is not a recurrence.
    """
    return _REGISTRY.get(identifier, kwargs, deserialize)


def serialize(recurrence):
    """Serializes a recurrence to a Keras config dict."""
    return keras.saving.serialize_keras_object(recurrence)


def deserialize(config):
    """Inverse of `serialize`; refuses anything that is not a registered recurrence."""
    return _REGISTRY.deserialize(config)
