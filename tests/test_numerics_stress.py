"""Numerics stress: input scales, mixed precision, all-padded rows, long sequences.

For each registered feature map, inputs scaled by 1e-3 ... 1e3 go through
`LinearAttention` under float32, mixed_bfloat16 and mixed_float16 (same
weights), causal and non-causal. Outputs must be finite and the mixed
precision outputs close to float32; where a map legitimately breaks down
(favor_trig at large scales: its denominator is a signed random estimate),
the documented behaviour is asserted instead.

``python -m tests.test_numerics_stress`` prints the measured table that
docs/hardening.md records.

Shape legend: B batch, T length, H heads, D key dim.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as la_ops
from keras_linattn.layers import LinearAttention

MAPS = feature_maps.available()
SCALES = (1e-3, 1e-1, 1.0, 1e1, 1e3)
POLICIES = ("mixed_bfloat16", "mixed_float16")
DIM, HEADS, KEY_DIM, LENGTH = 16, 2, 4, 96

# Max relative error (max|a - b| / max|b|) of a mixed-precision output against
# float32 (seeded weights), ~2.5x the worst case measured over the maps, both
# directions and scales 0.1 ... 10 (docs/hardening.md has the whole table).
BOUNDS = {"mixed_bfloat16": 0.06, "mixed_float16": 1.2e-2}
# Extreme scales: at x1e3 the softplus/GLU kernels saturate on bfloat16-rounded
# projections (measured up to 0.78 for glu), at x1e-3 relu features collapse
# to their epsilon. Still finite; the error is recorded, loosely bounded.
EXTREME_BOUNDS = {"mixed_bfloat16": 2.0, "mixed_float16": 0.1}
# relu: features are exactly 0 for half the coordinates plus epsilon, so the
# output is sensitive to the sign of small projected coordinates, which the
# bf16 projection matmul flips: measured 0.33 at x1 (the error is in the
# projections, see test_mixed_precision_error_comes_from_the_projections).
PER_MAP_BOUNDS = {"relu": {"mixed_bfloat16": 1.0, "mixed_float16": 1.2e-2}}
# favor_trig has signed features: phi(q).z comes arbitrarily close to zero and
# the output is an unstable ratio in any precision (its docstring says so).
# Under float16 the layer refuses it (see below); under bfloat16 only
# finiteness is asserted, plus a bound at scales <= 0.1 (measured 6e-3).
UNSTABLE = {"favor_trig"}
UNSTABLE_BOUND = 0.05


def _map(name):
    if name in ("favor+", "favor_trig"):
        return feature_maps.get(name, num_features=16, seed=0)
    return feature_maps.get(name)


def _layer(name, policy, weights=None):
    layer = LinearAttention(HEADS, KEY_DIM, feature_map=_map(name), chunk_size=32, dtype=policy)
    layer.build((None, None, DIM), (None, None, DIM))
    if weights is not None:
        layer.set_weights(weights)
    return layer


def _inputs(seed=0, batch=2, length=LENGTH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, DIM)).astype("float32")  # [B, T, dim]
    mask = np.ones((batch, length), bool)
    mask[-1, length // 2 :] = False  # right padding on the last row
    return x, mask


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def measure(name, scales=SCALES, policies=POLICIES, causal_modes=(False, True)):
    """{(scale, policy, causal): (max rel err vs float32, finite)}; float32 rows give (0, finite)."""
    keras.utils.set_random_seed(0)
    ref = _layer(name, "float32")
    policies = [p for p in policies if not (name in UNSTABLE and p == "mixed_float16")]
    layers = {p: _layer(name, p, ref.get_weights()) for p in policies}
    x, mask = _inputs()
    results = {}
    for causal in causal_modes:
        for scale in scales:
            xs = x * np.float32(scale)
            expected = np.asarray(ref(xs, xs, key_mask=mask, use_causal_mask=causal))
            results[(scale, "float32", causal)] = (0.0, bool(np.isfinite(expected).all()))
            for policy in policies:
                out = np.asarray(tf.cast(layers[policy](xs, xs, key_mask=mask, use_causal_mask=causal), "float32"))
                finite = bool(np.isfinite(out).all())
                err = _rel(out, expected) if finite and np.isfinite(expected).all() else float("nan")
                results[(scale, policy, causal)] = (err, finite)
    return results


@pytest.mark.parametrize("name", MAPS)
def test_scaled_inputs_stay_finite_and_close_to_float32(name):
    results = measure(name)
    for (scale, policy, causal), (err, finite) in results.items():
        where = f"{name} x{scale:g} {policy} causal={causal}"
        assert finite, where
        if policy == "float32":
            continue
        if name in UNSTABLE:
            if scale <= 0.1:
                assert err <= UNSTABLE_BOUND, (where, err)
            continue
        bound = PER_MAP_BOUNDS.get(name, BOUNDS)[policy] if 1e-1 <= scale <= 1e1 else EXTREME_BOUNDS[policy]
        assert err <= bound, (where, err)


def test_favor_trig_is_refused_under_float16_with_a_clear_error():
    # Measured: its float32 outputs reach 1.9e5 at x1 (beyond float16's 65504),
    # which gave inf and then NaN after the output projection.
    with pytest.raises(ValueError, match=r"float16.*Received: feature_map='favor_trig', dtype='mixed_float16'"):
        _layer("favor_trig", "mixed_float16")
    keras.config.set_dtype_policy("mixed_float16")
    with pytest.raises(ValueError, match="bfloat16"):
        LinearAttention(2, 4, feature_map="favor_trig")


def test_large_scale_behaviour_of_random_feature_maps_is_the_documented_one():
    x, mask = _inputs()
    xs = x * np.float32(1e3)
    # favor_trig at x1e3: finite (the causal key amplitude is capped at exp(50)).
    trig = _layer("favor_trig", "float32")
    for causal in (False, True):
        assert np.isfinite(np.asarray(trig(xs, xs, key_mask=mask, use_causal_mask=causal))).all()
    k = trig.key_dense(xs)  # [B, T, H, D]
    kf = np.asarray(trig.feature_map(k, is_query=False, causal=True))
    assert np.isfinite(kf).all() and np.abs(kf).max() <= np.exp(50.0) * 1.0001
    # favor+ causal at x1e3: keys have no stabilizer in causal mode (a max over
    # time would leak the future), so exp(w.k' - |k'|^2/2) underflows to 0 for
    # every key; the guarded denominator turns that into a zero attention
    # output (the layer then gives its output bias), never NaN.
    plus = _layer("favor+", "float32")
    out = np.asarray(plus(xs, xs, key_mask=mask, use_causal_mask=True))
    bias = np.asarray(plus.output_dense.bias)
    np.testing.assert_array_equal(out, np.broadcast_to(bias, out.shape))
    # Non-causal keys share a max stabilizer and still work at x1e3.
    out = np.asarray(plus(xs, xs, key_mask=mask, use_causal_mask=False))
    assert np.isfinite(out).all() and np.abs(out - bias).max() > 1.0


@pytest.mark.parametrize("policy", ("float32",) + POLICIES)
@pytest.mark.parametrize("name", MAPS)
def test_all_padded_rows_give_zero_attention_and_finite_gradients(name, policy):
    ref = _layer(name, "float32")
    if name in UNSTABLE and policy == "mixed_float16":
        with pytest.raises(ValueError, match="float16"):  # refused, see above
            _layer(name, policy, ref.get_weights())
        return
    layer = ref if policy == "float32" else _layer(name, policy, ref.get_weights())
    x, _ = _inputs(seed=1, length=20)
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


def _long(name, length, policies):
    keras.utils.set_random_seed(0)
    ref = LinearAttention(2, 8, feature_map=_map(name), chunk_size=64)
    ref.build((None, None, DIM), (None, None, DIM))
    x = np.random.default_rng(2).normal(size=(1, length, DIM)).astype("float32")
    expected = np.asarray(ref(x, x, use_causal_mask=True))
    assert np.isfinite(expected).all()
    errors = {}
    for policy in policies:
        layer = LinearAttention(2, 8, feature_map=_map(name), chunk_size=64, dtype=policy)
        layer.build((None, None, DIM), (None, None, DIM))
        layer.set_weights(ref.get_weights())
        out = np.asarray(tf.cast(layer(x, x, use_causal_mask=True), "float32"))
        assert np.isfinite(out).all(), (name, length, policy)
        errors[policy] = _rel(out, expected)
    return errors


@pytest.mark.parametrize("length", [8192, 32768])
@pytest.mark.parametrize("name", ["elu", "favor+", "hedgehog"])
def test_long_sequence_mixed_precision_is_close_to_float32(name, length):
    # 32k takes ~1 s per map here, so it runs by default.
    errors = _long(name, length, POLICIES)
    # Measured at 8192 and 32768: <= 5.3e-3 (bf16), <= 6.5e-4 (fp16).
    for policy, err in errors.items():
        assert err <= BOUNDS[policy] / 5, (name, policy, err)


def _table():
    keras.config.set_dtype_policy("float32")
    print("| map | scale | causal | mixed_bfloat16 rel err | mixed_float16 rel err | finite (f32/bf16/f16) |")
    print("|---|---|---|---|---|---|")
    for name in MAPS:
        results = measure(name)
        for causal in (False, True):
            for scale in SCALES:
                cells = []
                fin = []
                for policy in ("float32",) + POLICIES:
                    if (scale, policy, causal) not in results:
                        fin.append("refused")
                        cells.append("ValueError")
                        continue
                    err, finite = results[(scale, policy, causal)]
                    fin.append("y" if finite else "**inf**")
                    if policy != "float32":
                        cells.append("n/a" if np.isnan(err) else f"{err:.1e}")
                print(f"| {name} | {scale:g} | {causal} | {cells[0]} | {cells[1]} | {'/'.join(fin)} |")
    for name in ("elu", "favor+", "hedgehog"):
        for length in (8192, 32768):
            errors = _long(name, length, POLICIES)
            print(f"long {name} T={length}: " + ", ".join(f"{p} {e:.1e}" for p, e in errors.items()))


if __name__ == "__main__":
    _table()


# ------------------------------------------------------------------ soak
def test_redraw_callback_trains_a_causal_lm_with_favor_plus():
    """What the soak's favor+ run needs: redraws hit the blocks' built maps
    and skip the LM's unbuilt template map (which used to raise)."""
    from keras_linattn.callbacks import RedrawRandomFeatures
    from keras_linattn.models import LinearCausalLM

    lm = LinearCausalLM(16, 1, 8, 2, 16, feature_map=feature_maps.get("favor+", num_features=4, seed=0))
    lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = np.random.default_rng(0).integers(0, 16, (4, 9)).astype("int32")
    block_map = lm.decoder_blocks[0].attention.feature_map
    before = np.asarray(block_map.projection)
    redraw = RedrawRandomFeatures(every_n_steps=1)
    lm.fit(ids[:, :-1], ids[:, 1:], batch_size=2, epochs=1, callbacks=[redraw], verbose=0)
    assert redraw.redraw_count == 1
    assert not lm.feature_map.built
    assert not np.array_equal(np.asarray(block_map.projection), before)


