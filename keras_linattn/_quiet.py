"""`quiet()`: TensorFlow's start-up lines and known-harmless warnings kept out of stderr.

Importing keras_linattn sets nothing global; entry points (the CLI, the
examples) and the README's snippets call `quiet()` first. What it keeps out,
and why each is harmless here:

- TensorFlow's native log lines (``TF_CPP_MIN_LOG_LEVEL=3``, read once when
  its library loads): ``failed call to cuInit`` on a machine without a GPU,
  ``Ignoring Assert operator`` for each traced generate loop (the asserts of
  keras-hub's checks, never run in a graph);
- what TensorFlow prints while it loads, before its logging is set up
  (oneDNN and CUDA notices, twice: no variable turns these off): `quiet`
  imports TensorFlow with those lines held back, and shows them only if
  the import fails;
- the Python loggers ``tensorflow`` and ``tf2onnx`` below ERROR: ``Issue
  encountered when serializing table_initializer`` (keras-hub tokenizers'
  lookup tables, which the exported graphs do not use) and ``tf.function
  retracing`` (each new prompt shape is a new trace by design);
- absl's Python logging below ERROR.

Errors stay. The module itself imports only the standard library.
"""

import contextlib
import importlib.util
import logging
import os
import sys
import tempfile

__all__ = ["quiet"]

_LOGGERS = ("tensorflow", "tf2onnx", "absl")


def quiet():
    """Keeps TensorFlow's log lines and known-harmless warnings out of stderr; errors still show.

    Call it first, before Keras or TensorFlow is imported: TensorFlow reads
    ``TF_CPP_MIN_LOG_LEVEL`` once, when its native library loads, and prints
    its start-up lines while it loads, so `quiet` imports it (when it is
    installed and not imported yet) with those lines held back. A
    ``TF_CPP_MIN_LOG_LEVEL`` the user set already is kept (2 shows
    TensorFlow's native errors, which 3 hides with the rest). Safe to call
    more than once.

    Returns:
        None.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tensorflow" not in sys.modules and importlib.util.find_spec("tensorflow") is not None:
        with _stderr_held_back():
            import tensorflow  # noqa: F401 - loaded here so that its start-up lines are held back
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None:  # once imported, absl sets its own handler's level: lower it too
        absl_logging.set_verbosity(absl_logging.ERROR)


@contextlib.contextmanager
def _stderr_held_back():
    """File descriptor 2 goes to a temporary file for the block; its text is replayed only on an exception."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (embedded interpreters): nothing to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode("utf-8", "replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
