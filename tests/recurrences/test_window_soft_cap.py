"""The softmax window's logit soft cap (Gemma 2's ``c * tanh(s / c)``) against a float64 oracle written out here.

The parallel path, the step and the op's own reference all cap the window
scores; the linear terms are not capped. The spec takes ``logit_soft_cap``
only with a recurrence that has a softmax window.
"""

import numpy as np
import pytest

from keras_linattn import ops as lops
from keras_linattn.layers import AttentionSpec, LinearAttention
from tests.recurrences._common import B, C, D, H, M, _features, _padding
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

CAP = 1.5


def _capped_oracle(q, qf, k, kf, v, window, mask, cap):
    """float64: capped softmax terms over the last `window` real keys, linear terms ``qf . kf`` over older ones."""
    q, qf, k, kf, v = (np.asarray(x, "float64") for x in (q, qf, k, kf, v))
    t = q.shape[1]
    out = np.zeros((B, t, H, M))
    for b in range(B):
        for h in range(H):
            for i in range(t):
                win = [j for j in range(max(0, i - window + 1), i + 1) if mask[b, j]]
                old = [j for j in range(0, max(0, i - window + 1)) if mask[b, j]]
                s = np.array([q[b, i, h] @ k[b, j, h] * D**-0.5 for j in win])
                s = cap * np.tanh(s / cap) if cap is not None else s
                e = np.exp(s - s.max()) if win else np.zeros(0)
                lin = np.array([qf[b, i, h] @ kf[b, j, h] for j in old])
                num = sum(e[n] * v[b, j, h] for n, j in enumerate(win)) + sum(
                    lin[n] * v[b, j, h] for n, j in enumerate(old)
                )
                den = e.sum() + lin.sum()
                out[b, i, h] = num / den if den else 0.0
    return out


def _inputs(rng, t):
    # Scores of a few units (q . k / sqrt(D) with entries of size 3): the cap at 1.5 bends them.
    q = (3 * rng.normal(size=(B, t, H, D))).astype("float32")
    k = (3 * rng.normal(size=(B, t, H, D))).astype("float32")
    qf, kf, v = _features(rng, t)
    return q, k, qf, kf, v


def _with_empty_buffer(k, kf, v, mask, window):
    pad = lambda x: np.concatenate([np.zeros((B, window) + x.shape[2:], x.dtype), x], 1)  # noqa: E731
    return pad(k), pad(kf), pad(v), np.concatenate([np.zeros((B, window), bool), mask], 1)


def test_capped_window_parallel_step_and_reference_equal_the_oracle(rng):
    t, window = 13, 4
    q, k, qf, kf, v = _inputs(rng, t)
    mask = _padding(rng, t)
    expected = _capped_oracle(q, qf, k, kf, v, window, mask, CAP)
    uncapped = _capped_oracle(q, qf, k, kf, v, window, mask, None)
    assert np.abs(expected - uncapped).max() > 0.1  # the cap bends these scores
    k_all, kf_all, v_all, ok = _with_empty_buffer(k, kf, v, mask, window)
    n = t + C + D
    out = lops.window_attention(q, qf, k_all, kf_all, v_all, window, ok, chunk_size=4, soft_cap=CAP)
    assert_close(out, expected, n=n, what="parallel")
    ref = lops.window_attention_reference(q, qf, k, kf, v, window, mask, soft_cap=CAP)
    assert_close(ref, expected, n=n, what="reference")
    s = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    buffer = (
        np.zeros((B, window, H, D), "float32"),
        np.zeros((B, window, H, M), "float32"),
        np.zeros((B, window), "float32"),
    )
    features = np.zeros((B, window, H, C), "float32")  # phi of the buffered keys, kept beside for the test
    outs = []
    for i in range(t):
        o, s, buffer = lops.window_attention_step(
            q[:, i], qf[:, i], k[:, i], v[:, i], features[:, 0], buffer, s, key_mask_t=mask[:, i], soft_cap=CAP
        )
        features = np.concatenate([features[:, 1:], kf[:, i : i + 1]], 1)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), expected, n=n, what="steps")


def test_soft_cap_must_be_positive(rng):
    q, k, qf, kf, v = _inputs(rng, 3)
    with pytest.raises(ValueError, match="soft_cap.*Received: soft_cap=0"):
        lops.window_attention_reference(q, qf, k, kf, v, 2, soft_cap=0)


def test_a_layer_with_a_soft_cap_is_capped_softmax_where_the_window_covers_the_sequence(rng):
    t = 9
    # conv_size=None: the oracle attends the projections themselves (no short convolution before the window)
    layer = LinearAttention(
        num_heads=H, key_dim=D, feature_map="elu", conv_size=None, window_size=t, logit_soft_cap=CAP
    )
    x = rng.normal(size=(B, t, 8)).astype("float32")
    out = np.asarray(layer(x, x, use_causal_mask=True))
    # The same projections, attended by the float64 oracle (the window covers T: no linear term).
    q, k, v = (np.asarray(d(x), "float64") for d in (layer.query_dense, layer.key_dense, layer.value_dense))
    zeros = np.zeros((B, t, H, C))
    mask = np.ones((B, t), bool)
    attended = _capped_oracle(q, zeros, k, zeros, v, t, mask, CAP)
    want = np.einsum("bthm,hmd->btd", attended, np.asarray(layer.output_dense.kernel, "float64"))
    want = want + np.asarray(layer.output_dense.bias, "float64")
    assert_close(out, want, n=t + D + H * M, paths=2)
    assert AttentionSpec.from_config(layer.get_config()).logit_soft_cap == CAP  # kept by the config


@pytest.mark.parametrize(
    "arguments, recurrence",
    [({}, "AdditiveRecurrence"), ({"window_size": 4, "cache_size": 2}, "SparseCacheRecurrence")],
)
def test_a_soft_cap_needs_a_softmax_window(arguments, recurrence):
    with pytest.raises(ValueError, match=f"logit_soft_cap.*Received: logit_soft_cap=30.*{recurrence}"):
        AttentionSpec.create(logit_soft_cap=30.0, **arguments)
