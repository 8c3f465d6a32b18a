"""Serving exported ONNX files with numpy and onnxruntime alone: no TensorFlow, no Keras.

>>> from keras_linattn.serving import OnnxGenerator, OnnxPredictor

`OnnxPredictor` runs any graph written by `keras_linattn.export.export_onnx`;
`OnnxGenerator` decodes with a causal LM's step and generate graphs. Both are
the classes of `keras_linattn.export`; importing them from here (or from
`keras_linattn.export`) loads neither TensorFlow nor Keras, so a serving
image needs ``numpy`` and ``onnxruntime`` (or ``onnxruntime-gpu``) and this
package installed without its TensorFlow dependencies
(``pip install --no-deps keras-linattn``).
"""

from keras_linattn.export.onnx_generator import OnnxGenerator
from keras_linattn.export.onnx_predictor import OnnxPredictor

__all__ = ["OnnxGenerator", "OnnxPredictor"]
