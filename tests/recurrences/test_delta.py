"""keras_linattn.ops delta rule (DeltaNet, Gated DeltaNet) against float64 oracles.

The chunked path (both solvers) against the per-token float64 reference,
outputs and gradients, at lengths that are not multiples of the chunk and with
padding; the unit lower-triangular inverse; the step token by token; bad gates.
"""

import numpy as np
import pytest

from keras_linattn import ops as lops
from keras_linattn.ops.delta import DELTA_CHUNK
from tests.recurrences._common import B, C, H, M, _decay_conditioning, _grads, _padding
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def _delta_inputs(rng, t):
    q = rng.normal(size=(B, t, H, C)).astype("float32")
    k = rng.normal(size=(B, t, H, C)).astype("float32")
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, t, H, M)).astype("float32")
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, H))))).astype("float32")
    return q, k, v, beta


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated_delta"])
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
# T=70 repeats T=33's code path (a full chunk of DELTA_CHUNK=32 and a part)
# with one more chunk: `make test-slow` runs it; its fast twin is the T=33 case
# with the same chunk size and gating (test_delta_solvers_* also runs T=70).
@pytest.mark.parametrize("t", [1, 7, 33, pytest.param(70, marks=pytest.mark.slow)])
def test_delta_matches_oracle_outputs_and_gradients(rng, t, chunk_size, gated):
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32") if gated else None
    mask = _padding(rng, t)
    s0 = rng.normal(size=(B, H, C, M)).astype("float32")
    w = rng.normal(size=(B, t, H, M))
    inputs = (q, k, v, beta) + ((g,) if gated else ())

    def fast(q_, k_, v_, b_, g_=None):
        return lops.delta_rule_attention(q_, k_, v_, b_, g_, key_mask=mask, chunk_size=chunk_size, initial_state=s0)

    def oracle(q_, k_, v_, b_, g_=None):
        return lops.delta_rule_reference(q_, k_, v_, b_, g_, key_mask=mask, initial_state=s0)[0]

    # Each step is a contraction (|k| = 1, beta <= 1): errors do not grow with
    # t beyond the sums; the chunk adds its triangular solve (L) and the
    # C + M products per step.
    n = t + DELTA_CHUNK + C + M
    cond = 1.0 if g is None else _decay_conditioning(g[..., None], chunk_size, mask)
    assert_close(fast(*inputs), oracle(*inputs), n=n, conditioning=cond, what="outputs")
    assert_close(_grads(fast, inputs, w), _grads(oracle, inputs, w), n=2 * n, conditioning=cond, what="gradients")


@pytest.mark.parametrize("length", [1, 2, 5, 16, 32])
def test_unit_lower_inverse_by_squaring_matches_float64(rng, length):
    from keras_linattn.ops.delta import _unit_lower_inverse

    # What the delta rule feeds it: |a_ij| <= 1 (beta <= 1, unit keys, decay <= 1).
    a = np.tril(rng.uniform(-1, 1, (3, length, length)), -1).astype("float32")
    expected = np.linalg.inv(np.eye(length) + a.astype("float64"))
    # Each entry is a sum over at most 2^(log2 L) paths through products of L factors.
    assert_close(_unit_lower_inverse(a), expected, n=2 * length, what="inverse")


@pytest.mark.parametrize("solver", ["inverse", "substitution"])
def test_delta_solvers_match_oracle_outputs_and_gradients(rng, solver):
    t = 70  # two full chunks of 32 and a part
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32")
    mask = _padding(rng, t)
    w = rng.normal(size=(B, t, H, M))
    inputs = (q, k, v, beta, g)

    def fast(q_, k_, v_, b_, g_):
        return lops.delta_rule_attention(q_, k_, v_, b_, g_, key_mask=mask, chunk_size=32, solver=solver)

    def oracle(q_, k_, v_, b_, g_):
        return lops.delta_rule_reference(q_, k_, v_, b_, g_, key_mask=mask)[0]

    n = t + DELTA_CHUNK + C + M  # as in test_delta_matches_oracle_outputs_and_gradients
    cond = _decay_conditioning(g[..., None], 32, mask)
    assert_close(fast(*inputs), oracle(*inputs), n=n, conditioning=cond, what="outputs")
    assert_close(_grads(fast, inputs, w), _grads(oracle, inputs, w), n=2 * n, conditioning=cond, what="gradients")


def test_delta_refuses_an_unknown_solver(rng):
    q, k, v, beta = _delta_inputs(rng, 4)
    with pytest.raises(ValueError, match="`solver` must be one of"):
        lops.delta_rule_attention(q, k, v, beta, solver="cholesky")


@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated_delta"])
def test_delta_step_and_state_match_the_oracle(rng, gated):
    t = 29
    q, k, v, beta = _delta_inputs(rng, t)
    g = (-np.abs(rng.normal(size=(B, t, H))) * 0.5).astype("float32") if gated else None
    mask = _padding(rng, t)
    ref, ref_state = lops.delta_rule_reference(q, k, v, beta, g, key_mask=mask)
    out, state = lops.delta_rule_attention(q, k, v, beta, g, key_mask=mask, chunk_size=8, return_state=True)
    n = t + DELTA_CHUNK + C + M
    assert_close(state, ref_state, n=n, what="final state")
    s = np.zeros((B, H, C, M), "float32")
    outs = []
    for i in range(t):
        g_i = None if g is None else g[:, i]
        o, s = lops.delta_rule_step(q[:, i], k[:, i], v[:, i], beta[:, i], s, g_i, mask[:, i])
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), ref, n=n, what="step outputs")
    assert_close(s, ref_state, n=n, what="step state")


def test_delta_overwrites_what_addition_accumulates():
    """One key written twice with beta = 1: the delta rule returns the second value, addition the sum."""
    k = np.zeros((1, 2, 1, C), "float32")
    k[..., 0] = 1.0
    v = np.array([1.0, 5.0], "float32").reshape(1, 2, 1, 1) * np.ones((1, 2, 1, M), "float32")
    beta = np.ones((1, 2, 1), "float32")
    out = np.asarray(lops.delta_rule_attention(k, k, v, beta))
    np.testing.assert_allclose(out[0, 1, 0], 5.0, rtol=1e-6)
    added = np.asarray(lops.gated_linear_attention(k, k, v, np.zeros((1, 2, 1, 1), "float32"), normalize=False))
    np.testing.assert_allclose(added[0, 1, 0], 6.0, rtol=1e-6)


def test_delta_padded_step_leaves_the_state_unchanged(rng):
    q, k, v, beta = _delta_inputs(rng, 1)
    k[0] = np.nan
    s = rng.normal(size=(B, H, C, M)).astype("float32")
    _, new = lops.delta_rule_step(
        q[:, 0], k[:, 0], v[:, 0], beta[:, 0], s, np.full((B, H), -2.0, "float32"), np.array([False, True])
    )
    np.testing.assert_array_equal(np.asarray(new)[0], s[0])
    assert not np.allclose(np.asarray(new)[1], s[1])


def test_delta_refuses_bad_gates(rng):
    q, k, v, beta = _delta_inputs(rng, 4)
    with pytest.raises(ValueError, match="`beta` must have shape"):
        lops.delta_rule_attention(q, k, v, beta[:, :3])
    with pytest.raises(ValueError, match="`log_decay` must have rank 3"):
        lops.delta_rule_attention(q, k, v, beta, np.zeros((B, 4, H, 1), "float32"))
    with pytest.raises(ValueError, match="`initial_state` must be S"):
        lops.delta_rule_attention(q, k, v, beta, initial_state=np.zeros((B, H, C, M + 1), "float32"))
