"""Export to SavedModel (TF Serving) and ONNX (onnxruntime), and checks.

>>> import os, tempfile
>>> import keras
>>> from keras_linattn import export, layers
>>> keras.utils.set_random_seed(0)
>>> inputs = keras.Input((None, 16), name="features")
>>> attended = layers.LinearAttention(2, 8)(inputs, inputs)
>>> model = keras.Model(inputs, keras.layers.Dense(5, name="head")(attended))
>>> out = tempfile.mkdtemp()
>>> version_dir = export.export_saved_model(model, os.path.join(out, "encoder"))
>>> os.path.basename(version_dir)  # the first version of this model
'1'
>>> paths = export.export_onnx(model, os.path.join(out, "encoder.onnx"))
>>> export.verify(model, saved_model_dir=version_dir, onnx_path=paths["model"]).ok
True

tf2onnx, onnx and onnxruntime are imported lazily, inside the functions that
need them. Each submodule declares its public names in its ``__all__``; this
package re-exports exactly those (``export.verify`` is the function of the
``verify`` module of the same name).
"""

from keras_linattn.export import onnx_export, onnx_generator, onnx_predictor, saved_model, saved_model_runner, warmup
from keras_linattn.export import verify as _verify_module
from keras_linattn.export.onnx_export import check_pair, export_onnx
from keras_linattn.export.onnx_generator import OnnxGenerator
from keras_linattn.export.onnx_predictor import OnnxPredictor
from keras_linattn.export.saved_model import check_integrity, export_saved_model, latest_version_dir, read_description
from keras_linattn.export.saved_model_runner import SavedModelRunner
from keras_linattn.export.verify import VerificationError, VerificationReport, differences, verify
from keras_linattn.export.warmup import read_warmup_requests, write_warmup_requests

__all__ = [
    *onnx_export.__all__,
    *onnx_generator.__all__,
    *onnx_predictor.__all__,
    *saved_model.__all__,
    *saved_model_runner.__all__,
    *_verify_module.__all__,
    *warmup.__all__,
]
