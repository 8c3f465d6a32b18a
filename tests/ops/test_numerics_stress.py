"""Numerics stress: input scales, mixed precision, all-padded rows, long sequences.

For each registered feature map, inputs scaled by 1e-3 ... 1e3 go through
`LinearAttention` under float32, mixed_bfloat16 and mixed_float16 (same
weights), causal and non-causal. Every output must be finite. Each mixed
precision output is checked twice, with the error model of
`tests.tolerance` (docs/dev/testing.md):

- against the float32 layer: the reductions that round in the policy's
  compute dtype are the query/key/value projections (over the DIM inputs)
  and the output projection (over H*M); features, the state (S, z) and the
  normalizer are float32 under every policy, so the attention's sums over
  S keys and C features are not in n (in bf16 they would make every bound
  vacuous). Conditioning: the normalizer's (1 for positive kernels).
- against the "replay": the float32 layer's feature map, attention and output
  projection run on the mixed layer's own (bf16/fp16) projections. What is
  left is the cast of the attention output and the output projection
  (n = H*M), so this shows that any larger error comes from the rounded
  projections seen through the map, not from the precision of the attention.

Where a map's output is not a well-conditioned function of its projections
(a kink, saturation, a signed normalizer), no non-vacuous bound against
float32 exists: those cases are listed by name in `NOT_CLOSE_TO_FLOAT32`,
with the reason, and keep the finiteness and replay checks.

``python -m tests.ops.test_numerics_stress`` prints the measured table that
docs/dev/hardening.md records.

Shape legend: B batch, T length, H heads, D key dim.
"""

import functools
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as la_ops
from keras_linattn.layers import LinearAttention
from keras_linattn.ops.core import KernelUnderflowError
from tests._helpers import layer_conditioning
from tests.conftest import TEST_SEED
from tests.tolerance import assert_close, bound, rel_err

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

MAPS = feature_maps.available()
SCALES = (1e-3, 1e-1, 1.0, 1e1, 1e3)
POLICIES = ("mixed_bfloat16", "mixed_float16")
DIM, HEADS, KEY_DIM, LENGTH = 16, 2, 4, 96
# favor_trig under float16 is refused (see test_favor_trig_is_refused_under_float16...).
UNSTABLE = {"favor_trig"}

# Reductions in the policy's compute dtype between the inputs and the output: the
# q/k/v projections over the DIM inputs and the output projection over H*M.
N_MIXED = DIM + HEADS * KEY_DIM
# Mixed layer against the float32 replay on its own projections: the output projection.
N_REPLAY = HEADS * KEY_DIM

_RELU = (
    "relu(x) + 1e-6 has a kink at 0: a bf16/fp16 projection flips the sign of a near-zero "
    "coordinate, and a query whose other coordinates are negative goes from epsilon-only "
    "features (a uniform average) to attending through that one feature. The output is "
    "not a continuous function of the projections' rounding at any scale (seeds 0-19: "
    "up to 0.66 under bf16 and 2.1e-2 under fp16, against bounds of 0.15 and 0.019)."
)
_SATURATION = (
    "x1e3: projections are ~1e3, so their absolute rounding error (bf16: ~4, fp16: ~0.5) "
    "lands in exponents (elu's exp branch, favor+, hedgehog's softmax) or saturating "
    "gates and softplus (glu, oglu, aoglu, ffn): features change by factors e^(error). "
    "Only the polynomial taylor map stays well conditioned."
)
_FAVOR_X10 = (
    "favor+'s exponent grows like |x'|^2, ~1e2 at x10: the projections' rounding moves "
    "exponents by ~0.4 (bf16) / ~0.05 (fp16), i.e. attention weights by e^(that)."
)
_TRIG = (
    "favor_trig's signed normalizer phi(q).z cancels from x1 up: its conditioning "
    "(normalizer_conditioning) is 1e3 ... 1e6, which makes any bound vacuous."
)
# (map, policy, scale) -> why the mixed-precision output has no non-vacuous bound
# against float32. These cases are still checked for finiteness and against the replay.
NOT_CLOSE_TO_FLOAT32 = {
    **{("relu", p, s): _RELU for p in POLICIES for s in SCALES},
    **{(m, p, 1e3): _SATURATION for m in MAPS if m not in ("relu", "taylor", "favor_trig") for p in POLICIES},
    **{("favor+", p, 1e1): _FAVOR_X10 for p in POLICIES},
    **{("favor_trig", "mixed_bfloat16", s): _TRIG for s in (1.0, 1e1, 1e3)},
}


