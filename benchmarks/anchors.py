"""Anchor implementations the benchmark compares `LinearAttention` against.

- `naive_causal_linear_attention` / `NaiveCausalLinearAttention`: the textbook
  causal linear attention that materializes the per-token prefix sums
  ``S_t = sum_{j<=t} phi(k_j) v_j^T`` as a ``[B, T, H, C, M]`` tensor. Same
  projections and feature map as `LinearAttention`, only the attention core
  differs: it is the memory anchor of the chunked causal algorithm.
- `load_kernel_attention`: TF Model Garden's ``KernelAttention`` (tf-keras),
  loaded from the single file ``official/nlp/modeling/layers/kernel_attention.py``
  of the ``tf-models-official`` wheel, fetched once into ``benchmarks/_cache/``.

Shape legend: B batch, T length, H heads, D key dim, C feature dim, M value dim.
"""

import importlib.util
import os
import subprocess
import sys
import types
import zipfile

import keras
from keras import ops

from keras_linattn.layers import LinearAttention

CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cache")
TF_MODELS_REQUIREMENT = "tf-models-official==2.20.*"
KERNEL_ATTENTION_MEMBER = "official/nlp/modeling/layers/kernel_attention.py"

# Same guard as keras_linattn.ops.core: the denominator phi(q).z is floored at
# eps * sum|phi(q)| + tiny, so that the anchor computes the very same function.
_TINY = 1e-30


def naive_causal_linear_attention(q_features, k_features, v, eps=1e-6):
    """Causal linear attention through per-token prefix sums (O(T*C*M) memory).

    Args:
        q_features: ``[B, T, H, C]`` query features.
        k_features: ``[B, T, H, C]`` key features.
        v: ``[B, T, H, M]`` values.
        eps: relative denominator guard, as in `keras_linattn.ops.linear_attention`.

    Returns:
        ``[B, T, H, M]`` float32.
    """
    q = ops.cast(q_features, "float32")
    k = ops.cast(k_features, "float32")
    v = ops.cast(v, "float32")
    kv = ops.einsum("bthc,bthm->bthcm", k, v)  # [B, T, H, C, M]
    s = ops.cumsum(kv, axis=1)  # [B, T, H, C, M]
    z = ops.cumsum(k, axis=1)  # [B, T, H, C]
    num = ops.einsum("bthc,bthcm->bthm", q, s)  # [B, T, H, M]
    den = ops.sum(q * z, axis=-1, keepdims=True)  # [B, T, H, 1]
    guard = eps * ops.sum(ops.abs(q), axis=-1, keepdims=True) + _TINY  # [B, T, H, 1]
    return num / ops.maximum(den, guard)


class NaiveCausalLinearAttention(LinearAttention):
    """`LinearAttention` with its causal core replaced by the per-token cumsum.

    Weights, projections and feature map are those of `LinearAttention` (so
    ``set_weights`` from one to the other gives the same function); only the
    attention core is `naive_causal_linear_attention`. Always causal.
    """

    def call(self, query, value, key=None, training=None):
        q, k, v = self.project(query, value, key)  # [B, T, H, D], [B, T, H, D], [B, T, H, M]
        qf = self.feature_map(q, is_query=True, causal=True, training=training)  # [B, T, H, C]
        kf = self.feature_map(k, is_query=False, causal=True, training=training)  # [B, T, H, C]
        out = naive_causal_linear_attention(qf, kf, v, eps=self.epsilon)  # [B, T, H, M]
        out = ops.cast(out, self.compute_dtype)
        return self.output_dense(out)  # [B, T, width]


class AnchorUnavailable(RuntimeError):
    """An anchor cannot be had on this machine; the message says why."""


def _find_wheel(cache_dir):
    if not os.path.isdir(cache_dir):
        return None
    wheels = sorted(f for f in os.listdir(cache_dir) if f.startswith("tf_models_official-2.20") and f.endswith(".whl"))
    return os.path.join(cache_dir, wheels[-1]) if wheels else None


