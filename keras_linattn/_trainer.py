"""One trainer for attention distillation and attention transfer: a `keras.Model` with a `train_step`.

`ObjectiveTrainer` minimizes a scalar objective over a chosen set of
variables (feature maps, window gammas) of models it holds, through
``fit``: callbacks, the progress bar, ``validation_data`` and
`keras.callbacks.BackupAndRestore` work as for any Keras model.

- The models are tracked attributes of the trainer, so ``save_weights`` /
  ``load_weights`` (and therefore ``BackupAndRestore``) cover their weights
  and the optimizer's state.
- ``trainable_weights`` and ``trainable_variables`` are exactly the chosen variables: the optimizer is
  built on them and nothing else is updated. No ``trainable`` flag of the
  models is touched.
- Each entry of the objective's logs is averaged over the epoch by a
  `keras.metrics.Mean` (``metrics`` lists them, so ``fit`` resets them each
  epoch); ``History`` records those means.

- A step whose loss or gradients are not finite (NaN, inf) applies no
  update (``ops.cond`` inside the step, XLA included): the weights stay as
  they were before it, and ``fit`` stops with `NonFiniteLossError` naming
  the step. A run whose last epoch's mean loss is above its first step's
  loss warns (`DivergenceWarning`), naming the learning rate.

The step differentiates with `tf.GradientTape`: TensorFlow backend.
"""

import types
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_linattn._validation import check_positive_int

__all__ = ["DivergenceWarning", "NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """A training step of `attention_transfer` / `distill_attention` gave a NaN or infinite loss or gradient.

    That step's update was not applied: the weights are those after the
    last finite step.
    """


class DivergenceWarning(RuntimeWarning):
    """`attention_transfer` / `distill_attention` ended with a loss above its first step's."""


def as_dataset(data, batch_size):
    """`data` as a batched `tf.data.Dataset`: a dataset as is, arrays (or a tuple/dict of them) batched."""
    if isinstance(data, tf.data.Dataset):
        return data
    if isinstance(data, keras.utils.PyDataset):
        raise ValueError(
            f"Pass a tf.data.Dataset or arrays; a PyDataset is not supported. Received: data={type(data).__name__}"
        )
    batch_size = check_positive_int("batch_size", batch_size)
    return tf.data.Dataset.from_tensor_slices(data).batch(batch_size)


class ObjectiveTrainer(keras.Model):
    """Minimizes ``objective(x)["loss"]`` over `variables` with ``fit``.

    Args:
        objective: ``objective(x) -> dict`` of float32 scalars with a
            ``"loss"`` entry, computed from an input batch ``x`` (labels
            and sample weights of the data are ignored). Runs under the
            gradient tape.
        variables: the variables to train (distinct).
        models: ``{attribute name: model}``, the models the objective uses
            (tracked: their weights are saved with the trainer's).
        log_names: the names of the objective's logs, in display order
            (``"loss"`` first).
        **kwargs: `keras.Model` arguments (e.g. ``name``).
    """

    def __init__(self, objective, variables, models, log_names, **kwargs):
        super().__init__(**kwargs)
        for attribute, model in models.items():
            setattr(self, attribute, model)
        # Held in a plain namespace, which Keras does not track: the variables
        # are the models' (saved once, under the models), the trackers are
        # per-run state.
        self._run = types.SimpleNamespace(
            objective=objective,
            variables=list(variables),
            models=list(models.values()),
            trackers={name: keras.metrics.Mean(name=f"objective_log_{i}") for i, name in enumerate(log_names)},
            # Steps whose update was skipped for a non-finite loss or gradient (read after each batch).
            skipped=keras.Variable(0, dtype="int32", trainable=False, name="skipped_steps"),
        )
        self.built = True

    def compile(self, optimizer, **kwargs):
        super().compile(optimizer=optimizer, **kwargs)
        # Built here, outside the step: its slots must exist before the
        # update is placed inside a conditional.
        self.optimizer.build(self._run.variables)

    def fit(self, *args, callbacks=None, **kwargs):
        """`keras.Model.fit`, with the checks of `_Guard` (non-finite steps raise, divergence warns)."""
        self._run.skipped.assign(0)
        guard = _Guard(self)
        history = super().fit(*args, callbacks=[guard, *(callbacks or [])], **kwargs)
        guard.check_divergence()
        return history

    @property
    def trainable_weights(self):
        return list(self._run.variables)

    @property
    def trainable_variables(self):
        return list(self._run.variables)

    @property
    def metrics(self):
        return list(self._run.trackers.values())

    def call(self, inputs, training=False):
        # Only reached when Keras builds unbuilt state symbolically: run the models.
        return [model(inputs, training=False) for model in self._run.models]

    def _record(self, logs):
        for name, tracker in self._run.trackers.items():
            tracker.update_state(logs[name])
        return {name: tracker.result() for name, tracker in self._run.trackers.items()}

    def train_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        variables = self._run.variables
        with tf.GradientTape() as tape:
            logs = self._run.objective(x)
        gradients = tape.gradient(logs["loss"], variables)
        finite = ops.all(ops.isfinite(logs["loss"]))
        for gradient in gradients:
            if gradient is not None:
                finite = ops.logical_and(finite, ops.all(ops.isfinite(gradient)))

        def apply():
            self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
            return ops.convert_to_tensor(0, "int32")

        def skip():
            self._run.skipped.assign_add(1)
            return ops.convert_to_tensor(1, "int32")

        ops.cond(finite, apply, skip)
        return self._record(logs)

    def test_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._record(self._run.objective(x))


class _Guard(keras.callbacks.Callback):
    """Stops ``fit`` at a skipped (non-finite) step; records the losses for `check_divergence`."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer = trainer
        self.step = 0
        self.first_loss = None
        self.last_mean = None

    def _learning_rate(self):
        try:
            return f"{float(ops.convert_to_numpy(self.trainer.optimizer.learning_rate)):g}"
        except (TypeError, ValueError):
            return repr(self.trainer.optimizer.learning_rate)

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if int(ops.convert_to_numpy(self.trainer._run.skipped)):
            self.trainer.stop_training = True
            raise NonFiniteLossError(
                f"{self.trainer.name}: step {self.step} gave a non-finite loss or gradient (NaN or inf); its update "
                "was not applied and training stopped (the weights are those after the last finite step). Check "
                "the data for NaN/inf values (np.isfinite), or lower the learning rate. Received: "
                f"learning_rate={self._learning_rate()}, loss={None if logs is None else logs.get('loss')}"
            )
        if logs and "loss" in logs:
            if self.first_loss is None:
                self.first_loss = float(np.asarray(logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        if logs and "loss" in logs:
            self.last_mean = float(np.asarray(logs["loss"]))

    def check_divergence(self):
        if self.first_loss is None or self.last_mean is None or self.step < 2:
            return
        if self.last_mean > self.first_loss:
            warnings.warn(
                f"{self.trainer.name}: the loss rose during training (first step {self.first_loss:.6g}, last "
                f"epoch's mean {self.last_mean:.6g}): the run diverged. Lower the learning rate. Received: "
                f"learning_rate={self._learning_rate()}",
                DivergenceWarning,
                stacklevel=3,
            )
