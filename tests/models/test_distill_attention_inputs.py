"""Distillation compares the attention the layer computes: rotary embeddings included.

`distill.attention_kl` (and so `distill_attention`'s loss) took the layer's
bare projections, before the short convolution and the rotary embeddings:
for a RoPE layer it measured (and trained toward) the softmax attention of
un-rotated queries and keys, an attention neither model computes. The
oracle here rotates the projections in NumPy (rotate-half, keras-hub's
convention, checked against keras-hub in tests/layers/test_pretrained_attention.py).
"""

import keras
import numpy as np

from keras_linattn import distill, feature_maps
from keras_linattn.layers import LinearAttention
from tests.tolerance import assert_close

T, DIM, HEADS, KEY_DIM, WAVELENGTH = 10, 12, 2, 4, 20.0


def _model():
    inp = keras.Input((T, DIM))
    attention = LinearAttention(
        HEADS,
        KEY_DIM,
        feature_map=feature_maps.get("hedgehog", share_qk=False),
        conv_size=None,  # the oracle rotates the bare projections: no convolution between
        rope_max_wavelength=WAVELENGTH,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.7, seed=3),
        name="attention",
    )
    out = attention(inp, inp, use_causal_mask=True)
    return keras.Model(inp, out), attention


def _rotate(x):
    """Rotate-half RoPE of ``x [B, T, H, D]`` at positions 0..T-1, float64."""
    d = x.shape[-1]
    inv_freq = 1.0 / WAVELENGTH ** (np.arange(0, d, 2) / d)  # [D/2]
    angle = np.arange(x.shape[1])[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = np.concatenate([np.cos(angle)] * 2, -1)[None, :, None, :]
    sin = np.concatenate([np.sin(angle)] * 2, -1)[None, :, None, :]
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _kl(layer, q, k):
    """Mean causal KL(softmax || linear) over rows, in float64, from the given queries and keys."""
    qf = np.asarray(layer.feature_map(q.astype("float32"), is_query=True), np.float64)
    kf = np.asarray(layer.feature_map(k.astype("float32"), is_query=False), np.float64)
    total, rows = 0.0, 0
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(q.shape[1]):
                logits = q[b, i, h] @ k[b, : i + 1, h].T / np.sqrt(q.shape[-1])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                lin = kf[b, : i + 1, h] @ qf[b, i, h]
                lin /= lin.sum()
                total += float(np.sum(p * (np.log(p) - np.log(lin))))
                rows += 1
    return total / rows


def test_attention_kl_of_a_rope_layer_uses_the_rotated_queries_and_keys():
    model, layer = _model()
    x = np.random.default_rng(0).normal(size=(3, T, DIM)).astype("float32")
    model(x)
    got = distill.attention_kl(model, x, layers=[layer])["attention"]
    q, k, _ = (np.asarray(t, np.float64) for t in layer.project(x, x))
    rotated = _kl(layer, _rotate(q), _rotate(k))
    unrotated = _kl(layer, q, k)
    # float32 vs the float64 definition: reductions over D, T keys (twice), C features and the rows.
    assert_close(got, rotated, n=KEY_DIM + 3 * T + 2 * layer.feature_dim + 3 * HEADS * T, what="KL")
    # The two definitions are far apart here, so the check above tells them apart.
    assert abs(rotated - unrotated) > 0.05 * rotated, (rotated, unrotated)