def fetch_kernel_attention_source(cache_dir=CACHE_DIR, allow_download=True, log=print):
    """Path of Model Garden's ``kernel_attention.py``, extracted into `cache_dir`.

    On first use downloads the ``tf-models-official`` 2.20 wheel with pip
    (``pip download --no-deps``, nothing is installed) and extracts the one
    file. Raises `AnchorUnavailable` with the reason if that is not possible.
    """
    target = os.path.join(cache_dir, "kernel_attention.py")
    if os.path.exists(target):
        return target
    wheel = _find_wheel(cache_dir)
    if wheel is None:
        if not allow_download:
            raise AnchorUnavailable(
                f"{target} is not cached and downloading is disabled "
                f"(run once with downloads allowed to fetch {TF_MODELS_REQUIREMENT})"
            )
        os.makedirs(cache_dir, exist_ok=True)
        log(
            f"[anchors] fetching {TF_MODELS_REQUIREMENT} (wheel only, --no-deps) into {cache_dir} "
            f"to extract {KERNEL_ATTENTION_MEMBER}; this happens once"
        )
        cmd = [sys.executable, "-m", "pip", "download", TF_MODELS_REQUIREMENT, "--no-deps", "-d", cache_dir]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AnchorUnavailable(f"`{' '.join(cmd)}` failed: {e}") from e
        wheel = _find_wheel(cache_dir)
        if proc.returncode != 0 or wheel is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise AnchorUnavailable(f"`pip download {TF_MODELS_REQUIREMENT}` failed: {tail[0]}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            source = zf.read(KERNEL_ATTENTION_MEMBER)
    except (zipfile.BadZipFile, KeyError) as e:
        raise AnchorUnavailable(f"cannot extract {KERNEL_ATTENTION_MEMBER} from {wheel}: {e}") from e
    with open(target, "wb") as f:
        f.write(source)
    return target


def _get_shape_list(tensor, expected_rank=None, name=None):
    """Stand-in for ``official.modeling.tf_utils.get_shape_list`` (static dims, else dynamic)."""
    import tensorflow as tf

    del expected_rank, name
    tensor = tf.convert_to_tensor(tensor)
    static = tensor.shape.as_list()
    dynamic = tf.shape(tensor)
    return [dynamic[i] if d is None else d for i, d in enumerate(static)]


def load_kernel_attention(cache_dir=CACHE_DIR, allow_download=True, log=print):
    """Model Garden's ``KernelAttention`` class (a ``tf_keras`` layer).

    The file imports ``official.modeling.tf_utils`` only for ``get_shape_list``
    (used by its ``expplus`` transform); the import is satisfied by a small
    stand-in module for the duration of the load, so the heavy
    ``tf-models-official`` package itself is never imported or installed.

    Raises:
        AnchorUnavailable: if ``tf_keras`` is not installed or the file cannot
            be fetched.
    """
    try:
        import tf_keras  # noqa: F401
    except ImportError as e:
        raise AnchorUnavailable(f"tf-keras is not installed ({e}); `pip install 'tf-keras>=2.21,<2.22'`") from e
    path = fetch_kernel_attention_source(cache_dir, allow_download=allow_download, log=log)
    stub_names = ("official", "official.modeling", "official.modeling.tf_utils")
    saved = {name: sys.modules.get(name) for name in stub_names}
    official = types.ModuleType("official")
    modeling = types.ModuleType("official.modeling")
    tf_utils = types.ModuleType("official.modeling.tf_utils")
    tf_utils.get_shape_list = _get_shape_list
    official.modeling = modeling
    modeling.tf_utils = tf_utils
    sys.modules.update({"official": official, "official.modeling": modeling, "official.modeling.tf_utils": tf_utils})
    try:
        spec = importlib.util.spec_from_file_location("_benchmarks_model_garden_kernel_attention", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # a broken cache file or an incompatible tf_keras
        raise AnchorUnavailable(f"cannot load {path}: {type(e).__name__}: {e}") from e
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
    return module.KernelAttention


def make_mha(num_heads, key_dim):
    """Keras' softmax `MultiHeadAttention` with the same head layout."""
    return keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim)
