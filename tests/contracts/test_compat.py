"""`keras_linattn._compat`: each private Keras/TensorFlow access still works here, and no other module makes one.

One test per `_compat` entry runs the private API on the installed Keras and
TensorFlow and checks what the package relies on; it fails when a Keras or
TensorFlow release changes it. The scan at the end walks the package's
sources (`ast`, so docstrings and comments do not count) for private
Keras/TensorFlow names and modules outside `_compat.py`.
"""

import ast
import os
import re
import sys
import types
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_linattn import _compat

pytestmark = pytest.mark.jax

PACKAGE = Path(__file__).resolve().parents[2] / "keras_linattn"
ROOT = PACKAGE.parent

# Attributes (and the same names as strings: ``getattr(x, "_name")``) that are private Keras/TensorFlow API.
PRIVATE_ATTRIBUTES = frozenset(
    {
        "_flatten_layers",
        "_layers",
        "_trainable_variables",
        "_non_trainable_variables",
        "_seed_generators",
        "_trackable_children",
        "_tracked",
        "_tracker",
        "_self_setattr_tracking",
        "_initial_epoch",
        "train_function",
        "_filter_and_track_resources",
        "_tf_trackable",
        "_functional",
        "_inputs_struct",
        "_kernel",
        "_distribute_strategy",
        "_symbolic_build",
        "__internal__",
    }
)
PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.tsl")
# Private hooks a class may override; the module defining the override must call the check.
HOOKS = {
    "_trackable_children": "check_trackable_children_hook",
    "_symbolic_build": "check_symbolic_build_hook",
}
ALLOWED_FILES = frozenset({"keras_linattn/_compat.py"})
# Files another engineer owns, still with private access: `_compat` has what they need
# (`is_tf_symbolic_tensor`; `explicit_distribute_strategy`, `symbolic_build`, `check_symbolic_build_hook`).
# Remove each file once it calls `_compat`; `test_pending_owner_files_are_still_pending` says when.
PENDING_OWNER_FILES = frozenset()

VERSION = re.escape(f"Keras {keras.__version__}")


def _dense_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model


