"""Whether the graph being built will be compiled by XLA: some ops have a faster form there."""

import keras


def under_xla():
    """Whether the ops being built will be compiled by XLA.

    True on JAX, and on TensorFlow inside a ``tf.function(jit_compile=True)``
    (Keras' ``jit_compile=True``), nested functions included; False eagerly
    and in plain graphs (which is also what SavedModel and ONNX export trace).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return True
    if backend != "tensorflow":
        return False
    import tensorflow as tf

    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TensorFlow without the (private) helper
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