# (map, scale, causal) where the float32 layer's kernel underflows: real keys, but every
# product phi(q).phi(k) of some row is below float32's range. Eagerly the layer raises
# `KernelUnderflowError` (in a graph those rows are NaN), never a silent 0 (docs/dev/hardening.md,
# tests/ops/test_numerics_sweep.py). Causal keys cannot be shifted (it would leak the future):
# favor+'s key exponent is ~ -|k'|^2/2 (with DIM=16 projections, ~-1e2 at x10); the others
# meet a query whose few keys so far are all far below it at x1e3. Non-causal favor+ no longer
# underflows at any scale (a shift per feature folded into the queries, `noncausal_pair`).
# favor_trig, causal, from x10: keys past its amplitude cap exp(50) (|k'|^2/2 ~ 1e2 at x10) raise
# the same error; their kernel is not representable either.
UNDERFLOW = {
    ("favor+", 1e1, True),
    ("favor+", 1e3, True),
    ("favor_trig", 1e1, True),
    ("favor_trig", 1e3, True),
    *((m, 1e3, True) for m in ("aoglu", "ffn", "glu", "hedgehog", "oglu")),
}


def _map(name):
    if name in ("favor+", "favor_trig"):
        return feature_maps.get(name, num_features=16, seed=0)
    return feature_maps.get(name)


def _layer(name, policy, weights=None):
    layer = LinearAttention(
        HEADS,
        KEY_DIM,
        feature_map=_map(name),
        chunk_size=32,
        conv_size=None,  # the float64 oracles are the attention without a short convolution
        dtype=policy,
    )
    layer.build((None, None, DIM), (None, None, DIM))
    if weights is not None:
        layer.set_weights(weights)
    return layer


