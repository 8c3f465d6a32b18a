"""Hedgehog trainable feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine")."""

import numpy as np
from keras import ops

from keras_linattn.feature_maps.base import FeatureMap, check_bool
from keras_linattn.feature_maps.registry import register
from keras_linattn.ops.core import _check_positive_int


def _headwise_identity(num_heads, input_dim, feature_size):
    """Initializer of a head-wise kernel ``[H, D, F]``: ``eye(D, F)`` for every head."""
    eye = np.eye(input_dim, feature_size, dtype="float32")  # [D, F]
    initial = np.broadcast_to(eye, (num_heads, input_dim, feature_size)).copy()  # [H, D, F]
    return lambda shape, dtype=None: ops.convert_to_tensor(initial, dtype=dtype)


@register("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """Hedgehog: ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]``, W trainable.

    The Hedgehog map is ``[exp(x W), exp(-x W)]`` with a trainable head-wise
    ``W [H, D, F]`` initialized to the identity, trained (typically by
    attention distillation, `keras_linattn.distill`) so that linear attention
    mimics the spiky, monotonic weights of softmax attention. Here each half
    is normalized over its F features — a softmax over the feature axis, as
    the authors' reference implementation does. The normalization is a
    per-token, per-half factor computed from that token alone, so:

    - it never mixes time steps (causal-safe: a key's features depend on
      that key only);
    - every feature lies in ``(0, 1]`` and each half sums to 1: no overflow
      or underflow to an all-zero vector whatever the input size;
    - it is not equivalent to the raw ``exp`` form for keys (a per-key
      factor reweights keys); it is the kernel being trained, and it is the
      same for queries and keys, for causal and non-causal attention.

    ``C = 2F`` (``F = D`` by default).

    Args:
        feature_size: F, the output size of ``W`` per half; None means the
            key dim D (square W). ``W`` starts as ``eye(D, F)`` per head.
        share_qk: True: one kernel for queries and keys; False (default, as in
            the paper): separate query and key kernels.
        use_bias: whether to add a trainable head-wise bias ``b [H, F]``
            (zeros-initialized) before the softmax. Default True.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: picks the query or the key kernel when `share_qk` is False.
        causal: unused (the map is per-token).

    Returns:
        ``[B, T, H, 2F]`` positive float32 features.

    Example:

    >>> fm = HedgehogFeatureMap(feature_size=8)
    >>> fm(np.zeros((1, 4, 2, 16)), is_query=False).shape
    (1, 4, 2, 16)
    """

    def __init__(self, feature_size=None, share_qk=False, use_bias=True, **kwargs):
        super().__init__(**kwargs)
        if feature_size is not None:
            _check_positive_int("feature_size", feature_size)
        check_bool("share_qk", share_qk)
        check_bool("use_bias", use_bias)
        self.feature_size = feature_size
        self.share_qk = share_qk
        self.use_bias = use_bias

    def feature_dim(self, input_dim):
        return 2 * (self.feature_size or input_dim)

    def build(self, input_shape):
        heads_dim = self.build_heads(input_shape)
        if heads_dim is None:
            return
        self._num_heads, self._dim = heads_dim
        size = self.feature_size or self._dim
        names = ("kernel",) if self.share_qk else ("query_kernel", "key_kernel")
        self._kernels, self._biases = {}, {}
        for name in names:
            self._kernels[name] = self.add_weight(
                name=name,
                shape=(self._num_heads, self._dim, size),
                initializer=_headwise_identity(self._num_heads, self._dim, size),
                trainable=True,
            )
            if self.use_bias:
                self._biases[name] = self.add_weight(
                    name=name.replace("kernel", "bias"),
                    shape=(self._num_heads, size),
                    initializer="zeros",
                    trainable=True,
                )

    def call(self, inputs, is_query=True, causal=False):
        self.check_heads(inputs)
        name = "kernel" if self.share_qk else ("query_kernel" if is_query else "key_kernel")
        x = ops.cast(inputs, self.compute_dtype)  # [B, T, H, D]
        kernel = ops.cast(self._kernels[name], self.compute_dtype)  # [H, D, F]
        logits = ops.einsum("bthd,hdf->bthf", x, kernel)  # [B, T, H, F]
        if self.use_bias:
            logits = logits + ops.cast(self._biases[name], self.compute_dtype)  # [B, T, H, F]
        return ops.concatenate(
            [ops.softmax(logits, axis=-1), ops.softmax(-logits, axis=-1)], axis=-1
        )  # [B, T, H, 2F]

    def get_config(self):
        return {
            **super().get_config(),
            "feature_size": self.feature_size,
            "share_qk": self.share_qk,
            "use_bias": self.use_bias,
        }
