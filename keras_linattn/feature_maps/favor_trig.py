"""FAVOR trigonometric random features (the Performer paper's non-positive variant)."""

import math

from keras import ops

from keras_linattn.feature_maps.random_features import _KEY_EXPONENT_CAP, RandomFeatureMap
from keras_linattn.feature_maps.registry import register

__all__ = ["FavorTrigFeatureMap"]


@register("favor_trig")
class FavorTrigFeatureMap(RandomFeatureMap):
    """Trigonometric random features: ``[sin(W x'), cos(W x')] * exp(|x'|^2/2) / sqrt(m)``.

    With ``x' = x * D^(-1/4)`` and Gaussian rows ``w_i``, ``phi(q) . phi(k)
    = exp(|q'|^2/2 + |k'|^2/2) * mean_i cos(w_i . (q' - k'))``, an unbiased
    estimate of ``exp(q.k / sqrt(D))`` (random Fourier features of the
    Gaussian kernel times the norm factors).

    This map is NOT positive: single features and whole estimates
    ``phi(q).phi(k)`` can be negative, so attention weights can be negative
    and the denominator ``phi(q).z`` can be near zero or negative, where the
    output is unstable (`keras_linattn.ops.linear_attention` divides by the
    signed denominator and replaces it only where it cancels below
    ``epsilon * |phi(q)|.|z|``, which prevents division by zero but not an
    ill-conditioned answer). Its variance is
    largest exactly where softmax weights are small. This is why FAVOR+
    (`"favor+"`) exists; keep this map for comparisons. ``C = 2m``.

    Norm factors: a query's factor ``exp(|q'|^2/2)`` is one constant per
    query and cancels in the normalization, so it is left out. For keys,
    non-causal: ``exp(|k'|^2/2 - max_j |k_j'|^2/2)`` (one constant per
    (batch, head), cancels); causal: ``exp(min(|k'|^2/2, 50))`` (no max over
    time, which would leak the future). The cap keeps float32 from
    overflowing, and it changes the kernel of every key with
    ``|k'|^2/2 > 50`` (inputs of ~x10 at D=4). Such keys are reported, never
    used silently: `causal_key_out_of_range` names them, and
    `LinearAttention` (causal call and `step`) raises
    `keras_linattn.ops.core.KernelUnderflowError` eagerly, and in a graph
    makes every row from that key on NaN, with a NaN state so that later
    pieces and steps stay flagged (docs/dev/hardening.md, the log-space sweep).

    Args:
        num_features: m, the number of random frequencies (``C = 2m``).
        kind: ``"orthogonal"`` (default) or ``"iid"``.
        scaling: ``"chi"`` (default) or ``"sqrt"`` row norms.
        scale: input multiplier; None means ``D^(-1/4)``.
        seed: None or a non-negative int fixing the initial projection.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: queries drop their norm factor (see above).
        causal: selects the key norm factor (see above).

    Returns:
        ``[B, T, H, 2m]`` float32 features (not all positive).

    Example:

    >>> import numpy as np
    >>> fm = FavorTrigFeatureMap(num_features=32, seed=0)
    >>> phi = np.asarray(fm(np.zeros((1, 4, 2, 16), "float32")))  # [sin(Wx), cos(Wx)] / sqrt(m) at x = 0
    >>> phi.shape, bool(np.allclose(phi[..., :32], 0.0)), bool(np.allclose(phi[..., 32:], 32 ** -0.5))
    ((1, 4, 2, 64), True, True)
    """

    # Signed features: the output ratio is unbounded near phi(q).z = 0 and
    # overflows float16 at unit-scale inputs (inf, then NaN). `LinearAttention`
    # refuses this map under a float16 compute dtype.
    float16_safe = False

    def feature_dim(self, input_dim):
        return 2 * self.num_features

    def call(self, inputs, is_query=True, causal=False):
        x, proj = self._project(inputs)  # [B, T, H, D], [B, T, H, m]
        trig = ops.concatenate([ops.sin(proj), ops.cos(proj)], axis=-1)  # [B, T, H, 2m]
        trig = trig / math.sqrt(self.num_features)
        if is_query:
            return trig
        half_sq_norm = _half_sq_norm(x)  # [B, T, H, 1]
        if causal:
            log_amp = ops.minimum(half_sq_norm, _KEY_EXPONENT_CAP)  # [B, T, H, 1]
        else:
            stab = ops.max(half_sq_norm, axis=1, keepdims=True)  # [B, 1, H, 1]
            log_amp = half_sq_norm - ops.stop_gradient(stab)  # [B, T, H, 1]
        return trig * ops.exp(log_amp)  # [B, T, H, 2m]

    def causal_key_out_of_range(self, inputs):
        """``[B, T, H]`` bool: causal keys whose amplitude ``exp(|k'|^2/2)`` is past the cap ``exp(50)``.

        The causal features of such a key are not its kernel's (the cap
        changes it); the attention layer flags every row that attends to one.
        """
        x, _ = self._project(inputs)  # [B, T, H, D]
        return _half_sq_norm(x)[..., 0] > _KEY_EXPONENT_CAP  # [B, T, H]


def _half_sq_norm(x):
    """``|x'|^2 / 2`` ``[B, T, H, 1]`` of ``x' [B, T, H, D]``: one expression for the features and the range check."""
    return 0.5 * ops.sum(ops.square(x), axis=-1, keepdims=True)
