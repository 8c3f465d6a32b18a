"""keras_linattn.ops decay gates (gated linear attention) against float64 oracles.

The chunked path against the per-token float64 reference, outputs and
gradients, at lengths that are not multiples of the chunk and with padding;
the step token by token; strong decays, padded steps, the degenerate-only
normalizer guard and underflow (reported, never a silent 0).
"""

import numpy as np
import pytest

from keras_linattn import ops as lops
from tests.recurrences._common import (
    B,
    C,
    H,
    M,
    _assert_flagged,
    _decay_conditioning,
    _features,
    _grads,
    _has_key,
    _log_decay,
    _modes,
    _padding,
    _small_or_negative_keys,
    _underflowing,
)
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
# T=130 repeats T=65's code path (several chunks and a part at every chunk
# size, 65 = 64 + 1 = 4 * 16 + 1) at twice the cost: `make test-slow` runs it;
# its fast twin is the T=65 case with the same chunk size, width and normalize.
@pytest.mark.parametrize("t", [1, 7, 65, pytest.param(130, marks=pytest.mark.slow)])
def test_gated_matches_oracle_outputs_and_gradients(rng, t, chunk_size, width, normalize):
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    state = (
        np.abs(rng.normal(size=(B, H, C, M))).astype("float32"),
        np.abs(rng.normal(size=(B, H, C))).astype("float32"),
    )
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, k_, v_, g_):
        return lops.gated_linear_attention(
            q_, k_, v_, g_, key_mask=mask, chunk_size=chunk_size, initial_state=state, normalize=normalize
        )

    def oracle(q_, k_, v_, g_):
        return lops.gated_linear_attention_reference(
            q_, k_, v_, g_, key_mask=mask, initial_state=state, normalize=normalize
        )[0]

    cond = _decay_conditioning(g, chunk_size, mask)
    assert_close(fast(q, k, v, g), oracle(q, k, v, g), n=t + C, conditioning=cond, what="outputs")  # T keys, C features
    # Backward adds the sums over the T queries and the M values; the decay's
    # gradient sums over the C features and M values of every later token.
    assert_close(
        _grads(fast, (q, k, v, g), w),
        _grads(oracle, (q, k, v, g), w),
        n=2 * t + 2 * C + M,
        conditioning=cond,
        what="gradients",
    )


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_final_state_and_step_match_the_oracle(rng, width):
    t = 37
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    out, state = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=8, return_state=True)
    ref, ref_state = lops.gated_linear_attention_reference(q, k, v, g, key_mask=mask)
    cond = _decay_conditioning(g, 8, mask)
    for part, expected in zip(state, ref_state, strict=True):
        assert_close(part, expected, n=t, conditioning=cond, what="final state")  # a decayed sum over T keys
    step_state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    outs = []
    for i in range(t):
        o, step_state = lops.gated_linear_attention_step(q[:, i], k[:, i], v[:, i], g[:, i], step_state, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), ref, n=t + C, what="step outputs")
    for part, expected in zip(step_state, ref_state, strict=True):
        assert_close(part, expected, n=t, what="step state")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_strong_decay_over_a_long_sequence_stays_finite_and_exact(rng, width):
    """fla issue #77: exp of a bare cumulative log-decay underflows/overflows. Only differences are exponentiated."""
    t = 700
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width, strength=30.0)  # cumulative log decay ~ -2e4: a bare exp overflows
    w = rng.normal(size=(B, t, H, M))

    def fast(q_, k_, v_, g_):
        return lops.gated_linear_attention(q_, k_, v_, g_, chunk_size=64)

    def oracle(q_, k_, v_, g_):
        return lops.gated_linear_attention_reference(q_, k_, v_, g_)[0]

    out = np.asarray(fast(q, k, v, g))
    assert np.isfinite(out).all()
    cond = _decay_conditioning(g, 64)
    assert_close(out, oracle(q, k, v, g), n=t + C, conditioning=cond, what="outputs")
    grads = _grads(fast, (q, k, v, g), w)
    assert np.isfinite(grads).all()
    assert_close(grads, _grads(oracle, (q, k, v, g), w), n=2 * t + 2 * C + M, conditioning=cond, what="gradients")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_a_padded_step_neither_writes_nor_decays_the_state(rng, width):
    """fla issue #1272: padding must not decay the state."""
    q, k, v = _features(rng, 1)
    g = _log_decay(rng, 1, width, strength=3.0)
    k[0, 0] = np.nan  # junk at a padded position must not leak either
    state = (rng.normal(size=(B, H, C, M)).astype("float32"), np.abs(rng.normal(size=(B, H, C))).astype("float32"))
    mask = np.array([False, True])
    _, new = lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state, mask)
    np.testing.assert_array_equal(np.asarray(new[0])[0], state[0][0])
    np.testing.assert_array_equal(np.asarray(new[1])[0], state[1][0])
    assert not np.allclose(np.asarray(new[0])[1], state[0][1])
    # The parallel path: a left-padded sequence gives the unpadded one's outputs and state.
    t = 20
    q, k, v = _features(rng, t)
    g = _log_decay(rng, t, width)
    mask = np.ones((B, t), bool)
    mask[:, :6] = False
    out, st = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=8, return_state=True)
    out_u, st_u = lops.gated_linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], chunk_size=8, return_state=True)
    assert_close(np.asarray(out)[:, 6:], out_u, n=t + C, paths=2, what="left-padded outputs")
    for a, b in zip(st, st_u, strict=True):
        assert_close(a, b, n=t, paths=2, what="left-padded state")


