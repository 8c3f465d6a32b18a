"""keras_linattn: kernelized linear attention layers for Keras 3 (TensorFlow backend)."""

import os

from setuptools import find_packages, setup

here = os.path.abspath(os.path.dirname(__file__))
about = {}
with open(os.path.join(here, "keras_linattn", "version.py")) as f:
    exec(f.read(), about)

with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="keras-linattn",
    version=about["__version__"],
    description="Kernelized linear attention layers for Keras 3 on TensorFlow: O(N) training, "
    "constant-memory decoding, SavedModel/ONNX export.",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["keras_linattn", "keras_linattn.*"]),
    python_requires=">=3.10",
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15",
        "tensorflow-datasets>=4.9",
        "tf2onnx>=1.17",
        "onnx>=1.16",
        # onnxruntime-gpu runs on CPU-only machines too (CPU provider); never
        # install it next to the plain `onnxruntime` package.
        "onnxruntime-gpu>=1.31",
        "numpy",
        # TFDS imports it for builders that live in a package (examples.listops)
        # but declares it only for Python < 3.9.
        "importlib_resources",
    ],
    extras_require={
        # CUDA 12 libraries for TensorFlow on an NVIDIA GPU.
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
        # Serving: request/warmup protos of TF Serving.
        "serving": ["tensorflow-serving-api>=2.21,<2.22"],
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",
            "hypothesis>=6",
            "tensorflow-serving-api>=2.21,<2.22",
            "ruff>=0.6",
        ],
        # Benchmarks: plots, and tf-keras for TF Model Garden's KernelAttention anchor.
        "bench": ["matplotlib", "tf-keras>=2.21,<2.22", "psutil"],
        # A second Keras backend: the layers and `generate` run on JAX (export stays on TensorFlow).
        "jax": ["jax[cpu]>=0.4.36"],
    },
    entry_points={"console_scripts": ["keras-linattn=keras_linattn.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Framework :: Keras",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
