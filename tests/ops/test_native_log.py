"""examples/_native_log.py: TensorFlow's start-up noise is dropped from stderr, nothing else is."""

import subprocess
import sys
import textwrap

from examples._native_log import noise_pattern

BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = "I0000 00:00:1795449502.377214    4812 port.cc:153] oneDNN custom operations are on. You may see"
STUB = "I0000 00:00:1795449502.377547    4812 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU"
CUINIT = "E0000 00:00:1795449506.852643    4812 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error"
INT32 = "E0000 00:00:1795449799.750711    4812 util.cc:131] oneDNN supports DT_INT32 only on platforms with AVX-512."
REAL = "E0000 00:00:1795449506.852643    4812 some_op.cc:12] a real error the user must see"


def test_noise_pattern_keeps_cuda_errors_on_a_gpu_machine():
    cpu, gpu = noise_pattern(gpu=False), noise_pattern(gpu=True)
    for line in (BANNER, ONEDNN, STUB, CUINIT, INT32):
        assert cpu.search(line), line
    for line in (BANNER, ONEDNN, INT32):
        assert gpu.search(line), line
    for line in (STUB, CUINIT):
        assert not gpu.search(line), line
    for pattern in (cpu, gpu):
        assert not pattern.search(REAL)
        assert not pattern.search("UserWarning: something the user should read")


def test_filter_drops_noise_and_forwards_the_rest_in_order():
    code = textwrap.dedent(
        f"""
        import os, sys
        import examples._native_log as native_log
        native_log.has_nvidia_device = lambda: False
        native_log.filter_native_noise()
        native_log.filter_native_noise()  # idempotent
        for line in {[BANNER, "first", ONEDNN, STUB, CUINIT, INT32, REAL]!r}:
            os.write(2, (line + "\\n").encode())
        os.write(2, b"bar 1\\rbar 2\\r")
        print("python stderr", file=sys.stderr)
        os.write(2, b"last line without newline")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert stderr == f"first\n{REAL}\nbar 1\rbar 2\rpython stderr\nlast line without newline"
