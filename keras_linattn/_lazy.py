"""Loading on first use: module proxies, and work to do once another package is imported.

The standard library only. `keras_linattn.serving` must run with numpy and
onnxruntime alone, so the modules it reaches name Keras and TensorFlow
through `module` proxies (imported on first attribute access) and register
their classes with Keras through `after_import` (done when Keras is
imported, by whoever imports it).
"""

import importlib
import importlib.abc
import sys
import threading
import types
import warnings

__all__ = []


class _LazyModule(types.ModuleType):
    """Stands for the module `name`: the first attribute read imports it."""

    def __init__(self, name):
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr):
        module = self.__dict__.get("_lazy_module")
        if module is None:
            module = importlib.import_module(self.__dict__["_lazy_name"])
            self.__dict__["_lazy_module"] = module
        return getattr(module, attr)

    def __repr__(self):
        return f"<lazy module {self.__dict__['_lazy_name']!r}>"


def module(name):
    """A proxy of the module `name`, imported when one of its attributes is first read.

    Args:
        name: dotted module name (``"tensorflow"``, ``"keras.ops"``).

    Returns:
        The module itself when it is imported already, else the proxy.
    """
    loaded = sys.modules.get(name)
    if loaded is not None and not _initializing(loaded):
        return loaded
    return _LazyModule(name)


def _initializing(mod):
    return bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def is_imported(name):
    """True when the module `name` is imported and done executing."""
    loaded = sys.modules.get(name)
    return loaded is not None and not _initializing(loaded)


_lock = threading.RLock()
_pending = {}  # module name -> [callables] run once that module is imported


def after_import(name, callback):
    """Runs `callback()` now if the module `name` is imported, else right after its import completes.

    A callback that raises is reported as a warning: it never breaks the
    import that triggered it.

    Args:
        name: a top-level module name (``"keras"``, ``"keras_hub"``).
        callback: a function of no arguments.
    """
    with _lock:
        if not is_imported(name):
            _pending.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    _run(name, [callback])


def _run(name, callbacks):
    for callback in callbacks:
        try:
            callback()
        except Exception as e:  # noqa: BLE001 - the user's import of `name` must not fail because of ours
            warnings.warn(
                f"keras_linattn could not finish its set-up after {name!r} was imported "
                f"({type(e).__name__}: {e}); import keras_linattn.models to see the error.",
                RuntimeWarning,
                stacklevel=3,
            )


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, mod):
        spec = mod.__spec__
        spec.loader = mod.__loader__ = self._loader  # the module keeps its own loader (resources, reloads)
        self._loader.exec_module(mod)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        _run(self._name, callbacks)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module that callbacks wait for."""

    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_FINDER = _AfterImportFinder()


def package_attributes(package, names, submodules):
    """`__getattr__` and `__dir__` of a package whose names load their modules on first use (PEP 562).

    Args:
        package: the package's dotted name (its ``__name__``).
        names: ``{public name: submodule that defines it}``.
        submodules: submodule names reachable as attributes.

    Returns:
        ``(__getattr__, __dir__)``, to assign at the package's top level.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name):
        if name in names:
            value = getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(names) | set(submodules))

    return __getattr__, __dir__
