"""Inputs and checks shared by the recurrence ops' tests (test_decay, test_short_conv, test_window, test_delta).

Batch B, heads H, features C, values M, head dim D; positive features, masks
with scattered and left padding, log decays, the decay's conditioning, the
gradients of a weighted sum, and the underflow checks (flagged rows: NaN where
the row has keys, exact 0 where it has none).
"""

import keras
import numpy as np

from keras_linattn.ops.decay import CHANNEL_CHUNK
from tests._backend import flat, gradients

B, H, C, M, D = 2, 3, 5, 4, 4


def _features(rng, t):
    q = np.abs(rng.normal(size=(B, t, H, C))).astype("float32") + 0.05
    k = np.abs(rng.normal(size=(B, t, H, C))).astype("float32") + 0.05
    v = rng.normal(size=(B, t, H, M)).astype("float32")
    return q, k, v


def _padding(rng, t):
    mask = np.ones((B, t), dtype=bool)
    mask[0, rng.choice(t, size=t // 4, replace=False)] = False  # scattered
    mask[1, : t // 3] = False  # left padding
    mask[0, 0] = True
    return mask


def _log_decay(rng, t, width, strength=0.5):
    return (-np.abs(rng.normal(size=(B, t, H, width))) * strength).astype("float32")


def _decay_conditioning(g, chunk_size, mask=None):
    """1 + the largest |cumulative log decay| inside one chunk of the fast path.

    The chunked path exponentiates differences of float32 cumulative sums of
    the log decay: the absolute error of such an exponent is about
    ``eps * |cumulative sum|``, which multiplies the relative error of the
    weight it gives (docs/dev/testing.md).
    """
    g = np.abs(np.asarray(g, "float64"))
    if mask is not None:
        g = g * mask[:, :, None, None]
    t = g.shape[1]
    chunk = min(chunk_size, CHANNEL_CHUNK if g.shape[-1] > 1 else chunk_size, t)
    pad = (-t) % chunk
    g = np.pad(g, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(g.shape[0], -1, chunk, *g.shape[2:])
    return 1.0 + float(g.sum(axis=2).max())


def _grads(fn, inputs, w):
    _, grads = gradients(lambda *xs: (keras.ops.sum(keras.ops.cast(fn(*xs), "float64") * w), ()), inputs)
    return flat(grads)


def _small_or_negative_keys(rng, t, keys):
    """Features whose denominators fall below the old floor ``eps * sum|phi(q)|`` (~4e-6): keys x1e-7 or negative."""
    q, k, v = _features(rng, t)
    k = k * np.float32(1e-7) if keys == "small" else -k  # a signed map's keys, all of one sign: no cancellation
    return q, k, v


def _underflowing(rng, t):
    """Positive features ~1e-25: every product phi(q).phi(k) (~1e-50) is below float32's range."""
    q, k, v = _features(rng, t)
    return q * np.float32(1e-25), k * np.float32(1e-25), v


def _has_key(mask, window=0):
    """``[B, T]``: query i has a real key at or before i (window > 0: one that has left its window)."""
    real = np.asarray(mask, bool)
    if window:
        real = np.concatenate([np.zeros((B, window), bool), real], 1)[:, : real.shape[1]]
    return np.cumsum(real, 1) > 0


def _modes(fn):
    """The call in a graph and under XLA (where nothing can raise); on JAX, `jax.jit` for both."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn), jax.jit(fn)
    import tensorflow as tf

    graph = tf.function(fn, autograph=False)
    xla = tf.function(fn, autograph=False, jit_compile=True)
    return graph, xla


def _assert_flagged(out, has_key, what):
    """NaN rows exactly where the row has real keys; exact 0 where it has none."""
    out = np.asarray(out)  # [B, T, H, M]
    nan_rows = np.isnan(out).all(-1)  # [B, T, H]
    np.testing.assert_array_equal(nan_rows, np.broadcast_to(has_key[:, :, None], nan_rows.shape), err_msg=what)
    assert not np.isnan(out[~has_key]).any() and (out[~has_key] == 0).all(), what


def _grouped_inputs(rng, heads, kv_heads, t):
    """Grouped-query step inputs: ``q, qf, kf [B, t, heads, .]``, ``k, v [B, t, kv_heads, .]``, a padding mask, gamma.

    ``kf`` is each query head's map of the key; the mask pads the first two
    tokens of row 1 and token 5 of row 0 (``t >= 6``).
    """
    q = rng.normal(size=(B, t, heads, D)).astype("float32")
    qf = np.abs(rng.normal(size=(B, t, heads, C))).astype("float32") + 0.05
    kf = np.abs(rng.normal(size=(B, t, heads, C))).astype("float32") + 0.05
    k = rng.normal(size=(B, t, kv_heads, D)).astype("float32")
    v = rng.normal(size=(B, t, kv_heads, M)).astype("float32")
    mask = np.ones((B, t), bool)
    mask[1, :2] = False
    mask[0, 5] = False
    gamma = np.linspace(0.2, 0.9, heads).astype("float32")
    return q, qf, kf, k, v, mask, gamma
