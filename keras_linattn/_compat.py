"""Every access of the package to private Keras and TensorFlow API, in one place.

The rest of the package calls the functions here and touches no private
Keras/TensorFlow attribute or module itself (`tests/contracts/test_compat.py`
scans the sources for it). Each entry says

- which public API it stands in for, or why no public API does it;
- which backends it applies to;
- and checks, where it is used, that the private attribute or module
  exists: a Keras or TensorFlow without it raises `RuntimeError` naming the
  versions and the missing name, never a silent change of behaviour.

`tests/contracts/test_compat.py` runs each entry on the installed Keras and
TensorFlow and checks that it still behaves as the package relies on.
Supported versions: the ones `pyproject.toml` requires.
"""

import contextlib
import importlib
import inspect

import keras

__all__ = []


def _versions():
    try:
        import tensorflow as tf

        tensorflow = tf.__version__
    except ImportError:  # pragma: no cover - TensorFlow is a dependency
        tensorflow = "not installed"
    return f"Keras {keras.__version__}, TensorFlow {tensorflow}, backend {keras.backend.backend()!r}"


def _missing(name, use):
    return RuntimeError(
        f"keras_linattn relies on the private {name} ({use}), which this installation does not have "
        f"({_versions()}). This Keras/TensorFlow version is not supported: install the versions that "
        "keras_linattn's requirements name, or report it."
    )


