"""The declared API: each public module lists its names once in ``__all__``; importing it has no side effects."""

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import keras_linattn

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def _public_modules():
    """Every module of the package whose dotted path has no private (``_``) part."""
    names = ["keras_linattn"]
    for info in pkgutil.walk_packages(keras_linattn.__path__, "keras_linattn."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


PUBLIC_MODULES = _public_modules()
PACKAGES = [name for name in PUBLIC_MODULES if hasattr(importlib.import_module(name), "__path__")]


def test_import_changes_no_environment_variable_and_loads_no_export_toolchain():
    code = textwrap.dedent(
        """
        import json, os, sys
        import keras  # Keras and its backend (TensorFlow by default) set their own variables on import
        before = dict(os.environ)
        import keras_linattn
        after = dict(os.environ)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        toolchain = sorted(m for m in ("tf2onnx", "onnx", "onnxruntime") if m in sys.modules)
        print(json.dumps({"changed": changed, "toolchain": toolchain, "backend": keras.backend.backend()}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"changed": [], "toolchain": [], "backend": "tensorflow"}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_declares_its_names(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__ list"
    declared = module.__all__
    assert len(declared) == len(set(declared)), f"{name}.__all__ lists a name twice"
    missing = [n for n in declared if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what the module does not have: {missing}"
    # A function or class defined here without a leading underscore is public: it must be declared.
    undeclared = sorted(
        n
        for n, value in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == name
        and n not in declared
    )
    assert not undeclared, f"{name} defines public names missing from its __all__: {undeclared}"


@pytest.mark.parametrize("name", [p for p in PACKAGES if p != "keras_linattn"])
def test_a_package_re_exports_names_declared_by_its_modules(name):
    """Declared once: a subpackage's ``__all__`` adds no name that no submodule declares."""
    package = importlib.import_module(name)
    declared_below = {}
    for info in pkgutil.iter_modules(package.__path__, name + "."):
        if info.name.rsplit(".", 1)[1].startswith("_"):
            continue
        for n in importlib.import_module(info.name).__all__:
            declared_below.setdefault(n, []).append(info.name)
    twice = {n: mods for n, mods in declared_below.items() if len(mods) > 1}
    assert not twice, f"names declared by more than one module of {name}: {twice}"
    extra = sorted(set(package.__all__) - set(declared_below))
    assert not extra, f"{name}.__all__ lists names no submodule declares: {extra}"
    for n in package.__all__:
        home = sys.modules[declared_below[n][0]]
        assert getattr(package, n) is getattr(home, n), f"{name}.{n} is not {home.__name__}.{n}"
