"""A student built without initializing its variables, so that the teacher's weights are its first values.

`linearize` builds the student beside the teacher. Built the usual way, each
student variable is first filled by its initializer (the whole model: one
more copy of the weights, and on TensorFlow the random initializers'
temporaries on top, about three times the largest weight), then overwritten
by the teacher's. At the Llama 3.2 1B shape that is 4.6 GiB of weights and a
3 GiB embedding temporary held only to be thrown away.

Keras defers the initialization of variables created inside a
``StatelessScope`` (the mechanism its JAX trainer uses): a deferred variable
holds no value until initialized. `deferred` builds the student that
way; `put` gives a deferred variable its first value (the teacher's, shared
copy-on-write on TensorFlow) or assigns an initialized one; on leaving
`deferred`, what the teacher had no counterpart for (feature maps, gates)
is initialized with its own initializer. Where Keras lacks this mechanism,
the student is built the usual way and `put` assigns.
"""

import contextlib

import keras

from keras_linattn import _compat

__all__ = ["deferred", "is_pending", "put"]


def _registry():
    """Keras' list of variables awaiting their initializer, or None where Keras has none."""
    try:
        return _compat.uninitialized_variables()
    except RuntimeError:  # another Keras layout: the student is built the usual way
        return None


def _set_registry(variables):
    _compat.set_uninitialized_variables(variables)


def _scope():
    try:
        return _compat.deferred_initialization_scope()
    except RuntimeError:  # another Keras layout: the student is built the usual way
        return None


def build(make):
    """``(make(), pending)``: the model, built with its variables' initialization deferred.

    Args:
        make: a function of no arguments that builds the model.

    Returns:
        The model and the list of its variables still to initialize (empty
        where Keras cannot defer).
    """
    scope = _scope()
    registry = _registry()
    if scope is None or registry is None:
        return make(), []
    before = {id(v) for v in registry}
    with scope:
        model = make()
    return model, [v for v in _registry() if id(v) not in before]


def is_pending(variable):
    """True for a variable whose initialization was deferred and has not happened yet."""
    return getattr(variable, "_initializer", None) is not None and getattr(variable, "_value", 0) is None


def put(target, value):
    """Gives `target` the value `value` (a tensor, array or variable of its shape)."""
    if is_pending(target):
        target._initialize(keras.ops.convert_to_tensor(value, dtype=target.dtype))
        target._initializer = None
    else:
        target.assign(value)


def finish(pending):
    """Initializes the variables of `pending` still without a value, and drops them from Keras' list."""
    try:
        for v in pending:
            if is_pending(v):
                v._deferred_initialize()
    finally:
        discard(pending)


def discard(pending):
    """Removes `pending` from Keras' list of variables awaiting initialization."""
    if not pending:
        return
    done = {id(v) for v in pending}
    _set_registry([v for v in _registry() if id(v) not in done])


@contextlib.contextmanager
def deferred(make):
    """``with deferred(make) as model``: the model built deferred; its other variables initialized on exit."""
    model, pending = build(make)
    try:
        yield model
        finish(pending)
    finally:
        discard(pending)
