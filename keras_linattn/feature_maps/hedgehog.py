"""Hedgehog trainable feature map (Zhang et al. 2024, "The Hedgehog & the Porcupine")."""

import warnings

import keras
from keras import ops

from keras_linattn._validation import check_bool, check_optional_positive_int
from keras_linattn.feature_maps import _trainable
from keras_linattn.feature_maps.registry import register

__all__ = ["HedgehogFeatureMap"]


@register("hedgehog")
class HedgehogFeatureMap(_trainable.TrainableFeatureMap):
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

    The feature dim is ``C = 2F``: `feature_dim` (an even number) sets it,
    and ``F = C / 2``; by default ``F = D`` (``C = 2D``). Like the other
    trainable maps (`keras_linattn.feature_maps.FFNFeatureMap` and the GLU
    family) it stands on `TrainableFeatureMap`: float32 weights whatever the
    compute dtype, and ``share_qk=True`` by default.

    Changed defaults and names (older configs load unchanged):

    - ``share_qk`` now defaults to True, like the other trainable maps
      (it was False, as in the paper). Saved configs always hold an explicit
      ``share_qk`` and load with the value they were saved with; pass
      ``share_qk=False`` for the paper's separate kernels.
    - ``feature_size=F`` is deprecated: use ``feature_dim=2F``. It is still
      accepted (with a `DeprecationWarning`), so configs saved with it load
      to the same map; `get_config` writes ``feature_dim``.

    Args:
        feature_dim: the feature dim ``C = 2F``, an even positive integer;
            None (default) means ``C = 2D`` (square W). ``W`` starts as
            ``eye(D, F)`` per head.
        share_qk: True (default): one kernel for queries and keys; False (as
            in the paper): separate query and key kernels.
        use_bias: whether to add a trainable head-wise bias ``b [H, F]``
            (zeros-initialized) before the softmax. Default True.
        seed: accepted for symmetry with the other trainable maps (the
            identity and zeros initializers draw nothing). Default None.
        feature_size: deprecated, ``F``; ``feature_size=F`` is
            ``feature_dim=2F``.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: picks the query or the key kernel when `share_qk` is False.
        causal: unused (the map is per-token).

    Returns:
        ``[B, T, H, C]`` (``C = 2F``) positive float32 features.

    Example:

    >>> import numpy as np
    >>> fm = HedgehogFeatureMap(feature_dim=16)
    >>> phi = np.asarray(fm(np.zeros((1, 4, 2, 16), "float32"), is_query=False))  # [B, T, H, D]
    >>> phi.shape, bool((phi > 0).all())
    ((1, 4, 2, 16), True)
    """

    def __init__(self, *, feature_dim=None, share_qk=True, use_bias=True, seed=None, feature_size=None, **kwargs):
        feature_size = check_optional_positive_int("feature_size", feature_size)
        if feature_size is not None:
            if feature_dim is not None:
                raise ValueError(
                    "Pass `feature_dim` (C = 2F) only; `feature_size` (F) is its deprecated "
                    f"old form. Received: feature_dim={feature_dim!r}, feature_size={feature_size!r}"
                )
            warnings.warn(
                "`HedgehogFeatureMap(feature_size=F)` is deprecated: pass `feature_dim=2F` "
                f"(here feature_dim={2 * feature_size}). Re-saving a model updates its config.",
                DeprecationWarning,
                stacklevel=2,
            )
            feature_dim = 2 * feature_size
        super().__init__(feature_dim=feature_dim, share_qk=share_qk, seed=seed, **kwargs)
        if self._feature_dim is not None and self._feature_dim % 2:
            raise ValueError(
                f"`feature_dim` must be an even positive integer (C = 2F). Received: feature_dim={feature_dim!r}"
            )
        self.use_bias = check_bool("use_bias", use_bias)

    def default_feature_dim(self, input_dim):
        """``C = 2D`` when no `feature_dim` is given (``W`` square)."""
        return 2 * input_dim

    def build_branch(self, prefix, num_heads, input_dim):
        size = self.feature_dim(input_dim) // 2  # F
        weights = {
            "kernel": self.add_headwise_weight(
                f"{prefix}_kernel", (num_heads, input_dim, size), keras.initializers.Identity()
            )  # [H, D, F], eye(D, F) per head
        }
        if self.use_bias:
            weights["bias"] = self.add_weight(
                name=f"{prefix}_bias",
                shape=(num_heads, size),
                initializer="zeros",
                trainable=True,
                dtype="float32",
            )  # [H, F]
        return weights

    def apply_branch(self, inputs, weights):
        t, h, d = inputs.shape[1], inputs.shape[2], inputs.shape[3]
        if t == 1 and h is not None and d is not None and 0 not in (h, d):
            return self._apply_one_token(inputs, weights, h, d)
        logits = _trainable.headwise_matmul(inputs, weights["kernel"])  # [B, T, H, F]
        if self.use_bias:
            logits = logits + weights["bias"]  # [B, T, H, F]
        # [softmax(l), softmax(-l)] as one softmax over [B, T, H, 2, F] (the same values, bit for bit):
        # half the kernels; at one token each kernel's launch, not its arithmetic, is the cost.
        shape = ops.shape(logits)
        both = ops.softmax(ops.stack([logits, -logits], axis=-2), axis=-1)  # [B, T, H, 2, F]
        dims = [d if isinstance(d, int) else None for d in shape]
        # At most one unknown dim (a step's batch) and no empty one (-1 cannot be inferred beside a 0): -1 for it.
        if None not in dims[-1:] and dims[:-1].count(None) <= 1 and 0 not in dims:
            # A constant target shape: one ONNX Reshape where a shape read at run time is seven nodes.
            return ops.reshape(both, tuple(-1 if d is None else d for d in dims[:-1]) + (2 * dims[-1],))
        return ops.reshape(both, (*shape[:-1], 2 * shape[-1]))  # [B, T, H, 2F]

    def _apply_one_token(self, inputs, weights, h, d):
        """`apply_branch` at one token (a decoding step): the same map in fewer ops.

        The sign is folded into the weights: ``x [W, -W] + [b, -b]`` is
        ``[l, -l]`` exactly (negation commutes with rounding), so one product
        gives both halves (each a sum over D, as in the general form, whose
        einsum may order it differently); and ``[B, 1, H, D]`` is read as ``[B, H, 1, D]``
        (the same memory at ``T = 1``), a batched product against ``[H, D, 2F]``
        with no transposes. In an ONNX step: 6 nodes where the general form
        lowers to 11.
        """
        kernel = weights["kernel"]  # [H, D, F]
        size = kernel.shape[-1]
        both = ops.concatenate([kernel, -kernel], axis=-1)  # [H, D, 2F]
        logits = ops.matmul(ops.reshape(inputs, (-1, h, 1, d)), both)  # [B, H, 1, 2F]
        if self.use_bias:
            bias = weights["bias"]  # [H, F]
            logits = logits + ops.reshape(ops.concatenate([bias, -bias], axis=-1), (h, 1, 2 * size))
        halves = ops.softmax(ops.reshape(logits, (-1, h, 2, size)), axis=-1)  # [B, H, 2, F]
        return ops.reshape(halves, (-1, 1, h, 2 * size))  # [B, 1, H, 2F]

    def get_config(self):
        return {**super().get_config(), "use_bias": self.use_bias}
