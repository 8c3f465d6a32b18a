"""How `LinearCausalLM.generate` compiles its prefill and decoding loop: XLA or a plain `tf.function`."""

import keras
import numpy as np

__all__ = ["XLA_CPU_WEIGHT_BYTES", "FunctionCache", "compile_function", "generate_uses_xla"]

# `generate_jit_compile="auto"` on a CPU: XLA below this many bytes of weights (see `generate_uses_xla`).
XLA_CPU_WEIGHT_BYTES = 64 * 2**20


class FunctionCache:
    """Holds compiled functions out of Keras' attribute tracking."""

    def __init__(self):
        self.functions = {}


def generate_uses_xla(model):
    """Whether `generate` XLA-compiles its prefill and decoding loop (TensorFlow).

    ``model.generate_jit_compile``: True or False, or ``"auto"`` (default):
    XLA on a GPU; on a CPU, XLA only while the weights are small
    (`XLA_CPU_WEIGHT_BYTES`). Measured on a 2-core CPU
    (benchmarks/bench_linearized_decode.py, docs/linearize.md): XLA's fused
    loop wins where per-op overhead dominates (width 64: docs/decoding.md),
    and loses where matrix-vector products over large weights do
    (XLA's CPU dot is slower than TensorFlow's oneDNN kernels).

    Args:
        model: a `LinearCausalLM`.

    Returns:
        True or False.

    Raises:
        ValueError: for a `generate_jit_compile` other than True, False or
            ``"auto"``.
    """
    choice = getattr(model, "generate_jit_compile", "auto")
    if isinstance(choice, bool):
        return choice
    if choice != "auto":
        raise ValueError(
            f"`generate_jit_compile` must be True, False or 'auto'. Received: generate_jit_compile={choice!r}"
        )
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return True
    weight_bytes = sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in model.weights)
    return weight_bytes <= XLA_CPU_WEIGHT_BYTES


def compile_function(model, fn):
    """`fn` as a `tf.function` on TensorFlow, XLA-compiled or not (`generate_uses_xla`); as it is elsewhere."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=generate_uses_xla(model), reduce_retracing=True, autograph=False)
    return fn
