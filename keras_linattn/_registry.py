"""Name registries: feature maps, recurrences and samplers are looked up by name.

`NameRegistry` holds ``name -> class`` for one kind of object, registers
each class with Keras (so configs naming it load under ``safe_mode=True``),
resolves the identifiers users pass (a name, a serialized config or an
instance) with errors that name the argument, and deserializes the Keras
configs of its classes, refusing any other class.
"""

from keras_linattn import _lazy

keras = _lazy.module("keras")  # loaded on first use: samplers are read without Keras (keras_linattn.serving)


class NameRegistry:
    """Registered classes of one kind, by name.

    Args:
        kind: what the classes are, for messages (``"feature map"``).
        argument: the argument users pass identifiers as (``"feature_map"``).
        base: the base class every registered class must subclass.
    """

    def __init__(self, kind, argument, base):
        self.kind = kind
        self.argument = argument
        self.base = base
        self._classes = {}

    def register(self, name):
        """Class decorator: registers a subclass of `base` under `name` and with Keras."""

        def decorator(cls):
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind.capitalize()} name {name!r} is already registered.")
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{cls.__name__} must subclass {self.base.__name__} to be registered.")
            self._classes[name] = cls
            cls.registry_name = name
            # With Keras: now if it is imported, else when it is (`keras_linattn.serving` runs without it).
            _lazy.after_import("keras", lambda: keras.saving.register_keras_serializable(package="keras_linattn")(cls))
            return cls

        return decorator

    def available(self):
        """Sorted list of registered names."""
        return sorted(self._classes)

    def by_class_name(self):
        """``{class.__name__: class}`` of the registered classes."""
        return {cls.__name__: cls for cls in self._classes.values()}

    def deserialize(self, config):
        """Inverse of ``keras.saving.serialize_keras_object`` for a registered class; refuses any other.

        The class name is checked before Keras resolves anything, so a config
        naming an unregistered class (or no class) raises without importing
        or calling it.

        Raises:
            ValueError: for a config whose ``class_name`` is not a registered
                class, or that does not deserialize to a `base` instance.
        """
        class_name = config.get("class_name") if isinstance(config, dict) else None
        known = set(self.by_class_name())
        if class_name not in known:
            raise ValueError(
                f"Unknown {self.kind} in config. Received: class_name={class_name!r}. Known: {sorted(known)}"
            )
        obj = keras.saving.deserialize_keras_object(config)
        if not isinstance(obj, self.base):
            raise ValueError(f"Config does not describe a {self.base.__name__}. Received: {config!r}")
        return obj

    def get(self, identifier, kwargs, deserialize):
        """Resolves a name (built with `kwargs`), a config (`deserialize`) or an instance."""
        if isinstance(identifier, self.base):
            if kwargs:
                raise ValueError(
                    f"Constructor arguments can only be given with a {self.kind} name. "
                    f"Received: {self.argument}={identifier!r}, kwargs={kwargs}"
                )
            return identifier
        if isinstance(identifier, str):
            cls = self._classes.get(identifier)
            if cls is None:
                raise ValueError(
                    f"Unknown {self.kind}. Received: {self.argument}={identifier!r}. Available: {self.available()}"
                )
            return cls(**kwargs)
        if isinstance(identifier, dict):
            return deserialize(identifier)
        raise ValueError(
            f"`{self.argument}` must be a name, a serialized config or a {self.base.__name__} "
            f"instance. Received: {self.argument}={identifier!r}"
        )