def test_no_decay_without_normalizer_is_the_numerator(rng):
    t = 29
    q, k, v = _features(rng, t)
    mask = _padding(rng, t)
    for causal in (True, False):
        out = lops.linear_attention(q, k, v, causal=causal, key_mask=mask, chunk_size=8, normalize=False)
        if causal:
            ref = lops.gated_linear_attention_reference(
                q, k, v, np.zeros((B, t, H, 1), "float32"), key_mask=mask, normalize=False
            )[0]
        else:
            km = mask[:, :, None, None]
            s = np.einsum("bshc,bshm->bhcm", np.where(km, k, 0).astype("float64"), np.where(km, v, 0))
            ref = np.einsum("bthc,bhcm->bthm", q.astype("float64"), s)
        assert_close(out, ref, n=t + C, what=f"causal={causal}")


def test_gated_refuses_bad_log_decay(rng):
    q, k, v = _features(rng, 4)
    with pytest.raises(ValueError, match="`log_decay` must have a last dim of 1"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 4, H, 2), "float32"))
    with pytest.raises(ValueError, match="`log_decay` must have the leading dims"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 5, H, 1), "float32"))
    with pytest.raises(ValueError, match="`log_decay` must have rank 4"):
        lops.gated_linear_attention(q, k, v, np.zeros((B, 4, H), "float32"))


# ---------------------------------------------------------------- degenerate-only normalizer guard
def _gated_oracle(q, k, v, g, mask):
    """Exact decayed kernel attention in float64 numpy, from the features (independent of the library)."""
    q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, g))
    keep = np.asarray(mask, np.float64)[:, :, None, None]
    k, v, g = k * keep, v * keep, g * keep  # a padded step neither writes nor decays
    cum = np.cumsum(g, axis=1)  # [B, T, H, G]
    t = q.shape[1]
    causal = np.tril(np.ones((t, t)))[None, :, :, None, None]  # [1, T(i), T(j), 1, 1]
    w = np.exp(np.minimum(cum[:, :, None] - cum[:, None, :], 0.0)) * causal  # [B, T(i), T(j), H, G]
    a = np.einsum("bihc,bjhc,bijhc->bhij", q, k, np.broadcast_to(w, w.shape[:-1] + (q.shape[-1],)))
    den = a.sum(-1).transpose(0, 2, 1)[..., None]  # [B, T, H, 1]; 0 for a query before any real key (output 0)
    return np.einsum("bhij,bjhm->bihm", a, v) / np.where(den == 0, 1.0, den)


@pytest.mark.parametrize("keys", ["small", "negative"])
@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_divides_small_and_negative_denominators_exactly(rng, width, keys):
    # The guard replaces the denominator only where it is degenerate (|den| <= eps * |phi(q)|.|z|):
    # a row whose keys are small, or a signed map's negative denominator, is the exact ratio.
    t, chunk = 13, 4
    q, k, v = _small_or_negative_keys(rng, t, keys)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)
    expected = _gated_oracle(q, k, v, g, mask)
    cond = _decay_conditioning(g, chunk, mask)
    out = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=chunk)
    assert_close(out, expected, n=t + C, conditioning=cond, what="chunked")
    ref, _ = lops.gated_linear_attention_reference(q, k, v, g, key_mask=mask)
    assert_close(ref, expected, n=t + C, what="reference")
    state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    outs = []
    for i in range(t):
        o, state = lops.gated_linear_attention_step(q[:, i], k[:, i], v[:, i], g[:, i], state, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), expected, n=t + C, what="steps")