class _Holder(keras.layers.Layer):
    """A layer with sublayers (two attributes, a list), a weight and a seed generator of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(2)
        self.second = keras.layers.Dropout(0.5, seed=1)
        self.blocks = [keras.layers.Dense(2)]
        self.table = {"a": keras.layers.Dense(2)}
        self.generator = keras.random.SeedGenerator(3)

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(), initializer="ones")
        self.count = self.add_weight(name="count", shape=(), initializer="zeros", trainable=False)
        for layer in (self.first, self.blocks[0], self.table["a"]):
            layer.build(input_shape)

    def call(self, x, training=False):
        return self.second(self.first(x), training=training) * self.scale


# ---------------------------------------------------------------- layers


def test_flatten_layers_lists_every_sublayer_once():
    inner = keras.layers.Dense(2)
    holder = _Holder()
    shared = keras.layers.Dense(3)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, holder(shared(shared(inputs))))

    flat = _compat.flatten_layers(model)
    assert flat[0] is model
    assert [id(layer) for layer in flat] == list(dict.fromkeys(id(layer) for layer in flat))  # each once
    for layer in (shared, holder, holder.first, holder.second, holder.blocks[0], holder.table["a"]):
        assert any(layer is found for found in flat)
    assert all(found is not model for found in _compat.flatten_layers(model, include_self=False))
    direct = _compat.flatten_layers(model, include_self=False, recursive=False)
    assert any(layer is holder for layer in direct) and not any(layer is holder.first for layer in direct)
    assert _compat.flatten_layers(inner, include_self=False) == []


def test_sublayers_are_the_direct_tracked_layers_in_assignment_order():
    holder = _Holder()
    found = _compat.sublayers(holder)
    assert found[:2] == [holder.first, holder.second]
    assert any(layer is holder.blocks[0] for layer in found) and any(layer is holder.table["a"] for layer in found)
    assert not any(layer is holder for layer in found)


def test_own_variables_are_the_layers_own_in_save_own_variables_order():
    holder = _Holder()
    holder.build((None, 3))
    assert _compat.own_variables(holder) == [holder.scale, holder.count]  # not the sublayers'
    assert len(holder.weights) > 2
    norm = keras.layers.BatchNormalization()
    norm.build((None, 3))
    own = _compat.own_variables(norm)
    assert [v.path.rsplit("/", 1)[-1] for v in own] == ["gamma", "beta", "moving_mean", "moving_variance"]
    store = {}
    norm.save_own_variables(store)  # what `load_own_variables` reads back, by position
    assert sorted(store, key=int) == [str(i) for i in range(len(own))]
    for i, variable in enumerate(own):
        np.testing.assert_array_equal(store[str(i)], keras.ops.convert_to_numpy(variable))


def test_seed_generators_are_the_layers_own():
    holder = _Holder()
    assert _compat.seed_generators(holder) == [holder.generator]
    dropout = _compat.seed_generators(holder.second)
    assert len(dropout) == 1 and isinstance(dropout[0], keras.random.SeedGenerator)
    assert _compat.seed_generators(holder.first) == []


def test_unmerged_kernel_is_the_stored_kernel_without_lora():
    dense = keras.layers.EinsumDense("bd,de->be", output_shape=4)
    dense.build((None, 3))
    dense.enable_lora(2)
    kernel = _compat.unmerged_kernel(dense)
    assert any(kernel is v for v in _compat.own_variables(dense)) and kernel.shape == (3, 4)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(dense.kernel), keras.ops.convert_to_numpy(kernel))
    dense.lora_kernel_a.assign(np.ones((3, 2), "float32"))
    dense.lora_kernel_b.assign(np.ones((2, 4), "float32"))  # the public kernel now adds (alpha / r) A B
    delta = keras.ops.convert_to_numpy(dense.kernel) - keras.ops.convert_to_numpy(kernel)
    np.testing.assert_allclose(delta, np.full((3, 4), 2.0 * dense.lora_alpha / dense.lora_rank), rtol=1e-6)
    kernel.assign(np.zeros((3, 4), "float32"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(dense.kernel), delta, rtol=1e-6)


def test_mark_quantized_makes_keras_refuse_a_second_quantize_and_keep_the_policy():
    class _Own(keras.layers.Layer):
        calls = 0

        def build(self, input_shape):
            self.w = self.add_weight(shape=(3, 2))

        def quantize(self, mode=None, type_check=True, config=None):
            type(self).calls += 1
            _compat.mark_quantized(self)
            self.dtype_policy = keras.dtype_policies.get(f"{mode}_from_{self.dtype_policy.name}")

    layer = _Own()
    layer.build((None, 3))
    layer.quantize("int8")  # the policy setter would call `quantize` again on an unmarked layer
    assert _Own.calls == 1 and layer.quantization_mode == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        layer.quantize("int8")


# ------------------------------------------------------------ functional


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_is_functional_and_the_functional_input_structure():
    a, b = keras.Input((3,), name="a"), keras.Input((3,), name="b")
    functional = keras.Model({"a": a, "b": b}, keras.layers.Add()([a, b]))
    assert _compat.is_functional(functional)
    struct = _compat.functional_inputs_struct(functional)
    assert isinstance(struct, dict) and struct["a"] is a and struct["b"] is b
    sequential = _dense_model()
    assert _compat.is_functional(sequential)  # built: it wraps a functional model
    assert _compat.functional_inputs_struct(sequential) is None
    assert not _compat.is_functional(keras.Sequential([keras.layers.Dense(2)]))  # unbuilt
    subclassed = _Subclassed()
    assert not _compat.is_functional(subclassed)
    assert _compat.functional_inputs_struct(subclassed) is None


# ------------------------------------------------------------ training


def _data(batches, batch_size=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * batch_size, 3)).astype("float32")
    return x, x[:, :2]


def test_set_initial_epoch_from_on_train_begin_moves_the_start_of_fit():
    epochs = []

    class Start(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.set_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

        def on_train_end(self, logs=None):
            _compat.set_initial_epoch(self.model, None)

    model = _dense_model()
    x, y = _data(2)
    model.fit(x, y, epochs=4, batch_size=2, shuffle=False, verbose=0, callbacks=[Start()])
    assert epochs == [2, 3]
    epochs.clear()
    model.fit(x, y, epochs=1, batch_size=2, shuffle=False, verbose=0)  # reset: fit's own initial_epoch again
    assert epochs == []


def test_replace_train_function_draws_the_data_of_skipped_steps_on_this_backend():
    """The call form of `fit`'s train function on this backend (`make test-jax` runs it on JAX)."""
    draws = []

    def draw(iterator):
        if not isinstance(iterator, (list, tuple)):
            next(iterator)
        draws.append(type(iterator).__name__)
        return len(draws) == 2

    class Skip(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            _compat.replace_train_function(self.model, draw)

    model = _dense_model()
    x, y = _data(5)
    model.fit(x, y, epochs=1, batch_size=2, shuffle=False, verbose=0, callbacks=[Skip()])
    assert len(draws) == 2
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 3  # 5 batches, 2 skipped
    assert not hasattr(model.train_function, "_kla_original")  # the original is back


def test_replace_train_function_call_forms_and_restore():
    original = lambda *args: "trained"  # noqa: E731
    model = types.SimpleNamespace(train_function=original)
    _compat.replace_train_function(model, lambda iterator: False)
    _compat.replace_train_function(model, lambda iterator: False)
    assert model.train_function(iter([])) == {}  # TensorFlow and torch: (iterator) -> logs
    state = ("trainable", "non_trainable")
    logs, returned = model.train_function(state, iter([]))  # JAX: (state, iterator) -> (logs, state)
    assert logs == {} and returned is state
    with pytest.raises(TypeError, match="takes"):
        model.train_function(1, 2, 3)
    _compat.restore_train_function(model)
    assert model.train_function is original
    _compat.restore_train_function(model)  # nothing replaced: unchanged
    assert model.train_function is original


@pytest.mark.parametrize(
    ("backend", "call"),
    [
        ("tensorflow", "logs = self.train_function(iterator)"),
        ("jax", "logs, state = self.train_function(state, iterator)"),
        ("torch", "logs = self.train_function(data)"),
    ],
)
def test_fit_calls_the_train_function_in_the_form_replace_train_function_takes(backend, call):
    """Each backend's `fit` (read, not run: one backend runs per process) reads `self.train_function` per step."""
    import importlib.util

    spec = importlib.util.find_spec("keras")
    source = Path(spec.origin).parent / "src" / "backend" / backend / "trainer.py"
    text = source.read_text(encoding="utf-8")
    assert call in text, f"Keras {keras.__version__} changed {backend}'s train function call: {source}"
    fit = text[text.index("    def fit(") :]
    fit = fit[: fit.index("\n    def ", 1)]
    assert fit.index("self.make_train_function()") < fit.index("callbacks.on_train_begin()") < fit.index(call)
    assert fit.index("callbacks.on_train_begin()") < fit.index("self._initial_epoch or initial_epoch")


@pytest.mark.tf_only("the TensorFlow trainer's tf.distribute strategy and symbolic build")
def test_symbolic_build_hook_gets_the_batch_under_a_strategy():
    import tensorflow as tf

    _compat.check_symbolic_build_hook()
    batches = []

    class Hooked(_Subclassed):
        def _symbolic_build(self, iterator=None, data_batch=None):
            batches.append(data_batch)
            return _compat.symbolic_build(super(), iterator=iterator, data_batch=data_batch)

    assert _compat.explicit_distribute_strategy(_dense_model()) is None
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = Hooked()
        model.compile("sgd", "mse")
    assert _compat.explicit_distribute_strategy(model) is strategy
    x, y = _data(2)
    model.fit(x, y, epochs=1, batch_size=2, shuffle=False, verbose=0)
    assert batches and batches[0] is not None
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keras.tree.flatten(batches[0])[0]), x[:2])


