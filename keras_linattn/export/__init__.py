"""Export to SavedModel (TF Serving) and ONNX (onnxruntime), and checks.

>>> from keras_linattn import export
>>> version_dir = export.export_saved_model(model, "models/encoder")
>>> paths = export.export_onnx(model, "onnx/encoder.onnx")
>>> export.verify(model, saved_model_dir=version_dir, onnx_path=paths["model"])

tf2onnx, onnx and onnxruntime are imported lazily, inside the functions that
need them.
"""

from keras_linattn.export.onnx_export import check_pair, export_onnx, read_metadata
from keras_linattn.export.onnx_generator import OnnxGenerator
from keras_linattn.export.onnx_predictor import OnnxPredictor
from keras_linattn.export.saved_model import check_integrity, export_saved_model, latest_version_dir, read_description
from keras_linattn.export.saved_model_runner import SavedModelRunner
from keras_linattn.export.verify import VerificationError, VerificationReport, verify
from keras_linattn.export.warmup import read_warmup_requests, write_warmup_requests

__all__ = [
    "OnnxGenerator",
    "OnnxPredictor",
    "SavedModelRunner",
    "VerificationError",
    "VerificationReport",
    "check_integrity",
    "check_pair",
    "export_onnx",
    "export_saved_model",
    "latest_version_dir",
    "read_description",
    "read_metadata",
    "read_warmup_requests",
    "verify",
    "write_warmup_requests",
]
