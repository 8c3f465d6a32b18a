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

The step differentiates with `tf.GradientTape`: TensorFlow backend.
"""

import types

import keras
import tensorflow as tf

from keras_linattn._validation import check_positive_int

__all__ = []


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
        )
        self.built = True

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
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return self._record(logs)

    def test_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._record(self._run.objective(x))