# ---------------------------------------------------------- checkpoints


@pytest.mark.tf_only("tf.train.Checkpoint follows Keras layers on TensorFlow only")
def test_trackable_children_override_adds_checkpoint_children(tmp_path):
    import tensorflow as tf

    _compat.check_trackable_children_hook()

    class Hidden(keras.layers.Layer):
        def __init__(self, value):
            super().__init__()
            self.hidden = types.SimpleNamespace(variable=keras.Variable(value))  # TF does not follow it

        def _trackable_children(self, save_type="checkpoint", **kwargs):
            children = _compat.trackable_children(super(), save_type, **kwargs)
            if save_type == "checkpoint":
                children["extra"] = self.hidden.variable
            return children

    path = tf.train.Checkpoint(layer=Hidden(3.0)).write(str(tmp_path / "ckpt"))
    assert "layer/extra/.ATTRIBUTES/VARIABLE_VALUE" in [name for name, _ in tf.train.list_variables(path)]
    restored = Hidden(0.0)
    tf.train.Checkpoint(layer=restored).read(path).assert_existing_objects_matched()
    assert float(keras.ops.convert_to_numpy(restored.hidden.variable)) == 3.0


@pytest.mark.tf_only("Keras' TensorFlow layer records its tracked collections")
def test_tracked_collection_attributes_name_the_list_and_dict_attributes():
    names = _compat.tracked_collection_attributes(_Holder())
    assert "blocks" in names and "table" in names
    assert "first" not in names


# --------------------------------------------------------------- export


