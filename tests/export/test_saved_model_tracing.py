"""`export_saved_model` traces each signature once: tracing is most of an export's time."""

import keras
import pytest

from keras_linattn import export, layers
from keras_linattn.export import _specs

pytestmark = pytest.mark.tf_only("a SavedModel export")


def test_each_signature_is_traced_once(tmp_path, monkeypatch):
    traces = []
    serving_fn = _specs.ModelSpecs.serving_fn

    def counted_serving_fn(specs):
        fn = serving_fn(specs)

        def serve(*args, **kwargs):
            traces.append(1)  # runs once per trace of the signature
            return fn(*args, **kwargs)

        return serve

    monkeypatch.setattr(_specs.ModelSpecs, "serving_fn", counted_serving_fn)
    inputs = keras.Input((None, 8), name="features")
    attended = layers.LinearAttention(2, 4, chunk_size=4)(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(attended))
    version_dir = export.export_saved_model(model, str(tmp_path / "encoder"), warmup=False)
    # Before: once to list the signature's variables, once more inside `tf.saved_model.save`.
    assert len(traces) == 1
    monkeypatch.undo()
    # The one trace is the one saved: the export gives the model's outputs (verify's error model).
    assert export.verify(model, saved_model_dir=version_dir, shapes=[(2, 5), (1, 9)]).ok
