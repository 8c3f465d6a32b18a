"""`quiet()`: TensorFlow's start-up lines and known-harmless warnings kept out of stderr.

Importing keras_linattn sets nothing global; entry points (the CLI, the
examples) and the README's snippets call `quiet()` first. What it keeps out,
and why each is harmless here:

- TensorFlow's native log lines (``TF_CPP_MIN_LOG_LEVEL=3``, read once when
  its library loads): oneDNN and CUDA notices, ``failed call to cuInit`` on
  a machine without a GPU, ``Ignoring Assert operator`` for each traced
  generate loop (the asserts of keras-hub's checks, never run in a graph);
- the Python loggers ``tensorflow`` and ``tf2onnx`` below ERROR: ``Issue
  encountered when serializing table_initializer`` (keras-hub tokenizers'
  lookup tables, which the exported graphs do not use) and ``tf.function
  retracing`` (each new prompt shape is a new trace by design);
- absl's Python logging below ERROR.

Errors stay. The standard library only: it imports neither TensorFlow nor Keras.
"""

import logging
import os
import sys

__all__ = ["quiet"]

_LOGGERS = ("tensorflow", "tf2onnx", "absl")


def quiet():
    """Keeps TensorFlow's log lines and known-harmless warnings out of stderr; errors still show.

    Call it first, before Keras or TensorFlow is imported: TensorFlow reads
    ``TF_CPP_MIN_LOG_LEVEL`` once, when its native library loads. A value
    the user set already is kept. Safe to call more than once.

    Returns:
        None.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None:  # once imported, absl sets its own handler's level: lower it too
        absl_logging.set_verbosity(absl_logging.ERROR)