# ---------------------------------------------------------------- underflow is reported, never a silent 0
@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_underflow_raises_eagerly_and_is_nan_in_graphs(rng, width):
    from keras_linattn.ops.core import KernelUnderflowError

    t = 9
    q, k, v = _underflowing(rng, t)
    g = _log_decay(rng, t, width)
    mask = _padding(rng, t)  # row 1 starts with 3 padded keys: no key yet, output 0, not an underflow
    with pytest.raises(KernelUnderflowError, match="underflow"):
        lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=4)
    for mode, fn in zip(
        ("graph", "xla"), _modes(lambda *x: lops.gated_linear_attention(*x, key_mask=mask, chunk_size=4)), strict=True
    ):
        _assert_flagged(fn(q, k, v, g), _has_key(mask), f"chunked, {mode}")
    # The step: eagerly it raises at the first real key; in a graph its rows are NaN.
    state = (np.zeros((B, H, C, M), "float32"), np.zeros((B, H, C), "float32"))
    with pytest.raises(KernelUnderflowError, match="underflow"):
        lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state, mask[:, 0])
    step, _ = _modes(lambda *x: lops.gated_linear_attention_step(*x))
    outs = []
    for i in range(t):
        o, state = step(q[:, i], k[:, i], v[:, i], g[:, i], state, mask[:, i])
        outs.append(np.asarray(o))
    _assert_flagged(np.stack(outs, 1), _has_key(mask), "steps, graph")


@pytest.mark.parametrize("width", [1, C], ids=["scalar", "channel"])
def test_gated_tiny_decayed_state_is_not_an_underflow(rng, width):
    # A state decayed far below its keys (log decay -40 per step), or carried in tiny, is still a state: the
    # rows are the exact ratio, and rows whose keys are all padded are 0, with nothing raised.
    t = 9
    q, k, v = _features(rng, t)
    g = np.full((B, t, H, width), -40.0, "float32")
    mask = _padding(rng, t)
    expected = _gated_oracle(q, k, v, g, mask)
    out = lops.gated_linear_attention(q, k, v, g, key_mask=mask, chunk_size=4)
    assert_close(out, expected, n=t + C, conditioning=_decay_conditioning(g, 4, mask), what="strong decay")
    tiny = (np.full((B, H, C, M), 1e-25, "float32"), np.full((B, H, C), 1e-25, "float32"))
    none = np.zeros((B, t), bool)  # every key padded: only the carried state
    out = np.asarray(lops.gated_linear_attention(q, k, v, g, key_mask=none, chunk_size=4, initial_state=tiny))
    np.testing.assert_allclose(out, 1.0, rtol=1e-5)  # S / z = 1e-25 / 1e-25 in every row
    o, _ = lops.gated_linear_attention_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], tiny, none[:, 0])
    np.testing.assert_allclose(np.asarray(o), 1.0, rtol=1e-5)


def test_state_at_the_edge_of_float32_is_flagged(rng):
    # |phi(q)|.|z| at most 2^-103 (within 1/eps32 of the smallest normal float, where products flush to 0): the
    # row is reported (eagerly: raised; in a graph: NaN), in the plain and gated forms, parallel and step.
    # Just above the floor it is the exact ratio.
    from keras_linattn.ops.core import KERNEL_FLOOR, KernelUnderflowError

    t = 5
    q, k, v = _features(rng, t)
    q = np.abs(q) / np.abs(q).sum(-1, keepdims=True)  # sum |phi(q)| = 1: |phi(q)|.|z| = the state's value
    g = np.full((B, t, H, 1), -1.0, "float32")
    none = np.zeros((B, t), bool)
    for value, flagged in ((KERNEL_FLOOR / 2, True), (KERNEL_FLOOR * 4, False)):
        state = (np.full((B, H, C, M), value, "float32"), np.full((B, H, C), value, "float32"))
        runs = {
            "plain": lambda s=state: lops.linear_attention(q, k, v, causal=True, key_mask=none, initial_state=s),
            "gated": lambda s=state: lops.gated_linear_attention(q, k, v, g, key_mask=none, initial_state=s),
            "plain step": lambda s=state: lops.linear_attention_step(q[:, 0], k[:, 0], v[:, 0], s, none[:, 0])[0],
            "gated step": lambda s=state: lops.gated_linear_attention_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], s, none[:, 0]
            )[0],
        }
        for what, run in runs.items():
            if flagged:
                with pytest.raises(KernelUnderflowError, match="2\\^-103"):
                    run()
                graph, _ = _modes(run)
                assert np.isnan(np.asarray(graph())).all(), what
            else:
                out = np.asarray(run())
                assert_close(out, np.ones_like(out), n=C, what=what)  # S q / z q: C products per row
