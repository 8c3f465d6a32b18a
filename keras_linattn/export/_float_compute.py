"""Exports of bfloat16 and float16 models: the weights stay in their dtype, the graphs compute in float32.

tf2onnx converts a graph that computes in bfloat16 into one that onnxruntime
cannot load: its rewriters bind float16 constants and bfloat16 tensors in one
`Gemm` / `MatMul`. And onnxruntime's CPU provider has no bfloat16 matrix
product; its float16 one was no faster than float32 on x86 (docs/export.md).
So while the graphs are traced, every layer whose policy computes in a
16-bit float computes in float32 instead: each weight is read as its own
16-bit value (a graph input, then an initializer of that dtype: the files
carry 2 bytes a weight) and cast to float32, exactly. onnxruntime folds
those casts once, at session start. The SavedModel's signatures are
traced the same way (one rule for both exports; on CPU, TensorFlow's
bfloat16 product is no faster than its float32 one), and `verify` computes
its reference so too: an export is checked against the float32 computation
on the model's own 16-bit weights, under the float32 error model, and its
weights against the model's, exactly.
"""

import contextlib
import functools

from keras_linattn import _compat

__all__ = []

_HALF = ("bfloat16", "float16")


@functools.cache
def _policy_class():
    """`keras.DTypePolicy` keeping its variable dtype and computing in float32 (keras imported on first use)."""
    import keras

    class _Float32Compute(keras.DTypePolicy):
        def __init__(self, variable_dtype):
            super().__init__("float32")
            # Keras parses the variable dtype from a policy's name; no name says "float32 compute, 16-bit weights".
            self._variable_dtype = variable_dtype

    return _Float32Compute


def _half_layers(model):
    """The layers of `model` (itself included) whose plain policy computes in bfloat16 or float16."""
    import keras

    out = []
    for layer in _compat.flatten_layers(model, include_self=True):
        policy = layer.dtype_policy
        if type(policy) is keras.DTypePolicy and policy.compute_dtype in _HALF:
            out.append(layer)
    return out


@contextlib.contextmanager
def float32_compute(model):
    """Within the block, the layers of `model` that compute in bfloat16 or float16 compute in float32.

    Their weights keep their dtype (Keras casts each read to float32: the
    layers' variable and compute dtypes differ). Quantized layers and
    layers under a policy map keep their policies. The policies are put
    back on exit, also when the block raises.

    Args:
        model: a built `keras.Model`.

    Yields:
        The number of layers switched (0 for a float32 model).
    """
    layers = _half_layers(model)
    saved = [layer._dtype_policy for layer in layers]
    try:
        for layer in layers:
            layer._dtype_policy = _policy_class()(layer.dtype_policy.variable_dtype)
        yield len(layers)
    finally:
        for layer, policy in zip(layers, saved, strict=True):
            layer._dtype_policy = policy
