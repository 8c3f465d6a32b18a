"""Choosing onnxruntime execution providers without noisy failures.

Asking onnxruntime-gpu for `CUDAExecutionProvider` on a machine without a GPU
or without the CUDA libraries logs an ERROR and falls back to CPU. We check
first: a GPU device must be visible, and the provider's shared library must
load (its CUDA / cuDNN / TensorRT dependencies resolve) before we ask for it.
"""

import ctypes
import functools
import glob
import os
import shutil
import subprocess

from keras_linattn._validation import check_one_of

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
_PROVIDER_LIBS = {CUDA: "cuda", TENSORRT: "tensorrt"}


@functools.lru_cache(maxsize=None)
def gpu_present():
    """True when an NVIDIA GPU device is visible to this process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        result = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


@functools.lru_cache(maxsize=None)
def provider_library_loads(provider):
    """True when onnxruntime's shared library of `provider` and its deps load."""
    import onnxruntime as ort

    lib = _PROVIDER_LIBS.get(provider)
    if lib is None:
        return provider == CPU
    capi = os.path.join(os.path.dirname(ort.__file__), "capi")
    candidates = glob.glob(os.path.join(capi, f"libonnxruntime_providers_{lib}.so")) + glob.glob(
        os.path.join(capi, f"onnxruntime_providers_{lib}.dll")
    )
    if not candidates:
        return False

    def try_load():
        try:
            ctypes.CDLL(candidates[0])
            return True
        except OSError:
            return False

    if try_load():
        return True
    # CUDA libraries installed as pip packages (nvidia-*-cu13) are found
    # only after onnxruntime preloads them.
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        try:
            preload(cuda=True, cudnn=True, msvc=False)
        except Exception:  # noqa: BLE001 - preloading is best effort
            return False
        return try_load()
    return False


def select_providers(device="auto", use_tensorrt=False):
    """Execution providers to request, best first.

    Args:
        device: ``"auto"`` (GPU when usable, else CPU), ``"cpu"`` or
            ``"gpu"`` (error when no usable GPU).
        use_tensorrt: also put TensorRT first when it is usable. TensorRT
            builds an engine per new input shape range; worth it for fixed
            serving shapes, not for varying ones.

    Returns:
        A list of provider names, always ending with the CPU provider.
    """
    import onnxruntime as ort

    check_one_of("device", device, ("auto", "cpu", "gpu"))
    if device == "cpu":
        return [CPU]
    available = set(ort.get_available_providers())
    chosen = []
    if gpu_present():
        candidates = ([TENSORRT] if use_tensorrt else []) + [CUDA]
        chosen = [p for p in candidates if p in available and provider_library_loads(p)]
    if device == "gpu" and not chosen:
        raise ValueError(
            "device='gpu' was requested but no usable GPU provider was found "
            f"(GPU visible: {gpu_present()}, onnxruntime providers: {sorted(available)}; "
            "the CUDA provider needs onnxruntime-gpu and its CUDA/cuDNN libraries). "
            f"Received: device={device!r}"
        )
    return chosen + [CPU]
