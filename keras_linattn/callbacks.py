"""Keras callbacks for linear-attention models."""

import keras

from keras_linattn.ops.core import _check_positive_int


def random_feature_layers(model):
    """Every layer inside `model` (itself included) that has a `redraw()` method.

    Walks all sublayers recursively (nested models, attention layers and
    their feature maps); each layer is listed once even when shared.
    """
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if callable(getattr(layer, "redraw", None)):
            found.append(layer)
    return found


@keras.saving.register_keras_serializable(package="keras_linattn")
class RedrawRandomFeatures(keras.callbacks.Callback):
    """Redraws the random projections of random-feature maps during `fit`.

    Performer-style maps (`"favor+"`, `"favor_trig"`) estimate softmax
    attention with a fixed random projection; redrawing it every few
    hundred steps keeps the model from fitting one particular draw. This
    callback finds every layer of the model that has a ``redraw()`` method
    and calls it before training batch ``n, 2n, 3n, ...`` (counted over the
    whole `fit` call, across epochs; with ``steps_per_execution > 1`` Keras
    calls batch hooks once per execution, so count executions).

    It acts only in `fit` (`on_train_batch_begin`): `predict` and
    `evaluate` never redraw, so inference is deterministic. The projection
    in use when `fit` returns is the one saved with the model.

    Args:
        every_n_steps: redraw interval in training batches (positive int).

    Example:

    >>> model.fit(x, y, epochs=3, callbacks=[RedrawRandomFeatures(every_n_steps=100)])
    """

    def __init__(self, every_n_steps=1000):
        super().__init__()
        _check_positive_int("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.redraw_count = 0
        self._steps = 0
        self._layers = []

    def on_train_begin(self, logs=None):
        self._steps = 0
        self._layers = random_feature_layers(self.model)

    def on_train_batch_begin(self, batch, logs=None):
        if self._steps > 0 and self._steps % self.every_n_steps == 0:
            for layer in self._layers:
                # Unbuilt maps are templates (e.g. the `feature_map` attribute
                # of LinearCausalLM and of the transformer blocks, which copy
                # it): they hold no projection in use.
                if layer.built:
                    layer.redraw()
            self.redraw_count += 1
        self._steps += 1

    def get_config(self):
        return {"every_n_steps": self.every_n_steps}
