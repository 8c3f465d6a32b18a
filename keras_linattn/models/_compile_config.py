"""What `LinearCausalLM.compile` leaves on the model across a `.keras` save, and the dtypes of a distributed build.

The compile config adds the sampler (`_sampler_bridge`) and whether the
optimizer had run; `restore_compile` reads both back. `integer_inputs`
serves `LinearCausalLM._symbolic_build` under a `tf.distribute` strategy.
"""

import keras
from keras import ops

from keras_linattn.models._sampler_bridge import get_sampler, serialize_sampler

__all__ = ["compile_config", "integer_inputs", "restore_compile"]


def compile_config(model, config):
    """`model`'s compile config (`config`, Keras' own) with the sampler and the optimizer's built flag.

    Called when the model is saved, before the weights are written. An
    optimizer that never ran is saved as it is (no slots: building Adam's
    would write two more copies of every weight, 8 GB at 1B parameters) and
    `restore_compile` leaves it unbuilt, so the reload finds the same
    variables and warns of no mismatch.

    Args:
        model: a compiled `LinearCausalLM`.
        config: ``keras.Model.get_compile_config``'s dict, or None.

    Returns:
        The config, or None for an uncompiled model.
    """
    optimizer = getattr(model, "optimizer", None)
    if config is not None and optimizer is not None and not optimizer.built:
        config = dict(config, optimizer_built=False)
    if config is not None and getattr(model, "sampler", None) is not None:
        config = dict(config, sampler=serialize_sampler(model.sampler))
    return config


def restore_compile(model, config):
    """`model.compile(...)` from a `compile_config` dict: optimizer, loss, metrics and sampler."""
    config = dict(config)
    sampler = config.pop("sampler", None)
    optimizer_built = config.pop("optimizer_built", True)
    config = keras.saving.deserialize_keras_object(config)
    model.compile(**config, sampler=get_sampler(sampler) if sampler is not None else "greedy")
    if optimizer_built and getattr(model, "optimizer", None) is not None:
        model.optimizer.build(model.trainable_variables)


def integer_inputs(data_batch, model_inputs):
    """`data_batch` (``x``, ``(x, y)`` or ``(x, y, sample_weight)``) with ``x`` cast to the model's input dtypes.

    Under a `tf.distribute` strategy, Keras' TensorFlow trainer builds the
    compiled loss and metrics before the first `fit` / `evaluate` step from
    the first distributed batch *mean-reduced over the replicas*
    (`_maybe_symbolic_build` in keras/src/backend/tensorflow/trainer.py):
    integer token ids arrive as float32 means (3 and 4 on two replicas give
    3.5). That batch only supplies shapes and dtypes for a symbolic pass; no
    value of it is ever trained or evaluated on. So `LinearCausalLM`
    restores the ids' integer dtype here, for that pass and under a strategy
    only. The strict dtype check of `LinearBackbone` stays as it is: the
    real step receives the per-replica ids as the user gave them, and float
    ids from a user are still refused there (accepting integral-valued
    floats instead would not cover this case: a mean of ids is not
    integral, and it would let users' float arrays through everywhere).

    Only floating entries of ``x`` whose model input is an integer are cast
    (token ids, padding mask); ``y`` and sample weights are left alone.

    Args:
        data_batch: the batch Keras passes to ``_symbolic_build``.
        model_inputs: the model's ``input`` (a tensor or a dict of them).

    Returns:
        The batch, of the same structure.
    """

    def restore(value, spec):
        if value is None or spec is None or "int" not in str(spec.dtype):
            return value
        if "float" not in str(getattr(value, "dtype", "")):
            return value
        return ops.cast(value, spec.dtype)

    def restore_x(x):
        if isinstance(x, dict) and isinstance(model_inputs, dict):
            return {key: restore(value, model_inputs.get(key)) for key, value in x.items()}
        if isinstance(x, (dict, list, tuple)):
            return x
        spec = model_inputs.get("token_ids") if isinstance(model_inputs, dict) else model_inputs
        return restore(x, spec)

    if isinstance(data_batch, tuple):
        return (restore_x(data_batch[0]), *data_batch[1:]) if data_batch else data_batch
    if isinstance(data_batch, list):
        return [restore_x(data_batch[0]), *data_batch[1:]] if data_batch else data_batch
    return restore_x(data_batch)
