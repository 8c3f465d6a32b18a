"""Whether the graph being built will be compiled by XLA: some ops have a faster form there."""

import keras

from keras_linattn import _compat


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
    return _compat.tf_graph_under_xla(tf.compat.v1.get_default_graph())