def _attribute(obj, name, use):
    """``obj.<name>``, or RuntimeError (see `_missing`) when it does not exist."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = obj.__thisclass__ if isinstance(obj, super) else type(obj)  # `super()`: the class it was called in
        raise _missing(f"attribute `{owner.__name__}.{name}`", use) from None


def _require_class_attribute(cls, name, use):
    if not hasattr(cls, name):
        raise _missing(f"attribute `{cls.__module__}.{cls.__qualname__}.{name}`", use)


def _module(path, use):
    try:
        return importlib.import_module(path)
    except ImportError:
        raise _missing(f"module `{path}`", use) from None


def _tensorflow_backend():
    return keras.backend.backend() == "tensorflow"


# ---------------------------------------------------------------- layers
# All backends.


def flatten_layers(layer, include_self=True, recursive=True):
    """``layer._flatten_layers(include_self, recursive)``: the layer and every Keras-tracked sublayer.

    No public API lists a layer's sublayers: ``Model.layers`` gives a
    model's direct layers only, and a plain layer has none. Every layer is
    listed once (Keras' own `_symbolic_build` and ``Model.layers`` use it).
    """
    _require_class_attribute(keras.layers.Layer, "_flatten_layers", "walking the sublayers of a model")
    return layer._flatten_layers(include_self=include_self, recursive=recursive)


def sublayers(layer):
    """``layer._layers``: the layer's direct Keras-tracked sublayers, in assignment order.

    No public API: as for `flatten_layers`.
    """
    return list(_attribute(layer, "_layers", "the direct sublayers of a layer"))


def own_variables(layer):
    """``layer._trainable_variables + layer._non_trainable_variables``: the variables the layer created itself.

    ``layer.weights`` (public) adds every sublayer's; the own ones are
    those ``save_own_variables`` / ``load_own_variables`` store, in that
    order (trainable first).
    """
    use = "the variables a layer created itself"
    return list(_attribute(layer, "_trainable_variables", use)) + list(
        _attribute(layer, "_non_trainable_variables", use)
    )


def seed_generators(layer):
    """``layer._seed_generators``: the `keras.random.SeedGenerator` objects the layer created itself.

    No public API lists them (nor saves their state: dropout masks).
    """
    return list(_attribute(layer, "_seed_generators", "the seed generators of a layer (dropout masks)"))


def unmerged_kernel(layer):
    """``layer._kernel``: the kernel variable of a `keras.layers.EinsumDense` (or `Dense`), without LoRA.

    The public ``kernel`` adds the LoRA update (``W + (alpha / r) A B``) when
    LoRA is enabled; no public API reaches the frozen ``W`` that is stored.
    """
    return _attribute(layer, "_kernel", "saving and loading a LoRA projection's frozen kernel")


def mark_quantized(layer):
    """Sets ``layer._is_quantized``: the flag Keras' own layers set in ``quantized_build``.

    A layer that implements ``quantize`` itself (not through `Dense` /
    `EinsumDense`) sets it so that Keras refuses a second ``quantize`` and
    the ``dtype_policy`` setter does not quantize the layer again when it
    installs the quantized policy. No public API sets it.
    """
    # The method that reads the flag (with the `dtype_policy` setter).
    _require_class_attribute(keras.layers.Layer, "_check_quantize_args", "marking a layer quantized")
    layer._is_quantized = True


# ------------------------------------------------------------ functional
# All backends.


def is_functional(model):
    """Whether `model` is a functional model, or a Sequential (which wraps one: ``Sequential._functional``).

    Keras exports no functional model class (``keras.Model(inputs,
    outputs)`` builds a ``keras.src.models.functional.Functional``): the
    class is found by name, which stays true to the package's earlier check.
    """
    use = "telling functional models from subclassed ones"
    _attribute(_module("keras.src.models.functional", use), "Functional", use)
    if any(cls.__name__ == "Functional" for cls in type(model).__mro__):
        return True
    if isinstance(model, keras.Sequential):
        return _attribute(model, "_functional", "the functional model inside a Sequential") is not None
    return getattr(model, "_functional", None) is not None


def functional_inputs_struct(model):
    """``model._inputs_struct``: a functional model's inputs in the structure it was built with; else None.

    ``model.input`` is the same object for a functional model, but a
    Sequential has no ``_inputs_struct`` (its ``input`` may be a list) and
    the package packs a Sequential's inputs as one tensor: kept as it was.
    """
    if any(cls.__name__ == "Functional" for cls in type(model).__mro__):
        return _attribute(model, "_inputs_struct", "the input structure of a functional model")
    return getattr(model, "_inputs_struct", None)


# ------------------------------------------------------------ training
# `fit` on every backend; the call form of the train function differs.

_ORIGINAL_TRAIN_FUNCTION = "_kla_original"


def set_initial_epoch(model, epoch):
    """``model._initial_epoch = epoch``: the epoch a running `fit` starts at (None: `fit`'s argument).

    No public API: a callback cannot change `fit`'s ``initial_epoch``.
    Keras' own `keras.callbacks.BackupAndRestore` sets this attribute in
    ``on_train_begin``; every backend's `fit` reads it right after.
    """
    _attribute(model, "_initial_epoch", "resuming `fit` at a later epoch")
    model._initial_epoch = epoch


def replace_train_function(model, draw):
    """Makes `model`'s next train steps draw their data and train nothing.

    The train function ``fit`` made is replaced by one with its call form
    that calls ``draw(iterator)`` (the epoch iterator, or the batch already
    drawn) and returns empty logs; when ``draw`` returns True the original
    function is put back. No public API skips steps while still drawing
    their data.

    The call forms (``fit`` reads ``model.train_function`` at each step):
    TensorFlow and torch ``train_function(iterator) -> logs``; JAX
    ``train_function(state, iterator) -> (logs, state)`` with the model's
    variables in and out as a state tuple (keras/src/backend/jax/trainer.py),
    handed back unchanged here.
    """
    original = _attribute(model, "train_function", "skipping the train steps of a resumed epoch")
    if not callable(original):
        raise RuntimeError(
            "keras_linattn relies on `fit` making `model.train_function` before `on_train_begin` (skipping the "
            f"train steps of a resumed epoch), which this installation does not do ({_versions()}): "
            f"`train_function` is {original!r}. This Keras version is not supported."
        )

    def replay(*args):
        if len(args) == 2:
            state, iterator = args
        elif len(args) == 1:
            state, iterator = None, args[0]
        else:
            raise TypeError(f"A train function takes (iterator) or (state, iterator). Received: {len(args)} arguments")
        if draw(iterator):
            model.train_function = original
        return {} if len(args) == 1 else ({}, state)

    setattr(replay, _ORIGINAL_TRAIN_FUNCTION, original)
    model.train_function = replay


def restore_train_function(model):
    """Puts back the train function that `replace_train_function` replaced (no-op when none is)."""
    function = getattr(model, "train_function", None)
    while getattr(function, _ORIGINAL_TRAIN_FUNCTION, None) is not None:
        function = getattr(function, _ORIGINAL_TRAIN_FUNCTION)
    if function is not None:
        model.train_function = function


def explicit_distribute_strategy(model):
    """``model._distribute_strategy``: the `tf.distribute` strategy the model was created under, or None.

    The public ``model.distribute_strategy`` falls back to the default
    strategy, so it cannot tell whether one was set. TensorFlow backend
    (its trainer sets the attribute); None elsewhere.
    """
    if _tensorflow_backend():
        return _attribute(model, "_distribute_strategy", "whether a model runs under a tf.distribute strategy")
    return getattr(model, "_distribute_strategy", None)


def check_symbolic_build_hook():
    """Checks that Keras still has the ``Trainer._symbolic_build(iterator=None, data_batch=None)`` hook.

    A model overriding it adapts the batch Keras builds the compiled loss
    and metrics from (the TensorFlow trainer calls it under a
    `tf.distribute` strategy); no public hook does. Call it where the
    override is defined: a renamed hook would never be called.
    """
    _require_class_attribute(keras.Model, "_symbolic_build", "adapting the batch of Keras' symbolic build")
    parameters = inspect.signature(keras.Model._symbolic_build).parameters
    if "iterator" not in parameters or "data_batch" not in parameters:
        raise _missing(
            "`Trainer._symbolic_build(iterator, data_batch)` arguments",
            f"adapting the batch of Keras' symbolic build; it takes {list(parameters)}",
        )


def symbolic_build(parent, iterator=None, data_batch=None):
    """``parent._symbolic_build(iterator=..., data_batch=...)``: Keras' build, from an override (``super()``)."""
    build = _attribute(parent, "_symbolic_build", "Keras' symbolic build of the compiled loss and metrics")
    return build(iterator=iterator, data_batch=data_batch)


# ---------------------------------------------------------- checkpoints
# TensorFlow backend: there a Keras layer is a TF trackable; elsewhere
# `tf.train.Checkpoint` never sees it and the hook is never called.


def check_trackable_children_hook():
    """Checks that a Keras layer still has TF's ``Trackable._trackable_children(save_type, **kwargs)``.

    The hook through which `tf.train.Checkpoint` lists an object's
    children; no public API adds children to it (TF documents only
    attribute assignment). Call it where an override is defined: a renamed
    hook would never be called and checkpoints would silently miss
    variables. TensorFlow backend only; a no-op elsewhere.
    """
    if _tensorflow_backend():
        _require_class_attribute(keras.layers.Layer, "_trackable_children", "tf.train.Checkpoint of every variable")


def trackable_children(parent, save_type, **kwargs):
    """``parent._trackable_children(save_type, **kwargs)``: the children TF lists, from an override (``super()``)."""
    children = _attribute(parent, "_trackable_children", "tf.train.Checkpoint of every variable")
    return children(save_type, **kwargs)


def tracked_collection_attributes(layer):
    """``layer._tracked``: the names of the layer's attributes that hold a Keras-tracked list, dict or set.

    TensorFlow backend (Keras' TF layer records them); no public API lists
    them. An empty list elsewhere.
    """
    if _tensorflow_backend():
        return list(_attribute(layer, "_tracked", "tf.train.Checkpoint of the layers and variables in lists"))
    return list(getattr(layer, "_tracked", []))


# --------------------------------------------------------------- export
# TensorFlow backend (SavedModel export and the TF1 loader).


def export_archive_trackable(archive):
    """``archive._tf_trackable``: the object a `keras.export.ExportArchive` writes out, with its variable lists.

    No public API reaches it; the package lists each `tf.Variable` there
    once instead of also its Keras wrapper.
    """
    return _attribute(archive, "_tf_trackable", "saving each SavedModel variable once")


def in_tf_save_context():
    """``tensorflow.python.saved_model.save_context.in_save_context()``: whether a SavedModel save is running.

    No public TF API tells it.
    """
    save_context = _module("tensorflow.python.saved_model.save_context", "tracing each signature once")
    return _attribute(save_context, "in_save_context", "tracing each signature once")()


def track_export_resources_once(archive, options):
    """Runs ``archive._filter_and_track_resources()`` inside a TF save context, and not again in ``write_out``.

    `ExportArchive.write_out` lists the endpoints' variables (a trace
    outside a save context), then `tf.saved_model.save` traces them again
    inside one. Listing them inside a save context lets the save reuse that
    trace. No public API: `write_out` has no option for it.
    """
    use = "tracing each signature once"
    save_context = _module("tensorflow.python.saved_model.save_context", use)
    track = _attribute(archive, "_filter_and_track_resources", use)
    with _attribute(save_context, "save_context", use)(options):
        track()
    archive._filter_and_track_resources = lambda: None  # done above; `write_out` would trace again


def tf_graph_under_xla(graph):
    """``control_flow_util.GraphOrParentsInXlaContext(graph)``: whether `graph` is compiled by XLA.

    TensorFlow only; no public API tells whether ops being built are inside
    a ``tf.function(jit_compile=True)`` (nested functions included).
    """
    control_flow_util = _module("tensorflow.python.ops.control_flow_util", "choosing the XLA forms of some ops")
    in_xla = _attribute(control_flow_util, "GraphOrParentsInXlaContext", "choosing the XLA forms of some ops")
    return bool(in_xla(graph))


def is_tf_symbolic_tensor(x):
    """``isinstance(x, tf.__internal__.SymbolicTensor)``: a graph tensor (no value) of a traced TF function.

    TensorFlow only; ``tf.is_symbolic_tensor`` (public) also counts Keras
    symbolic tensors and is not a type check.
    """
    import tensorflow as tf

    internal = _attribute(tf, "__internal__", "telling traced tensors from eager ones")
    return isinstance(x, _attribute(internal, "SymbolicTensor", "telling traced tensors from eager ones"))


def grappler_tf_optimizer():
    """``tensorflow.python.grappler.tf_optimizer``: the module whose ``OptimizeGraph`` runs Grappler on a graph.

    No public API reaches the Grappler call that tf2onnx's conversion goes
    through; `export._onnx_grappler` replaces its ``OptimizeGraph`` for the
    length of a conversion, to keep Grappler from allocating a fake copy of
    every weight. TensorFlow only (export). Returns None where TensorFlow has
    no such module or function: the export then converts as before (the same
    graph, with Grappler's copy of the weights), so this is not an error.
    """
    try:
        module = importlib.import_module("tensorflow.python.grappler.tf_optimizer")
    except ImportError:
        return None
    return module if callable(getattr(module, "OptimizeGraph", None)) else None


@contextlib.contextmanager
def silence_tf_deprecation():
    """``tensorflow.python.util.deprecation.silence()``: TF's deprecation notices off inside the block.

    TensorFlow only; no public switch (the TF1 SavedModel loader logs one
    that is not for the package's users).
    """
    deprecation = _module("tensorflow.python.util.deprecation", "silencing the TF1 loader's deprecation notice")
    with _attribute(deprecation, "silence", "silencing the TF1 loader's deprecation notice")():
        yield


# ------------------------------------------------------ deferred build
# All backends (Keras' own backend-independent variable code).

_UNINITIALIZED = "uninitialized_variables"


def deferred_initialization_scope():
    """``StatelessScope(initialize_variables=False)`` (``keras.src.backend.common.stateless_scope``).

    Variables created inside it hold no value until initialized (the
    mechanism Keras' JAX trainer uses); Keras lists them in its global
    ``uninitialized_variables``. No public API defers a variable's
    initializer: `linearize` builds its student this way so that the
    teacher's weights are the student's first values.
    """
    use = "building a model without initializing its variables"
    module = _module("keras.src.backend.common.stateless_scope", use)
    return _attribute(module, "StatelessScope", use)(initialize_variables=False)


def uninitialized_variables():
    """Keras' global list ``uninitialized_variables`` (``keras.src.backend.common.global_state``).

    The variables created under `deferred_initialization_scope` and not
    initialized yet; no public API lists them.
    """
    use = "the variables whose initialization was deferred"
    global_state = _module("keras.src.backend.common.global_state", use)
    return _attribute(global_state, "get_global_attribute", use)(_UNINITIALIZED, [], set_to_default=True)


def set_uninitialized_variables(variables):
    """Sets Keras' global list ``uninitialized_variables`` to `variables` (see `uninitialized_variables`)."""
    use = "the variables whose initialization was deferred"
    global_state = _module("keras.src.backend.common.global_state", use)
    _attribute(global_state, "set_global_attribute", use)(_UNINITIALIZED, list(variables))


# --------------------------------------------------------- .keras files
# All backends.


def keras_file_memory_check():
    """``keras.src.saving.saving_lib.is_memory_sufficient``: Keras' choice of in-memory or streamed weights.

    `keras.saving.save_model` and `load_model` call it with the model; on
    False they stream the weights file instead of holding a copy in
    memory. No public option chooses.
    """
    use = "streaming the weights of large models in .keras files"
    return _attribute(_module("keras.src.saving.saving_lib", use), "is_memory_sufficient", use)


def set_keras_file_memory_check(function):
    """Makes Keras' `.keras` save and load call ``function(model)`` (see `keras_file_memory_check`)."""
    keras_file_memory_check()  # the guard: the name Keras calls exists
    _module("keras.src.saving.saving_lib", "streaming .keras weights").is_memory_sufficient = function