@pytest.mark.tf_only("a SavedModel export")
def test_export_resources_tracked_once_in_a_save_context(tmp_path):
    import tensorflow as tf

    model = _dense_model()
    traced = []

    def serve(x):
        traced.append(_compat.in_tf_save_context())
        return model(x)

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve, input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    trackable = _compat.export_archive_trackable(archive)
    assert {id(v) for v in trackable.variables} == {id(v) for v in model.variables}
    assert not _compat.in_tf_save_context()
    _compat.track_export_resources_once(archive, tf.saved_model.SaveOptions())
    archive.write_out(str(tmp_path / "export"), options=tf.saved_model.SaveOptions(), verbose=False)
    assert traced == [True]  # traced once, inside a save context, and reused by the save
    reloaded = tf.saved_model.load(str(tmp_path / "export"))
    x = np.ones((2, 3), "float32")
    np.testing.assert_allclose(reloaded.serve(x).numpy(), keras.ops.convert_to_numpy(model(x)), rtol=1e-6)


@pytest.mark.tf_only("tf.function(jit_compile=True)")
def test_tf_graph_under_xla_only_inside_jit_compiled_functions():
    import tensorflow as tf

    flags = []

    def probe():
        flags.append(_compat.tf_graph_under_xla(tf.compat.v1.get_default_graph()))
        return tf.constant(0.0)

    tf.function(probe, jit_compile=True)()
    tf.function(probe)()
    tf.function(lambda: tf.function(probe)(), jit_compile=True)()
    assert flags == [True, False, True]


@pytest.mark.tf_only("TensorFlow tensors")
def test_is_tf_symbolic_tensor_inside_traced_functions_only():
    import tensorflow as tf

    seen = []
    tf.function(lambda x: seen.append(_compat.is_tf_symbolic_tensor(x)) or x)(tf.constant(1.0))
    assert seen == [True]
    assert not _compat.is_tf_symbolic_tensor(tf.constant(1.0))
    assert not _compat.is_tf_symbolic_tensor(keras.Input((3,)))
    assert not _compat.is_tf_symbolic_tensor(np.ones(3))


@pytest.mark.tf_only("TensorFlow's Grappler")
def test_grappler_tf_optimizer_is_the_module_tf2onnx_calls():
    # tf2onnx runs Grappler through this module's OptimizeGraph (looked up at call time), which
    # export._onnx_grappler replaces during a conversion.
    import inspect

    from tensorflow.python.framework import convert_to_constants
    from tf2onnx import tf_loader

    module = _compat.grappler_tf_optimizer()
    assert module is not None and callable(module.OptimizeGraph)
    assert convert_to_constants.tf_optimizer is module  # the function inlining's Grappler call
    source = inspect.getsource(tf_loader.tf_optimize_grappler)  # tf2onnx's own call, imported at call time
    assert "from tensorflow.python.grappler import tf_optimizer" in source and ".OptimizeGraph(" in source


@pytest.mark.tf_only("TensorFlow's deprecation notices")
def test_silence_tf_deprecation_silences_only_inside():
    # TF's switch for its deprecation notices: off inside the block, restored after it
    # (checked on the switch itself: whether a notice reaches a log handler depends on
    # what else ran in the process, as TF prints each function's notice once).
    from tensorflow.python.util import deprecation

    before = deprecation._PRINT_DEPRECATION_WARNINGS
    with _compat.silence_tf_deprecation():
        assert deprecation._PRINT_DEPRECATION_WARNINGS is False
    assert deprecation._PRINT_DEPRECATION_WARNINGS == before


# ------------------------------------------------------ deferred build


def test_variables_made_in_the_deferred_scope_wait_in_the_registry_without_a_value():
    before = list(_compat.uninitialized_variables())
    with _compat.deferred_initialization_scope():
        variable = keras.Variable(initializer="ones", shape=(2,), dtype="float32")
    try:
        assert variable._value is None  # noqa: SLF001 - deferred: no value yet
        assert [v for v in _compat.uninitialized_variables() if v is variable] == [variable]
    finally:
        _compat.set_uninitialized_variables([v for v in _compat.uninitialized_variables() if v is not variable])
    assert [id(v) for v in _compat.uninitialized_variables()] == [id(v) for v in before]
    variable._deferred_initialize()  # noqa: SLF001
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), np.ones(2, "float32"))


# --------------------------------------------------------- .keras files


def test_keras_file_save_asks_the_memory_check(tmp_path):
    original = _compat.keras_file_memory_check()
    asked = []

    def check(model):
        asked.append(model)
        return original(model)

    model = _dense_model()
    _compat.set_keras_file_memory_check(check)
    try:
        model.save(tmp_path / "m.keras")
        keras.saving.load_model(tmp_path / "m.keras")
    finally:
        _compat.set_keras_file_memory_check(original)
    assert _compat.keras_file_memory_check() is original
    assert asked and asked[0] is model and len(asked) == 2  # the save, then the load