def _inputs(seed, batch=2, length=LENGTH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, DIM)).astype("float32")  # [B, T, dim]
    mask = np.ones((batch, length), bool)
    mask[-1, length // 2 :] = False  # right padding on the last row
    return x, mask


def _float32_core_on_projections(layer32, q, k, v, mask, causal):
    """The float32 layer's feature map, attention and output projection on given projections."""
    k = tf.where(mask[:, :, None, None], k, tf.zeros_like(k))  # padded keys enter the map as zeros
    qf, kf = layer32.recurrence.feature_pair(q, k, causal, key_mask=mask)  # as the layer maps them
    attended = la_ops.linear_attention(qf, kf, v, causal=causal, key_mask=mask, chunk_size=32, eps=layer32.epsilon)
    return np.asarray(layer32.output_dense(attended))


@functools.lru_cache(maxsize=None)
def measure(name, seed=TEST_SEED, scales=SCALES, policies=POLICIES, causal_modes=(False, True)):
    """{(scale, policy, causal): dict(out, expected, replayed, err, replay_err, finite, conditioning)}.

    ``out``: the layer's output under ``policy`` (as float32); ``expected``: the
    float32 layer's; ``replayed``: the float32 feature map, attention and output
    projection on ``policy``'s own projections; ``err`` / ``replay_err``: the
    relative errors of ``out`` against them (NaN where not finite);
    ``conditioning``: the normalizer's, of the float32 layer's features. float32
    rows only record finiteness. Weights and inputs are drawn from ``seed``.
    """
    keras.utils.set_random_seed(seed)
    ref = _layer(name, "float32")
    policies = [p for p in policies if not (name in UNSTABLE and p == "mixed_float16")]
    layers = {p: _layer(name, p, ref.get_weights()) for p in policies}
    x, mask = _inputs(seed)
    nan = float("nan")
    results = {}
    for causal in causal_modes:
        for scale in scales:
            xs = x * np.float32(scale)
            try:
                expected = np.asarray(ref(xs, xs, key_mask=mask, use_causal_mask=causal))
            except KernelUnderflowError:
                results[(scale, "float32", causal)] = dict(finite=False, raised=True, conditioning=nan)
                continue
            ok = bool(np.isfinite(expected).all())
            cond = layer_conditioning(ref, xs, xs, causal=causal, key_mask=mask) if ok else nan
            results[(scale, "float32", causal)] = dict(finite=ok, conditioning=cond)
            for policy in policies:
                out = np.asarray(tf.cast(layers[policy](xs, xs, key_mask=mask, use_causal_mask=causal), "float32"))
                finite = bool(np.isfinite(out).all())
                q, k, v = (tf.cast(t, "float32") for t in layers[policy].project(xs, xs))
                replayed = _float32_core_on_projections(ref, q, k, v, mask, causal)
                results[(scale, policy, causal)] = dict(
                    out=out,
                    expected=expected,
                    replayed=replayed,
                    err=rel_err(out, expected) if finite and ok else nan,
                    replay_err=rel_err(out, replayed) if finite and np.isfinite(replayed).all() else nan,
                    finite=finite,
                    conditioning=cond,
                )
    return results


def _bound_against_float32(name, policy, scale, conditioning):
    """The model's bound against float32, or None for a case in `NOT_CLOSE_TO_FLOAT32`.

    n: the D-input projections + the H*M output projection, in the policy's dtype;
    conditioning: the normalizer's (favor_trig's signed features; 1 for positive kernels).
    """
    if (name, policy, scale) in NOT_CLOSE_TO_FLOAT32:
        return None
    return bound(policy, n=N_MIXED, conditioning=conditioning)


@pytest.mark.parametrize("name", MAPS)
def test_scaled_inputs_stay_finite_and_close_to_float32(name):
    for (scale, policy, causal), r in measure(name).items():
        where = f"{name} x{scale:g} {policy} causal={causal}"
        # Raised KernelUnderflowError: exactly the documented cases, and only those.
        assert r.get("raised", False) == ((name, scale, causal) in UNDERFLOW), where
        if r.get("raised"):
            continue
        assert r["finite"], where
        if policy == "float32" or (name, policy, scale) in NOT_CLOSE_TO_FLOAT32:
            continue  # excluded by name, with the reason, in NOT_CLOSE_TO_FLOAT32
        assert_close(
            r["out"], r["expected"], n=N_MIXED, dtype=policy, conditioning=r["conditioning"], what=where
        )  # D projections + H*M output projection


@pytest.mark.parametrize("name", MAPS)
def test_mixed_precision_error_comes_from_the_projections(name):
    """Every mixed-precision output, excluded cases included, equals the float32
    feature map, attention and output projection replayed on the mixed layer's own
    query/key/value projections, within the error of what is left: the attention
    output's cast and the output projection in the policy's dtype (n = H*M). So the
    feature map and the float32 accumulation of (S, z) add nothing: where the error
    against float32 is large (relu, the x1e3 saturation, favor_trig from x1), it is
    the rounded projections seen through a map that is sensitive to its inputs."""
    for (scale, policy, causal), r in measure(name).items():
        if policy == "float32":
            continue
        where = f"{name} x{scale:g} {policy} causal={causal}"
        assert_close(r["out"], r["replayed"], n=N_REPLAY, dtype=policy, what=where)  # H*M output projection


def test_favor_trig_is_refused_under_float16_with_a_clear_error():
    # Measured: its float32 outputs reach 1.9e5 at x1 (beyond float16's 65504),
    # which gave inf and then NaN after the output projection.
    with pytest.raises(ValueError, match=r"float16.*Received: feature_map='favor_trig', dtype='mixed_float16'"):
        _layer("favor_trig", "mixed_float16")
    keras.config.set_dtype_policy("mixed_float16")
    with pytest.raises(ValueError, match="bfloat16"):
        LinearAttention(2, 4, feature_map="favor_trig")


def test_large_scale_behaviour_of_random_feature_maps_is_the_documented_one():
    x, mask = _inputs(TEST_SEED)
    xs = x * np.float32(1e3)
    # favor_trig at x1e3: non-causal finite; causal keys are past the amplitude cap exp(50), which
    # would change their kernel: eagerly that raises, in a graph the rows are NaN.
    trig = _layer("favor_trig", "float32")
    assert np.isfinite(np.asarray(trig(xs, xs, key_mask=mask, use_causal_mask=False))).all()
    with pytest.raises(KernelUnderflowError, match="amplitude"):
        trig(xs, xs, key_mask=mask, use_causal_mask=True)
    graph = tf.function(lambda a, m: trig(a, a, key_mask=m, use_causal_mask=True))
    assert np.isnan(np.asarray(graph(xs, mask))).any()
    k = trig.key_dense(xs)  # [B, T, H, D]
    kf = np.asarray(trig.feature_map(k, is_query=False, causal=True))
    # |sin|, |cos| <= 1 over sqrt(m = 16), times the capped amplitude, up to float32's exp.
    assert np.isfinite(kf).all() and np.abs(kf).max() <= np.exp(50.0) / 4.0 * (1 + bound("float32", n=1))
    # favor+ causal at x1e3: keys have no stabilizer in causal mode (a max over
    # time would leak the future), so exp(w.k' - |k'|^2/2) underflows to 0 for
    # every key. Eagerly that raises; in a graph the rows are NaN: never the
    # silent 0 (the output bias) it used to be.
    plus = _layer("favor+", "float32")
    with pytest.raises(KernelUnderflowError, match="underflow"):
        plus(xs, xs, key_mask=mask, use_causal_mask=True)
    graph = tf.function(lambda a, m: plus(a, a, key_mask=m, use_causal_mask=True))
    assert np.isnan(np.asarray(graph(xs, mask))).any()
    # Non-causal favor+ at x1e3 does not underflow: each feature's keys are shifted by their own
    # max and the queries by the same amounts (`noncausal_pair`), so phi(q).z >= 1/m in every row.
    assert np.isfinite(np.asarray(plus(xs, xs, key_mask=mask, use_causal_mask=False))).all()


@pytest.mark.parametrize("policy", ("float32",) + POLICIES)
@pytest.mark.parametrize("name", MAPS)
def test_all_padded_rows_give_zero_attention_and_finite_gradients(name, policy):
    ref = _layer(name, "float32")
    if name in UNSTABLE and policy == "mixed_float16":
        with pytest.raises(ValueError, match="float16"):  # refused, see above
            _layer(name, policy, ref.get_weights())
        return
    layer = ref if policy == "float32" else _layer(name, policy, ref.get_weights())
    x, _ = _inputs(TEST_SEED + 1, length=20)
    mask = np.ones((2, 20), bool)
    mask[0] = False  # every key of row 0 is padded
    xt = tf.constant(x)
    for causal in (False, True):
        with tf.GradientTape() as tape:
            tape.watch(xt)
            out = layer(xt, xt, key_mask=mask, use_causal_mask=causal)
            loss = tf.reduce_sum(tf.cast(out, "float32"))
        grads = tape.gradient(loss, [xt] + layer.trainable_weights)
        out = np.asarray(tf.cast(out, "float32"))
        # No key: the attention output is 0, so the layer gives its output bias.
        bias = np.asarray(tf.cast(layer.output_dense.bias, out.dtype))
        np.testing.assert_array_equal(out[0], np.broadcast_to(bias, out[0].shape))
        assert np.isfinite(out).all()
        for g in grads:
            if g is not None:
                assert np.isfinite(np.asarray(tf.cast(tf.convert_to_tensor(g), "float32"))).all()


def _long(name, length, policies, seed=TEST_SEED):
    keras.utils.set_random_seed(seed)
    ref = LinearAttention(2, 8, feature_map=_map(name), chunk_size=64)
    ref.build((None, None, DIM), (None, None, DIM))
    x = np.random.default_rng(seed + 2).normal(size=(1, length, DIM)).astype("float32")
    expected = np.asarray(ref(x, x, use_causal_mask=True))
    assert np.isfinite(expected).all()
    outputs = {}
    for policy in policies:
        layer = LinearAttention(2, 8, feature_map=_map(name), chunk_size=64, dtype=policy)
        layer.build((None, None, DIM), (None, None, DIM))
        layer.set_weights(ref.get_weights())
        out = np.asarray(tf.cast(layer(x, x, use_causal_mask=True), "float32"))
        assert np.isfinite(out).all(), (name, length, policy)
        outputs[policy] = out
    return outputs, expected


# The long-sequence layers: 2 heads of key dim 8 (M = 8).
N_LONG = DIM + 2 * 8  # D projections + H*M output projection, in the policy's dtype


@pytest.mark.parametrize("length", [8192, 32768])
@pytest.mark.parametrize("name", ["elu", "favor+", "hedgehog"])
def test_long_sequence_mixed_precision_is_close_to_float32(name, length):
    # 32k takes ~1 s per map here, so it runs by default.
    outputs, expected = _long(name, length, POLICIES)
    # The same bound at every length: the T-long sums accumulate in float32 (in the
    # policy's dtype they would add T to n, a bf16 bound of 5.7 at 32k: no test).
    for policy, out in outputs.items():
        assert_close(out, expected, n=N_LONG, dtype=policy, what=f"{name} T={length} {policy}")


def _table():
    keras.config.set_dtype_policy("float32")
    print(
        f"seed {TEST_SEED}; error against float32 (bound, or 'excl.' for NOT_CLOSE_TO_FLOAT32) "
        "and against the replay on the mixed layer's projections"
    )
    print("| map | scale | causal | mixed_bfloat16 | mixed_float16 | bf16 / fp16 vs replay | finite (f32/bf16/f16) |")
    print("|---|---|---|---|---|---|---|")
    for name in MAPS:
        results = measure(name)
        for causal in (False, True):
            for scale in SCALES:
                cells, replay, fin = [], [], []
                if results[(scale, "float32", causal)].get("raised"):
                    raised = "KernelUnderflowError"
                    print(f"| {name} | {scale:g} | {causal} | {raised} | {raised} | - | raised |")
                    continue
                for policy in ("float32",) + POLICIES:
                    if (scale, policy, causal) not in results:
                        fin.append("refused")
                        cells.append("ValueError")
                        replay.append("-")
                        continue
                    r = results[(scale, policy, causal)]
                    fin.append("y" if r["finite"] else "**inf**")
                    if policy == "float32":
                        continue
                    if np.isnan(r["err"]):
                        cells.append("n/a")
                    else:
                        b = _bound_against_float32(name, policy, scale, r["conditioning"])
                        cells.append(f"{r['err']:.1e} ({'excl.' if b is None else f'<= {b:.1e}'})")
                    replay.append("n/a" if np.isnan(r["replay_err"]) else f"{r['replay_err']:.1e}")
                replays, finite = " / ".join(replay), "/".join(fin)
                print(f"| {name} | {scale:g} | {causal} | {cells[0]} | {cells[1]} | {replays} | {finite} |")
    for name in ("elu", "favor+", "hedgehog"):
        for length in (8192, 32768):
            outputs, expected = _long(name, length, POLICIES)
            print(
                f"long {name} T={length}: "
                + ", ".join(f"{p} {rel_err(o, expected):.1e} (<= {bound(p, n=N_LONG):.1e})" for p, o in outputs.items())
            )


if __name__ == "__main__":
    _table()


# ------------------------------------------------------------------ soak
def test_redraw_callback_trains_a_causal_lm_with_favor_plus():
    """What the soak's favor+ run needs: redraws hit the blocks' built maps
    and skip the LM's unbuilt template map (which used to raise)."""
    from keras_linattn.callbacks import RedrawRandomFeatures
    from keras_linattn.models import LinearCausalLM

    lm = LinearCausalLM(
        vocabulary_size=16,
        num_layers=1,
        hidden_dim=8,
        num_heads=2,
        intermediate_dim=16,
        feature_map=feature_maps.get("favor+", num_features=4, seed=0),
    )
    lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = np.random.default_rng(0).integers(0, 16, (4, 9)).astype("int32")
    block_map = lm.decoder_blocks[0].attention.feature_map
    before = np.asarray(block_map.projection)
    redraw = RedrawRandomFeatures(every_n_steps=1)
    lm.fit(ids[:, :-1], ids[:, 1:], batch_size=2, epochs=1, callbacks=[redraw], verbose=0)
    assert redraw.redraw_count == 1
    assert not np.array_equal(np.asarray(block_map.projection), before)


@pytest.mark.slow
@pytest.mark.parametrize("feature_map", ["elu", "favor+", "oglu", "hedgehog"])
def test_mixed_precision_training_soak(feature_map):
    """2,000 bf16 steps of a tiny LM (tests/soak.py): no NaN, the loss falls."""
    from tests.soak import soak

    result = soak(feature_map, steps=2000, policy="mixed_bfloat16")
    assert result["non_finite_steps"] == 0 and result["weights_finite"]
    # Learning criterion: the held-out loss covers at least half of the way from chance,
    # log VOCAB (32 tokens), to the task's floor, log SUBSET (each sequence samples 4 tokens).
    from tests.soak import SUBSET, VOCAB

    assert result["loss_after"] < result["loss_before"] - 0.5 * (math.log(VOCAB) - math.log(SUBSET))
