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

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those (``export.verify`` is the function of the
``verify`` module of the same name). Each name loads its submodule on first
use: `OnnxGenerator` and `OnnxPredictor` need numpy and onnxruntime only
(no TensorFlow), and tf2onnx, onnx and onnxruntime are imported only inside
the functions that need them.
"""

import sys
import types

from keras_linattn import _lazy

# name -> the submodule that declares it (in its `__all__`; tests/contracts/test_public_api.py checks both ways).
_NAMES = {
    "check_pair": "onnx_export",
    "export_onnx": "onnx_export",
    "OnnxGenerator": "onnx_generator",
    "OnnxPredictor": "onnx_predictor",
    "check_integrity": "saved_model",
    "export_saved_model": "saved_model",
    "latest_version_dir": "saved_model",
    "read_description": "saved_model",
    "SavedModelRunner": "saved_model_runner",
    "VerificationError": "verify",
    "VerificationReport": "verify",
    "differences": "verify",
    "verify": "verify",
    "read_warmup_requests": "warmup",
    "write_warmup_requests": "warmup",
}
_SUBMODULES = ("onnx_export", "onnx_generator", "onnx_predictor", "saved_model", "saved_model_runner", "warmup")

__all__ = sorted(_NAMES)


__getattr__, __dir__ = _lazy.package_attributes(__name__, _NAMES, _SUBMODULES)


class _Package(types.ModuleType):
    """`export.verify` stays the function when its module is imported (which sets the attribute to the module)."""

    def __setattr__(self, name, value):
        if name == "verify" and isinstance(value, types.ModuleType):
            value = value.verify
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
