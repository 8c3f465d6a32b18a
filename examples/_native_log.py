"""Drop TensorFlow's known start-up noise from the process's stderr, keep everything else.

TensorFlow's C++ runtime writes a few lines to file descriptor 2 before its
log level (``TF_CPP_MIN_LOG_LEVEL``) is read, so the variable cannot silence
them: the absl pre-initialisation banner, the oneDNN notice, and on a machine
without an NVIDIA driver the CUDA stub's notice and a ``failed call to
cuInit`` error. On a CPU-only machine these say nothing the user can act on.

`filter_native_noise` is opt-in, for entry points (``examples/demo.py``),
and must run before TensorFlow is imported (the package's own
`keras_linattn.quiet()` holds the start-up lines back another way). It replaces
fd 2 with a pipe read by a thread that forwards every line except
those matching `noise_pattern()`; the CUDA lines are treated as noise only when no
NVIDIA device node exists (on a GPU machine a CUDA error is real).
"""

import atexit
import os
import re
import sys
import threading

_ALWAYS = (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"^I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom operations are on\.",
    # A notice that oneDNN falls back to Eigen for int32 ops; logged at error level.
    r"^E\d{4} [\d:. ]+\d+ util\.cc:\d+\] oneDNN supports DT_INT32 only on platforms with AVX-512\.",
)
_WITHOUT_GPU = (
    r"^I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    r"^E\d{4} [\d:. ]+\d+ cuda_(platform|executor)\.cc:\d+\] failed call to cuInit",
)

_PIECE = re.compile(rb"(\r|\n)")
_installed = False


def has_nvidia_device():
    """True when the kernel exposes an NVIDIA device node (a driver is loaded)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def noise_pattern(gpu=None):
    """The compiled regex of lines dropped; ``gpu`` defaults to `has_nvidia_device()`."""
    gpu = has_nvidia_device() if gpu is None else gpu
    return re.compile("|".join(_ALWAYS + (() if gpu else _WITHOUT_GPU)))


def filter_native_noise():
    """Route fd 2 through a filter that drops `noise_pattern()` lines. Idempotent.

    Call it before importing TensorFlow. Lines are forwarded as they arrive;
    at exit the pipe is closed and the last lines are flushed.
    """
    global _installed
    if _installed:
        return
    try:
        original = os.dup(2)
    except OSError:  # no stderr to filter
        return
    pattern = noise_pattern()
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def pump():
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            pending = b""
            while True:
                chunk = pipe.read(65536)
                if not chunk:
                    break
                pending += chunk
                # Complete pieces end in "\n" or "\r" (progress bars redraw with "\r").
                *pieces, pending = _PIECE.split(pending)
                kept = b"".join(
                    text + end
                    for text, end in zip(pieces[0::2], pieces[1::2], strict=True)
                    if not pattern.search(text.decode("utf-8", "replace"))
                )
                if kept:
                    os.write(original, kept)
            if pending and not pattern.search(pending.decode("utf-8", "replace")):
                os.write(original, pending)

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()

    def restore():
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr may already be closed at exit
            pass
        os.dup2(original, 2)  # closes the pipe's last write end: the pump sees EOF
        thread.join(timeout=5)

    atexit.register(restore)
    _installed = True
