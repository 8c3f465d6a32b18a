"""Gradients and compiled functions for the oracle tests, on either Keras backend.

The numeric tests run on TensorFlow (`make test`) and again on JAX
(`make test-jax`). What they need from the backend is here:

- `gradients`: a scalar loss and its gradients with respect to input arrays
  and Keras variables. TensorFlow takes them with `tf.GradientTape` (exactly
  the tape the tests used before this module); JAX with `jax.value_and_grad`
  over a pure function of the inputs and the variables' values, read through
  `keras.StatelessScope` (the mechanism under `Layer.stateless_call`, which
  also covers oracles that call several sublayers, e.g. `layer.project` then
  `layer.output_dense`).
- `flat`: the gradients as one flat float vector, as the oracle tests compare
  them (the relative error is taken over the whole gradient).
- `xla`: a function compiled with XLA (`tf.function(jit_compile=True)` or
  `jax.jit`).

`tests/conftest.py` turns on JAX's 64-bit mode, without which JAX silently
computes every float64 oracle in float32.
"""

import keras
import numpy as np

BACKEND = keras.backend.backend()


def gradients(loss_fn, inputs=(), variables=()):
    """``loss_fn(*inputs) -> (loss, aux)``; returns ``(aux, grads)``.

    ``grads`` holds the gradient of the scalar ``loss`` with respect to each of
    ``inputs`` (arrays, passed to ``loss_fn`` as backend tensors) and then each
    of ``variables`` (Keras variables that ``loss_fn`` reads), as NumPy arrays.
    ``aux`` (any structure of tensors) is returned as NumPy.
    """
    variables = list(variables)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        inputs = [tf.constant(x) for x in inputs]
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            loss, aux = loss_fn(*inputs)
        grads = tape.gradient(loss, inputs + variables)
    elif BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        def pure(input_values, variable_values):
            with keras.StatelessScope(state_mapping=list(zip(variables, variable_values, strict=True))):
                return loss_fn(*input_values)

        (_, aux), (input_grads, variable_grads) = jax.value_and_grad(pure, argnums=(0, 1), has_aux=True)(
            [jnp.asarray(x) for x in inputs], [v.value for v in variables]
        )
        grads = list(input_grads) + list(variable_grads)
    else:
        raise NotImplementedError(f"no gradient helper for the {BACKEND!r} backend")
    aux = keras.tree.map_structure(keras.ops.convert_to_numpy, aux)
    return aux, [keras.ops.convert_to_numpy(g) for g in grads]


def flat(grads):
    """The gradients ``grads`` (a list of arrays) as one flat vector."""
    return np.concatenate([np.asarray(g).ravel() for g in grads])


def xla(fn):
    """``fn`` compiled with XLA on the current backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    raise NotImplementedError(f"no XLA compilation for the {BACKEND!r} backend")
