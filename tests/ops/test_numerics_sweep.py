"""Numerics sweep: every feature map, inputs x1e-3 ... x1e3, causal and not, against a log-space oracle.

`LinearAttention`'s attention (feature map, then `ops.linear_attention`) runs
on projected queries/keys/values ``[B, T, H, D]`` scaled by each power of 10
from 1e-3 to 1e3, under `tf.function` (graph mode, where nothing can raise).
Batch row 1 is right-padded. Each output row ``(b, t, h)`` is compared with
`tests._log_oracle.attend_reference`: exact kernel attention of the same map
computed in float64 in log space from the inputs and the map's weights, never
from the layer's float32 features.

Each row with at least one key falls in exactly one class:

- ``ok``: finite and within the error model's bound, ``C_ROUND * eps32 *
  (sqrt(n) + L) * cond`` relative to the largest ``|v|`` the row attends to
  (n = C features + the row's keys, cond = the normalizer's conditioning,
  L = the exponent magnitude that float32 rounds, see `tests._log_oracle`);
- ``wrong``: finite, nonzero and outside the bound;
- ``zero``: exactly 0 (a silent zero: the worst case);
- ``flagged``: NaN, the documented marker of a row whose kernel float32
  cannot represent (eagerly the layer raises instead, tested below);
- ``unresolved``: the bound itself is vacuous (>= 0.5): float32 cannot
  compute the exponents of this row to any accuracy (favor+ at x1e3 has
  exponents ~1e6, rounded by ~0.1). Such a row must be finite and nonzero,
  or flagged.

A row with no key must be exactly 0. The test asserts: no ``wrong`` rows, no
``zero`` rows, everything finite except flagged rows.

``python -m tests.ops.test_numerics_sweep`` prints the table of
docs/dev/hardening.md (map x scale x causal -> row classes).

Shape legend: B batch, T length, H heads, D key dim, M value dim.
"""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention
from tests._log_oracle import attend_reference
from tests.conftest import TEST_SEED
from tests.tolerance import C_ROUND, VACUOUS, eps

MAPS = tuple(feature_maps.available())
SCALES = tuple(10.0**e for e in range(-3, 4))
B, T, H, D, PAD = 2, 96, 2, 4, 24
CLASSES = ("ok", "wrong", "zero", "flagged", "unresolved")


def _layer(name):
    keras.utils.set_random_seed(TEST_SEED)
    kwargs = {"seed": 0} if name in ("favor+", "favor_trig") else {}
    layer = LinearAttention(
        H,
        D,
        feature_map=feature_maps.get(name, **kwargs),
        chunk_size=32,
        conv_size=None,  # the float64 oracle is the attention without a short convolution
    )
    layer(np.zeros((1, 4, 8), "float32"), np.zeros((1, 4, 8), "float32"))  # build
    return layer


def _inputs(scale, seed=0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, T, H, D)) * scale).astype("float32")
    k = (rng.standard_normal((B, T, H, D)) * scale).astype("float32")
    v = rng.standard_normal((B, T, H, D)).astype("float32")
    mask = np.ones((B, T), bool)
    mask[1, T - PAD :] = False
    return q, k, v, mask


def classify(out, ref):
    """Counts of the row classes (module docstring) and the number of bad key-less rows."""
    out = np.asarray(out, np.float64)
    counts = dict.fromkeys(CLASSES, 0)
    finite = np.isfinite(out).all(-1)
    nonzero = (out != 0).any(-1)
    keyless = ~ref["has_key"]
    bad_keyless = int((keyless & (~finite | nonzero)).sum())
    rows = ref["has_key"]
    diff = np.abs(np.where(np.isfinite(out), out, 0.0) - ref["out"]).max(-1) / np.maximum(ref["vmax"], 1e-300)
    bound = C_ROUND * eps("float32") * (np.sqrt(ref["n"]) + ref["mag"]) * ref["cond"]
    flagged = rows & ~finite
    zero = rows & finite & ~nonzero & ref["defined"]
    unresolved = rows & finite & nonzero & (bound >= VACUOUS)
    wrong = rows & finite & nonzero & (bound < VACUOUS) & (diff > bound)
    counts["flagged"] = int(flagged.sum())
    counts["zero"] = int(zero.sum())
    counts["unresolved"] = int(unresolved.sum())
    counts["wrong"] = int(wrong.sum())
    counts["ok"] = int(rows.sum()) - sum(counts[c] for c in CLASSES[1:])
    return counts, bad_keyless


def _runner(layer, causal):
    """The layer's attention under one `tf.function` (traced once per map and causality)."""

    @tf.function(autograph=False)
    def run(q, k, v, mask):
        return layer._compute_attention(q, k, v, key_mask=mask, use_causal_mask=causal)[0]

    return run


def sweep_case(name, scale, causal, layer=None, runner=None):
    layer = layer or _layer(name)
    runner = runner or _runner(layer, causal)
    q, k, v, mask = _inputs(scale)
    out = runner(q, k, v, mask).numpy()
    ref = attend_reference(layer.feature_map, q, k, v, causal=causal, key_mask=mask)
    return classify(out, ref)


