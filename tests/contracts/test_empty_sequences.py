"""Zero-length key sets and empty causal pieces, where they are legal.

Non-causal attention over no keys gives 0 (the layers then return their output
bias); an empty causal piece gives an empty output and hands the state on
unchanged, so streaming code need not special-case an empty chunk.
"""

import numpy as np
import pytest

from keras_linattn import ops as la
from keras_linattn.layers import EfficientAttention, LinearAttention
from tests.tolerance import assert_close

B, T, H, C, M = 2, 3, 2, 4, 5


def _q():
    return np.random.default_rng(0).uniform(0.1, 1.0, (B, T, H, C)).astype("float32")


def _state():
    rng = np.random.default_rng(1)
    return rng.uniform(0.1, 1, (B, H, C, M)).astype("float32"), rng.uniform(1, 2, (B, H, C)).astype("float32")


def test_non_causal_attention_over_no_keys_is_zero_and_keeps_the_state():
    k, v = np.zeros((B, 0, H, C), "float32"), np.zeros((B, 0, H, M), "float32")
    out = np.asarray(la.linear_attention(_q(), k, v))
    np.testing.assert_array_equal(out, np.zeros((B, T, H, M), "float32"))
    np.testing.assert_array_equal(np.asarray(la.kernel_attention_reference(_q(), k, v)), out)
    s0, z0 = _state()
    out, (s, z) = la.linear_attention(_q(), k, v, initial_state=(s0, z0), return_state=True)
    np.testing.assert_array_equal(np.asarray(s), s0)
    np.testing.assert_array_equal(np.asarray(z), z0)
    # With a state, the queries read it: phi(q) S0 / phi(q) z0.
    q, s0, z0 = (x.astype("float64") for x in (_q(), s0, z0))
    expected = np.einsum("bthc,bhcm->bthm", q, s0) / np.einsum("bthc,bhc->bth", q, z0)[..., None]
    assert_close(out, expected, n=C)  # C features (numerator and denominator in parallel)


@pytest.mark.parametrize("with_state", [False, True])
def test_an_empty_causal_piece_is_empty_and_hands_the_state_on(with_state):
    q = np.zeros((B, 0, H, C), "float32")
    v = np.zeros((B, 0, H, M), "float32")
    s0, z0 = _state() if with_state else (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    out, (s, z) = la.linear_attention(
        q, q, v, causal=True, initial_state=(s0, z0) if with_state else None, return_state=True
    )
    assert tuple(out.shape) == (B, 0, H, M)
    np.testing.assert_array_equal(np.asarray(s), s0)
    np.testing.assert_array_equal(np.asarray(z), z0)


def test_streaming_with_an_empty_piece_equals_one_pass():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, 7, 8)).astype("float32")
    layer = LinearAttention(2, 4, chunk_size=4)
    whole = np.asarray(layer(x, x, use_causal_mask=True))
    first, state = layer(x[:, :3], x[:, :3], use_causal_mask=True, return_state=True)
    empty, state = layer(x[:, :0], x[:, :0], use_causal_mask=True, return_state=True, initial_state=state)
    rest = layer(x[:, 3:], x[:, 3:], use_causal_mask=True, initial_state=state)
    assert tuple(empty.shape) == (B, 0, 8)
    # Two float32 computations (pieces, one pass): paths=2.
    n = 8 + 7 + 4 + 2 * 4  # D projections + S keys + C features + H*M output projection
    assert_close(np.concatenate([first, rest], axis=1), whole, n=n, paths=2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: LinearAttention(2, 4),
        lambda: EfficientAttention(2, 4),
        lambda: EfficientAttention(2, 4, projection="random", projection_dim=2, max_length=8, seed=0),
    ],
    ids=["LinearAttention", "EfficientAttention", "EfficientAttention-random"],
)
def test_cross_attention_over_no_keys_returns_the_output_bias(make):
    layer = make()
    x = np.random.default_rng(3).normal(size=(B, T, 8)).astype("float32")
    empty = np.zeros((B, 0, 8), "float32")
    layer(x, empty)  # builds
    bias = np.linspace(-1, 1, 8).astype("float32")
    layer.output_dense.bias.assign(bias)
    out = np.asarray(layer(x, empty))
    assert np.isfinite(out).all()
    # The attention output is exactly 0, so the output projection gives exactly its bias.
    np.testing.assert_array_equal(out, np.broadcast_to(bias, out.shape))


MECHANISMS = {
    "delta": dict(update="delta", normalize=False),
    "gated delta": dict(update="delta", normalize=False, decay="scalar"),
    "window": dict(window_size=2),
}


@pytest.mark.parametrize("kwargs", list(MECHANISMS.values()), ids=list(MECHANISMS))
def test_an_empty_piece_hands_every_mechanisms_state_on(kwargs):
    """Length 0 with the delta rule or a window: an empty output and the state unchanged (issue 28)."""
    x = np.random.default_rng(4).normal(size=(B, 5, 8)).astype("float32")
    layer = LinearAttention(2, 4, chunk_size=4, **kwargs)
    _, state = layer(x[:, :3], x[:, :3], use_causal_mask=True, return_state=True)
    empty, after = layer(x[:, :0], x[:, :0], use_causal_mask=True, return_state=True, initial_state=state)
    assert tuple(empty.shape) == (B, 0, 8)
    assert len(after) == len(state)
    for s, a in zip(state, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(s))
    fresh, _ = layer(x[:, :0], x[:, :0], use_causal_mask=True, return_state=True)  # no initial state
    assert tuple(fresh.shape) == (B, 0, 8)


@pytest.mark.parametrize("kwargs", list(MECHANISMS.values()), ids=list(MECHANISMS))
def test_an_empty_batch_gives_an_empty_output(kwargs):
    """Batch 0 (e.g. with a window) gives ``[0, T, dim]``, parallel and step by step (issue 28)."""
    layer = LinearAttention(2, 4, chunk_size=4, **kwargs)
    x = np.zeros((0, 3, 8), "float32")
    out, state = layer(x, x, use_causal_mask=True, return_state=True)
    assert tuple(out.shape) == (0, 3, 8)
    assert all(s.shape[0] == 0 for s in state)
    y_t, _ = layer.step(x[:, 0], x[:, 0], layer.get_initial_state(0))
    assert tuple(y_t.shape) == (0, 8)
