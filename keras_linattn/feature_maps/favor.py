"""FAVOR+ positive random features (Choromanski et al. 2021, "Rethinking Attention with Performers")."""

import math

from keras import ops

from keras_linattn.feature_maps.random_features import _KEY_EXPONENT_CAP, RandomFeatureMap
from keras_linattn.feature_maps.registry import register

# Stands for "no key" in the max over real keys.
_NO_KEY = -3.0e38

__all__ = ["FavorPlusFeatureMap"]


@register("favor+")
class FavorPlusFeatureMap(RandomFeatureMap):
    """FAVOR+: positive orthogonal random features for the softmax kernel.

    ``phi(x)_i = exp(w_i . x' - |x'|^2 / 2 - stab) / sqrt(m)`` with
    ``x' = x * D^(-1/4)`` and ``w_i`` the rows of a random Gaussian projection
    ``W [H, m, D]`` (one independent draw per head). Since
    ``E[exp(w.q') exp(w.k')] = exp(|q'|^2/2 + |k'|^2/2 + q'.k')``,
    ``phi(q) . phi(k)`` is an unbiased estimate of ``exp(q.k / sqrt(D))``
    (up to the constant ``stab`` factors, which the attention normalization
    removes): linear attention with these features approximates softmax
    attention, with an error that falls as ``1 / sqrt(m)``. All features are
    positive, so attention weights and denominators are positive.

    Stabilizers (``stab``), chosen so that they cancel exactly in
    ``phi(q)^T S / phi(q)^T z``:

    - queries: the per-token max of the exponent over the m features (a
      per-query factor, cancels between numerator and denominator);
    - keys, non-causal: the max over all real keys and features of each
      (batch, head) — one constant for every key of a row, cancels. Padded
      keys are left out of the max when the layer passes their ``key_mask``;
      their features are masked after the map. `LinearAttention` itself
      maps queries and keys together (`noncausal_pair`): a shift per feature
      over the keys, folded back into the queries, so that no row
      underflows;
    - keys, causal: none. A max over time cancels in exact arithmetic, but
      its value depends on later tokens, and so do the rounding and the
      underflow of earlier keys' features: earlier outputs would change when
      later tokens change (the future leaks). A per-token shift of a key does
      not cancel at all (it reweights that key against the others). The
      exponent is bounded by construction, ``w.x' - |x'|^2/2 <= |w|^2/2``,
      and is additionally capped at 50 so that float32 cannot overflow.

    The projection is a non-trainable weight created in `build` from `seed`:
    it is saved with the model, exported as a constant and never changes at
    inference. `redraw()` draws a new one; during training, the
    `keras_linattn.callbacks.RedrawRandomFeatures` callback does it every n
    steps. Features are computed in float32 (the map's dtype) under any
    mixed-precision policy. ``C = m``.

    Args:
        num_features: m, the number of random features per head; the feature
            dim is ``C = m``. Default 256.
        kind: ``"orthogonal"`` (default; blocks of D orthogonal rows from the
            QR of Gaussian matrices, lower variance) or ``"iid"``.
        scaling: ``"chi"`` (default; chi(D) row norms, unbiased) or ``"sqrt"``
            (every row norm ``sqrt(D)``).
        scale: input multiplier; None means ``D^(-1/4)`` (softmax kernel with
            the usual ``1/sqrt(D)`` temperature).
        seed: None or a non-negative int fixing the initial projection.
        **kwargs: standard `keras.layers.Layer` arguments.

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: selects the stabilizer (see above).
        causal: selects the key stabilizer (see above).
        key_mask: optional ``[B, T]``, 1 for real keys: padded keys are left out
            of the non-causal key stabilizer.

    Returns:
        ``[B, T, H, m]`` positive float32 features.

    Example:

    >>> import numpy as np
    >>> fm = FavorPlusFeatureMap(num_features=64, seed=0)
    >>> x = np.random.default_rng(0).normal(size=(1, 4, 2, 16)).astype("float32")  # [B, T, H, D]
    >>> phi = np.asarray(fm(x, is_query=False, causal=True))
    >>> phi.shape, bool((phi > 0).all())  # m positive random features per head
    ((1, 4, 2, 64), True)
    """

    def feature_dim(self, input_dim):
        return self.num_features

    def call(self, inputs, is_query=True, causal=False, key_mask=None):
        x, proj = self._project(inputs)  # [B, T, H, D], [B, T, H, m]
        half_sq_norm = 0.5 * ops.sum(ops.square(x), axis=-1, keepdims=True)  # [B, T, H, 1]
        exponent = proj - half_sq_norm  # [B, T, H, m]
        if is_query:
            stab = ops.max(exponent, axis=-1, keepdims=True, initial=float("-inf"))  # [B, T, H, 1]
            exponent = exponent - ops.stop_gradient(stab)
        elif not causal:
            if key_mask is None:
                stab = ops.max(exponent, axis=(1, 3), keepdims=True)  # [B, 1, H, 1]
            else:
                # The max over REAL keys: a padded (zeroed) key has exponent 0, which at
                # large scales exceeds every real key's and would underflow them all.
                real = ops.cast(key_mask, "bool")[:, :, None, None]  # [B, S, 1, 1]
                stab = ops.max(ops.where(real, exponent, ops.full_like(exponent, _NO_KEY)), axis=(1, 3), keepdims=True)
                stab = ops.where(stab > _NO_KEY, stab, ops.zeros_like(stab))  # [B, 1, H, 1]; 0 with no real key
                exponent = ops.where(real, exponent, ops.broadcast_to(stab, ops.shape(exponent)))  # padded: exp(0)
            exponent = exponent - ops.stop_gradient(stab)
        else:
            exponent = ops.minimum(exponent, _KEY_EXPONENT_CAP)  # [B, T, H, m]
        return ops.exp(exponent) / math.sqrt(self.num_features)  # [B, T, H, m]

    def noncausal_pair(self, queries, keys, key_mask=None):
        """``(phi(q), phi(k))`` for non-causal attention, with a shift per feature that cancels exactly.

        The shift of `call` (one constant per (batch, head) for the keys)
        lets a query whose kernel is far below the head's largest key lose
        every key to underflow, or keep only terms at the edge of float32's
        range (wrong by a few %). Here each feature ``i`` of the keys is
        shifted by its own max over the real keys, ``m_i``, and the query's
        feature ``i`` is multiplied back by ``exp(m_i)`` before the query's
        own max is taken out: ``phi(q)_i phi(k)_i`` is unchanged for every
        ``i`` up to one factor per query, which cancels in the ratio. Every
        key sum ``z_i`` then holds a term equal to 1 (its largest key) and
        the query's largest feature is 1, so ``phi(q) . z >= 1 / m``: no row
        underflows, and what underflows is below ``e^-87`` of what is kept.

        Args:
            queries: ``[B, T, H, D]`` projected queries.
            keys: ``[B, S, H, D]`` projected keys.
            key_mask: optional ``[B, S]``, 1 for real keys (padded keys are
                left out of the maxima; their features are masked after).

        Returns:
            ``(phi(q) [B, T, H, m], phi(k) [B, S, H, m])``, positive float32.
        """
        xk, proj_k = self._project(keys)  # [B, S, H, D], [B, S, H, m]
        exp_k = proj_k - 0.5 * ops.sum(ops.square(xk), axis=-1, keepdims=True)  # [B, S, H, m]
        if key_mask is None:
            shift = ops.max(exp_k, axis=1, keepdims=True, initial=_NO_KEY)  # [B, 1, H, m]
        else:
            real = ops.cast(key_mask, "bool")[:, :, None, None]  # [B, S, 1, 1]
            shift = ops.max(ops.where(real, exp_k, ops.full_like(exp_k, _NO_KEY)), axis=1, keepdims=True)
        shift = ops.stop_gradient(ops.where(shift > _NO_KEY, shift, ops.zeros_like(shift)))  # [B, 1, H, m]; 0: no key
        exp_k = exp_k - shift
        if key_mask is not None:
            exp_k = ops.where(real, exp_k, ops.zeros_like(exp_k))  # padded: exp(0), masked after the map
        xq, proj_q = self._project(queries)  # [B, T, H, D], [B, T, H, m]
        exp_q = proj_q - 0.5 * ops.sum(ops.square(xq), axis=-1, keepdims=True) + shift  # [B, T, H, m]
        exp_q = exp_q - ops.stop_gradient(ops.max(exp_q, axis=-1, keepdims=True, initial=float("-inf")))
        scale = 1.0 / math.sqrt(self.num_features)
        return ops.exp(exp_q) * scale, ops.exp(exp_k) * scale  # [B, T, H, m], [B, S, H, m]
