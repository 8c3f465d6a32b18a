"""verify's onnxruntime sessions read the weights the weight check proved equal from the model's own buffers.

A session loaded from the file holds its own copy of every weight (a 1B
model's 4.6 GiB, on top of the Keras model's). verify's weight check
(`_verify_weights.check_by_name`) has already compared every initializer
named after a weight with that weight, bit for bit; those initializers are
given to the session from the model's buffers
(`onnxruntime.SessionOptions.add_initializer`), without a copy, and only
those: an initializer that differs from its weight, or was not compared, is
loaded from the file, so the outputs checks still run what the file holds.

The sessions also fold no constant larger than `FOLD_LIMIT_BYTES`.
onnxruntime's constant folding turns an expression of a weight (the tied
output projection's transpose of the embedding, the reshapes of the
attention kernels) into a new initializer the session owns: at the Llama
3.2 1B shape 2.9 GiB for the step graph's session and 5.3 GiB for the
generate graph's, against 0.1-0.3 GiB with the limit. The expressions are
then computed when the graph runs, from the same weights (or fused into the
product that reads them: onnxruntime's ``FusedMatMul`` with a transposed
operand), so the checks run the file's graph, a little slower, with
rounding within verify's bounds.
"""

from keras_linattn.export import _providers

# No folded constant over 1 MiB: weight-sized expressions stay in the graph (see the module docstring).
FOLD_LIMIT_BYTES = 1 << 20


class _Dlpack:
    """A DLPack capsule as the object `numpy.from_dlpack` takes."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **kwargs):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def buffer_view(variable):
    """A read-only numpy array on `variable`'s own CPU buffer, or None where that needs a copy.

    TensorFlow reads a CPU variable without copying it, and DLPack hands the
    buffer to numpy as is (``variable.numpy()`` copies). Under JAX the view
    is of the host array ``numpy.asarray`` gives: the JAX array's own buffer
    on the CPU, a host copy of a GPU one. None for dtypes DLPack does not
    carry (bfloat16) and for a TensorFlow variable off the CPU.

    Args:
        variable: a `keras.Variable`.

    Returns:
        A numpy array sharing the variable's memory, or None.
    """
    import numpy as np

    try:
        import tensorflow as tf

        tensor = tf.convert_to_tensor(variable)
        if "CPU" not in tensor.device.upper():
            return None
        array = np.from_dlpack(_Dlpack(tf.experimental.dlpack.to_dlpack(tensor)))
    except Exception:  # noqa: BLE001  (a dtype or backend without DLPack: the session reads the file)
        return None
    if array.shape != tuple(variable.shape) or array.dtype != np.dtype(str(variable.dtype)):
        return None
    return array


def session_options(model, names, device):
    """Session options of verify's sessions, with the weights `names` given from `model`'s buffers.

    As `OnnxPredictor`'s defaults for verify: no spinning, no prepacked copy
    of the weights; no folded constant over `FOLD_LIMIT_BYTES`, and only
    onnxruntime's errors logged (it warns once per constant it leaves
    unfolded).

    Args:
        model: the Keras model.
        names: weight paths whose initializer in every file these options
            load was proven equal to the weight, bit for bit.
        device: verify's ``onnx_device``; weights are shared on the CPU
            provider only.

    Returns:
        ``(options, shared)``: an `onnxruntime.SessionOptions` and the list
        of `onnxruntime.OrtValue` it was given (the session reads their
        memory: keep them, and the model, alive as long as the session).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
        options.add_session_config_entry(key, "0")
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("optimization.constant_folding_max_output_size_in_bytes", str(FOLD_LIMIT_BYTES))
    options.log_severity_level = 3  # errors only
    shared = []
    if not names or _providers.select_providers(device) != [_providers.CPU]:
        return options, shared
    variables = {v.path: v for v in model.weights}
    for name in names:
        array = buffer_view(variables[name]) if name in variables else None
        if array is not None:
            value = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(name, value)
            shared.append(value)
    return options, shared