# ---------------------------------------------------------------- guards


def test_a_missing_private_attribute_is_an_error_naming_the_versions(monkeypatch):
    with pytest.raises(RuntimeError, match=f"{VERSION}.*"):
        _compat.seed_generators(types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="_initial_epoch"):
        _compat.set_initial_epoch(types.SimpleNamespace(), 1)
    with pytest.raises(RuntimeError, match="train_function"):
        _compat.replace_train_function(types.SimpleNamespace(train_function=None), lambda iterator: True)
    model = _dense_model()
    monkeypatch.delattr(keras.layers.Layer, "_flatten_layers")
    with pytest.raises(RuntimeError, match=f"Layer._flatten_layers.*{VERSION}"):
        _compat.flatten_layers(model)


@pytest.mark.tf_only("TensorFlow's private modules")
def test_a_missing_private_module_is_an_error_naming_the_versions(monkeypatch):
    import tensorflow as tf

    monkeypatch.setitem(sys.modules, "tensorflow.python.ops.control_flow_util", None)  # import fails
    with pytest.raises(RuntimeError, match=f"control_flow_util.*{VERSION}.*TensorFlow {re.escape(tf.__version__)}"):
        _compat.tf_graph_under_xla(None)


def test_a_missing_private_keras_module_is_an_error_naming_the_versions(monkeypatch):
    for module, entry in (
        ("keras.src.backend.common.stateless_scope", _compat.deferred_initialization_scope),
        ("keras.src.backend.common.global_state", _compat.uninitialized_variables),
        ("keras.src.saving.saving_lib", _compat.keras_file_memory_check),
    ):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # import fails
            with pytest.raises(RuntimeError, match=f"{re.escape(module)}.*{VERSION}"):
                entry()


def _entries():
    return sorted(
        name
        for name, value in vars(_compat).items()
        if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == _compat.__name__
    )


def test_every_entry_has_a_docstring_and_a_test_here():
    source = Path(__file__).read_text(encoding="utf-8")
    assert _entries()
    for name in _entries():
        assert (getattr(_compat, name).__doc__ or "").strip(), f"_compat.{name} has no docstring"
        assert source.count(f"_compat.{name}(") >= 1, f"_compat.{name} has no test in {Path(__file__).name}"


# ------------------------------------------------------------------ scan


def _findings(path):
    """``(line, what)`` for each private Keras/TensorFlow access in one source file."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    fstring_parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in fstring_parts:
            if node.value in PRIVATE_ATTRIBUTES or node.value.startswith(PRIVATE_MODULES):
                found.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.startswith(PRIVATE_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in HOOKS:
            if f"_compat.{HOOKS[node.name]}()" not in text:
                found.append((node.lineno, f"override of {node.name} without _compat.{HOOKS[node.name]}()"))
    return found


def _package_findings():
    findings = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if "__pycache__" in path.parts or relative in ALLOWED_FILES:
            continue
        found = _findings(path)
        if found:
            findings[relative] = found
    return findings


def test_the_scan_finds_each_kind_of_private_access(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import tensorflow.python.ops\n"
        "from keras.src.models import functional\n"
        "x = model._flatten_layers()\n"
        "y = getattr(layer, '_seed_generators', [])\n"
        "z = tf.__internal__.SymbolicTensor\n"
        "m = importlib.import_module('tensorflow.python.util.deprecation')\n"
        "class A:\n"
        "    def _symbolic_build(self):\n"
        "        pass\n"
        '"""Docstrings may name keras.src and ._flatten_layers."""\n'
        "# comments too: tensorflow.python, model._layers\n"
        "name = f'{prefix}_kernel'\n",
        encoding="utf-8",
    )
    assert sorted(line for line, _ in _findings(sample)) == [1, 2, 3, 4, 5, 6, 8]


def test_no_private_keras_or_tensorflow_access_outside_compat():
    findings = {path: found for path, found in _package_findings().items() if path not in PENDING_OWNER_FILES}
    assert not findings, "private Keras/TensorFlow access outside keras_linattn/_compat.py: " + "; ".join(
        f"{path}:{line} {what}" for path, found in findings.items() for line, what in found
    )


def test_pending_owner_files_are_still_pending():
    findings = _package_findings()
    done = sorted(path for path in PENDING_OWNER_FILES if path not in findings)
    assert not done, f"no private access left in {done}: remove them from PENDING_OWNER_FILES"
    assert all(os.path.exists(ROOT / path) for path in PENDING_OWNER_FILES)