@pytest.mark.slow
@pytest.mark.parametrize("feature_map", ["elu", "favor+", "oglu", "hedgehog"])
def test_mixed_precision_training_soak(feature_map):
    """2,000 bf16 steps of a tiny LM (tests/soak.py): no NaN, the loss falls."""
    from tests.soak import soak

    result = soak(feature_map, steps=2000, policy="mixed_bfloat16")
    assert result["non_finite_steps"] == 0 and result["weights_finite"]
    # From log 32 = 3.47 towards log 4 = 1.39 (measured: 1.84 ... 1.92 after 2,000 steps).
    assert result["loss_after"] < result["loss_before"] - 1.0


def _float32_core_on_projections(layer32, q, k, v, mask, causal):
    """The float32 layer's feature map, attention and output projection on given projections."""
    qf = layer32.feature_map(q, is_query=True, causal=causal)
    kf = layer32.feature_map(k * mask[:, :, None, None].astype("float32"), is_query=False, causal=causal)
    attended = la_ops.linear_attention(qf, kf, v, causal=causal, key_mask=mask, chunk_size=32)
    return np.asarray(layer32.output_dense(attended))


@pytest.mark.parametrize("scale", [1.0, 1e3])
@pytest.mark.parametrize("name", [m for m in MAPS if m not in UNSTABLE])
def test_mixed_precision_error_comes_from_the_projections(name, scale):
    """Under mixed_bfloat16 the layer's error against float32 is what its bf16
    query/key/value projections carry into a float32 computation: the feature
    map and the accumulation of (S, z) add (almost) nothing. Where that error is
    large (relu at x1, the GLU family at x1e3, docs/hardening.md), it is the
    map's sensitivity to its inputs, not the precision of the attention."""
    keras.utils.set_random_seed(0)
    ref = _layer(name, "float32")
    bf16 = _layer(name, "mixed_bfloat16", ref.get_weights())
    x, mask = _inputs()
    xs = x * np.float32(scale)
    for causal in (False, True):
        got = np.asarray(tf.cast(bf16(xs, xs, key_mask=mask, use_causal_mask=causal), "float32"))
        q, k, v = (tf.cast(t, "float32") for t in bf16.project(xs, xs))
        replayed = _float32_core_on_projections(ref, q, k, v, mask, causal)
        # Left: the bf16 attended output and output projection; about 2x
        # bfloat16's unit roundoff (2**-8) relative to the largest output.
        assert _rel(got, replayed) <= 1e-2, (name, scale, causal, _rel(got, replayed))