# Scales between the decades where rows used to be wrong without a word (all maps were swept at x1, 3, 10,
# 30, 100, 300, 1000; docs/dev/hardening.md item 9): favor+ causal x30 had 10 wrong rows, glu causal x300 one.
BETWEEN = (("favor+", 30.0), ("glu", 300.0))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", MAPS)
def test_no_wrong_or_zero_rows(name, causal):
    layer = _layer(name)
    runner = _runner(layer, causal)
    for scale in SCALES:
        counts, bad_keyless = sweep_case(name, scale, causal, layer, runner)
        what = f"{name} x{scale:g} {'causal' if causal else 'non-causal'}: {counts}"
        assert bad_keyless == 0, what
        assert counts["zero"] == 0, what
        assert counts["wrong"] == 0, what


@pytest.mark.parametrize("name,scale", BETWEEN, ids=[f"{n}-x{s:g}" for n, s in BETWEEN])
def test_no_wrong_rows_between_the_decades(name, scale):
    counts, bad_keyless = sweep_case(name, scale, True)
    what = f"{name} x{scale:g} causal: {counts}"
    assert bad_keyless == 0 and counts["zero"] == 0 and counts["wrong"] == 0, what


def table(maps=MAPS, scales=SCALES):
    lines = ["| map | scale | causal | ok | wrong | zero | flagged | unresolved |", "|---" * 8 + "|"]
    for name in maps:
        layer = _layer(name)
        for causal in (False, True):
            runner = _runner(layer, causal)
            for scale in scales:
                counts, bad = sweep_case(name, scale, causal, layer, runner)
                cells = " | ".join(str(counts[c]) for c in CLASSES)
                extra = f" keyless bad {bad}" if bad else ""
                lines.append(f"| {name} | x{scale:g} | {'y' if causal else 'n'} | {cells} |{extra}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.ops.test_numerics_sweep [--scales 1,3,10] [MAP ...]
    args = sys.argv[1:]
    scales = SCALES
    if args[:1] == ["--scales"]:
        scales, args = tuple(float(x) for x in args[1].split(",")), args[2:]
    print(table(args or MAPS, scales))


def _small_keys_case(rng, causal):
    """Positive features where the keys are ~1e-12 and the queries ~1: phi(q).z ~ 1e-12 << 1e-6 * sum|phi(q)|."""
    qf = rng.uniform(0.5, 1.5, (1, 8, 1, 3)).astype("float32")
    kf = (rng.uniform(0.5, 1.5, (1, 8, 1, 3)) * 1e-12).astype("float32")
    v = rng.standard_normal((1, 8, 1, 2)).astype("float32")
    return qf, kf, v


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_guard_does_not_floor_rows_whose_keys_are_small(causal):
    """The old guard eps * sum|phi(q)| replaced these denominators (output ~1e-6 of the right one)."""
    from keras_linattn import ops as la_ops
    from keras_linattn.ops.reference import kernel_attention_reference
    from tests.tolerance import assert_close

    qf, kf, v = _small_keys_case(np.random.default_rng(TEST_SEED), causal)
    out = la_ops.linear_attention(qf, kf, v, causal=causal, chunk_size=4)
    ref = kernel_attention_reference(qf, kf, v.astype("float64"), causal=causal)
    assert_close(out, ref, n=3 + 8, what="small keys")
    # The step agrees with the oracle too.
    state = (np.zeros((1, 1, 3, 2), "float32"), np.zeros((1, 1, 3), "float32"))
    if causal:
        steps = []
        for t in range(8):
            o, state = la_ops.linear_attention_step(qf[:, t], kf[:, t], v[:, t], state)
            steps.append(np.asarray(o))
        assert_close(np.stack(steps, 1), ref, n=3 + 8, what="small keys, step")


def test_guard_gradient_exact_and_padded_rows_zero():
    """Gradients through the guarded division equal float64 autodiff of the plain ratio; padded rows: 0, finite."""
    from keras_linattn import ops as la_ops
    from keras_linattn.ops.reference import kernel_attention_reference
    from tests.tolerance import assert_close

    rng = np.random.default_rng(TEST_SEED)
    qf, kf, v = _small_keys_case(rng, True)
    qf, kf, v = (np.concatenate([x, x], 0) for x in (qf, kf, v))
    mask = np.ones((2, 8), bool)
    mask[1] = False  # row 1: every key padded
    w = rng.standard_normal((2, 8, 1, 2))

    def grads(fn, dtype):
        xs = [tf.constant(x.astype(dtype)) for x in (qf, kf, v)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = fn(*xs)
            loss = tf.reduce_sum(out * tf.constant(w.astype(dtype)))
        return out.numpy(), [g.numpy() for g in tape.gradient(loss, xs)]

    def fast(q, k, x):
        return la_ops.linear_attention(q, k, x, causal=True, key_mask=mask, chunk_size=4)

    out, g32 = grads(fast, "float32")
    ref, g64 = grads(lambda q, k, x: kernel_attention_reference(q, k, x, causal=True, key_mask=mask), "float64")
    assert np.array_equal(out[1], np.zeros_like(out[1]))
    assert_close(out[0], ref[0], n=11, what="output")
    for a, b, name in zip(g32, g64, ("q", "k", "v"), strict=True):
        assert np.isfinite(a).all(), name
        assert_close(a[0], b[0], n=11, what=f"d/d{name}")


def test_underflow_raises_eagerly_and_is_nan_in_a_graph():
    """favor+ causal at x100: every kernel entry underflows float32; never a silent 0."""
    from keras_linattn.ops.core import KernelUnderflowError

    layer = _layer("favor+")
    q, k, v, mask = _inputs(100.0)
    with pytest.raises(KernelUnderflowError, match="underflow"):
        layer._compute_attention(q, k, v, key_mask=mask, use_causal_mask=True)
    out = _runner(layer, True)(q, k, v, mask).numpy()
    assert np.isnan(out).all(axis=-1).any()
    # The same layer at x1 is untouched: finite, no error.
    q1, k1, v1, _ = _inputs(1.0)
    assert np.isfinite(np.asarray(layer._compute_attention(q1, k1, v1, key_mask=mask, use_causal_mask=True)[0])).all()


def test_elu_query_with_very_negative_coordinates_is_not_zero():
    """elu(x) + 1 rounded to 0 from x ~ -17 and exp(x) underflows at -87: such queries are lifted, not zeroed."""
    fm = feature_maps.get("elu")
    x = np.array([[[[-20.0, -25.0, -19.0], [-500.0, -900.0, -700.0]]]], "float32")  # [1, 1, 2, 3]
    phi = np.asarray(fm(x, is_query=True))
    expected = np.exp(x.astype("float64") - np.minimum(x.max(-1, keepdims=True) + 30.0, 0.0))
    # exp of a float32 argument ~30: relative error ~30 eps; entries below float32's range are 0.
    np.testing.assert_allclose(phi, expected.astype("float32"), rtol=4 * 2**-23 * 30, atol=0)
    assert phi[0, 0, 1].max() > 0  # not an all-zero row


def _trig_layer():
    keras.utils.set_random_seed(TEST_SEED)
    layer = LinearAttention(
        2,
        4,
        feature_map=feature_maps.get("favor_trig", seed=0),
        chunk_size=4,
        conv_size=None,  # the state checked is the (S, z) pair alone, without the convolution's buffers
    )
    layer(np.zeros((1, 4, 8), "float32"), np.zeros((1, 4, 8), "float32"))  # build
    return layer


def test_favor_trig_causal_key_past_the_amplitude_cap_is_flagged():
    """A causal favor_trig key with |k'|^2/2 > 50 (its amplitude is capped at exp(50)) flags the rows after it.

    Rows before it are untouched (bit for bit: causal), rows from it on are NaN in a graph, and an eager
    call raises; the step flags the same rows and carries a NaN state, so step == parallel.
    """
    from keras_linattn.ops.core import KernelUnderflowError

    layer = _trig_layer()
    rng = np.random.default_rng(TEST_SEED)
    x = (rng.standard_normal((2, 12, 8)) * 0.3).astype("float32")
    big = x.copy()
    big[0, 6] *= 1000.0  # sequence 0, token 6: every head's key far past the cap
    graph = tf.function(lambda a: layer(a, a, use_causal_mask=True, return_state=True), autograph=False)
    with pytest.raises(KernelUnderflowError, match="amplitude"):
        layer(big, big, use_causal_mask=True)
    out, state = graph(big)
    out = np.asarray(out)
    small, small_state = graph(x)
    assert np.isnan(out[0, 6:]).all()
    np.testing.assert_array_equal(out[0, :6], np.asarray(small)[0, :6])  # bit-identical before the key
    np.testing.assert_array_equal(out[1], np.asarray(small)[1])  # the other sequence is untouched
    for part, clean in zip(state, small_state, strict=True):
        assert np.isnan(np.asarray(part)[0]).all() and np.isfinite(np.asarray(part)[1]).all()
        np.testing.assert_array_equal(np.asarray(part)[1], np.asarray(clean)[1])
    # The step: the same rows, and the NaN state carries the flag to every later step.
    step = tf.function(layer.step, autograph=False)
    st = layer.get_initial_state(2)
    with pytest.raises(KernelUnderflowError, match="amplitude"):
        layer.step(big[:, 6], big[:, 6], st)
    outs = []
    for t in range(12):
        o, st = step(big[:, t], big[:, t], st)
        outs.append(np.asarray(o))
    steps = np.stack(outs, 1)
    np.testing.assert_array_equal(np.isnan(steps), np.isnan(out))
    assert np.isfinite(steps[~np.isnan(out)]).all()
