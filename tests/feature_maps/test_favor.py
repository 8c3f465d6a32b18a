"""FAVOR+ and FAVOR-trig random-feature maps: the estimator, stabilizers, layer integration, saving."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.feature_maps import FavorPlusFeatureMap, FavorTrigFeatureMap, random_features
from keras_linattn.layers import LinearAttention
from tests._helpers import (
    assert_causal_outputs_never_see_the_future,
    assert_fits_with_xla,
    assert_rejects_bad_input_rank_and_shape,
    assert_self_attention_matches_oracle,
    causal_attention_model,
    layer_conditioning,
    run_steps,
    save_and_load,
)
from tests.conftest import rel_err
from tests.tolerance import assert_close, normalizer_conditioning

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

D = 16
RANDOM_MAPS = ["favor+", "favor_trig"]


def _qkv(seed, scale, t=32, h=2, m=8):
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(1, t, h, D)) * scale).astype("float32")
    k = (rng.normal(size=(1, t, h, D)) * scale).astype("float32")
    v = rng.normal(size=(1, t, h, m)).astype("float32")
    return q, k, v


def _favor_output_mse(q, k, v, num_features, kind, scaling, seeds):
    """The MSE of FAVOR+ attention vs exact softmax attention, one per projection seed."""
    exact = np.asarray(lops.softmax_attention(q, k, v))  # float64 oracle
    fm = FavorPlusFeatureMap(num_features=num_features, kind=kind, scaling=scaling, seed=0)
    fm.build(q.shape)
    errors = []
    for s in seeds:
        fm.redraw(seed=s)
        out = lops.linear_attention(fm(q, is_query=True), fm(k, is_query=False), v)
        errors.append(np.mean((np.asarray(out) - exact) ** 2))
    return np.array(errors)


def _gain_in_standard_errors(larger, smaller):
    """``(mean(larger) - mean(smaller)) / SE`` of two independent samples of MSEs."""
    se = np.sqrt(np.var(larger, ddof=1) / len(larger) + np.var(smaller, ddof=1) / len(smaller))
    return (np.mean(larger) - np.mean(smaller)) / se


def _one_query_and_key(seed):
    """One query and one key [1, 1, 1, D] (scale 0.5) and the softmax kernel
    exp(q.k / sqrt(D)) that the random features estimate for them."""
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(1, 1, 1, D)) * 0.5).astype("float32")
    k = (rng.normal(size=(1, 1, 1, D)) * 0.5).astype("float32")
    exact = float(np.exp(np.sum(q * k) / np.sqrt(D)))
    return q, k, exact


def _assert_unbiased(estimates, exact):
    """The mean of the estimates is within 4 standard errors of ``exact``,
    and the standard error is under 5% of it."""
    # Statistical: 4 standard errors of the mean of N independent draws, sd/sqrt(N).
    mean, sem = np.mean(estimates), np.std(estimates) / np.sqrt(len(estimates))
    assert abs(mean - exact) < 4 * sem
    # Not vacuous: the estimate is precise to 5% of the value it must match.
    assert sem < 0.05 * exact


# ------------------------------------------------------------ the estimator
def test_kernel_estimate_is_unbiased():
    # With the causal key formula (no shift, cap not reached) for both sides,
    # phi(q).phi(k) is the raw estimator of exp(q.k / sqrt(D)).
    q, k, exact = _one_query_and_key(seed=3)
    fm = FavorPlusFeatureMap(num_features=64, seed=0)
    fm.build(q.shape)
    estimates = []
    for s in range(300):
        fm.redraw(seed=s)
        fq = np.asarray(fm(q, is_query=False, causal=True))
        fk = np.asarray(fm(k, is_query=False, causal=True))
        estimates.append(float(np.sum(fq * fk)))
    _assert_unbiased(estimates, exact)


def test_output_error_shrinks_as_num_features_grows():
    q, k, v = _qkv(seed=11, scale=0.5)
    per_seed = [_favor_output_mse(q, k, v, m, "orthogonal", "chi", range(20)) for m in (16, 64, 256, 1024)]
    mses = [float(np.mean(e)) for e in per_seed]
    # Statistical: each 4x more features lowers the MSE (mean over 20 draws) by
    # more than 4 standard errors of the difference.
    for smaller_m, larger_m in itertools.pairwise(per_seed):
        assert _gain_in_standard_errors(smaller_m, larger_m) > 4, mses
    # The estimator's variance falls like 1/m: 64x the features should divide
    # the MSE by ~64; require 10 (the attention is a ratio of two estimates,
    # so the 1/m law is only asymptotic).
    assert mses[-1] < mses[0] / 10, mses
    # Accuracy criterion: with 1024 features the RMS error is under 10% of the RMS output.
    exact = np.asarray(lops.softmax_attention(q, k, v))
    assert mses[-1] < 0.1**2 * np.mean(exact**2), mses


def test_orthogonal_features_beat_iid_features():
    q, k, v = _qkv(seed=12, scale=0.5)
    # Statistical: the mean MSE over the draws of iid projections exceeds that
    # of orthogonal ones by more than 2 standard errors of the difference (a
    # one-sided 2.3% test; the draws are fixed, so the outcome is too).
    # Fixed row norms: orthogonality removes most of the estimator's variance.
    ortho = _favor_output_mse(q, k, v, 64, "orthogonal", "sqrt", range(20))
    iid = _favor_output_mse(q, k, v, 64, "iid", "sqrt", range(20))
    assert _gain_in_standard_errors(iid, ortho) > 2, (ortho.mean(), iid.mean())
    # chi(D) norms (the unbiased default): a smaller but systematic gain.
    ortho = _favor_output_mse(q, k, v, 64, "orthogonal", "chi", range(100))
    iid = _favor_output_mse(q, k, v, 64, "iid", "chi", range(100))
    assert _gain_in_standard_errors(iid, ortho) > 2, (ortho.mean(), iid.mean())


@pytest.mark.parametrize("kind", ["orthogonal", "iid"])
@pytest.mark.parametrize("scaling", ["chi", "sqrt"])
def test_projection_structure(kind, scaling):
    rng = np.random.default_rng(0)
    w = random_features._gaussian_projection(rng, 40, 8, kind, scaling).astype("float64")  # [m, D]
    assert w.shape == (40, 8)
    norms = np.linalg.norm(w, axis=1)
    # w is float64 NumPy rounded to float32: its norms (over D = 8) and the
    # Gram of its directions (over D = 8) carry float32 rounding only.
    if scaling == "sqrt":
        assert_close(norms, np.full(40, np.sqrt(8)), n=8)
    else:
        assert np.std(norms) > 0.1  # random norms: chi(8) has sd 0.69, fixed norms 0
    directions = w / norms[:, None]
    gram = directions @ directions.T  # [m, m]
    off_block = np.abs(gram[:8, :8] - np.eye(8)).max()
    if kind == "orthogonal":
        for start in (0, 8, 16, 24, 32):  # 5 blocks of D rows, the last one full
            block = gram[start : start + 8, start : start + 8]
            assert_close(block, np.eye(8), n=8, what=f"block at {start}")
    else:
        # Not rounding: cosines of independent directions in 8 dims have sd 1/sqrt(8) = 0.35.
        assert off_block > 0.1


def test_chi_norms_match_gaussian_second_moment():
    rng = np.random.default_rng(1)
    w = random_features._gaussian_projection(rng, 4096, 16, "orthogonal", "chi")
    # rows of N(0, I_D): E|w|^2 = D, Var|w|^2 = 2D
    sq = np.sum(w.astype("float64") ** 2, axis=1)
    # Statistical: 4 standard errors of the mean of 4096 draws, sqrt(Var / N).
    assert abs(sq.mean() - 16) < 4 * np.sqrt(32 / 4096)


def test_projection_is_a_function_of_the_seed_and_redraw_follows_a_sequence():
    x = np.zeros((1, 2, 3, D), "float32")
    a, b, c = (FavorPlusFeatureMap(num_features=20, seed=s) for s in (5, 5, 6))
    for fm in (a, b, c):
        fm(x)
    np.testing.assert_array_equal(a.projection.numpy(), b.projection.numpy())
    assert not np.allclose(a.projection.numpy(), c.projection.numpy())
    initial = a.projection.numpy()
    a.redraw()
    b.redraw()
    np.testing.assert_array_equal(a.projection.numpy(), b.projection.numpy())
    assert not np.allclose(a.projection.numpy(), initial)
    a.redraw(seed=5)
    np.testing.assert_array_equal(a.projection.numpy(), initial)
    a.redraw(seed=6)
    np.testing.assert_array_equal(a.projection.numpy(), c.projection.numpy())
    assert not a.projection.trainable
    # one independent draw per head
    assert not np.allclose(initial[0], initial[1])


# ------------------------------------------------------------ numerics
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("is_query", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_favor_features_non_negative_and_finite_for_large_inputs(dtype, is_query, causal):
    rng = np.random.default_rng(4)
    x = rng.uniform(-10, 10, size=(2, 9, 2, D))
    x[0, 0] = 10.0  # the extremes themselves
    x[0, 1] = -10.0
    x[0, 2] = 0.0
    if dtype == "bfloat16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    x = keras.ops.convert_to_tensor(x, dtype=dtype)
    fm = FavorPlusFeatureMap(num_features=64, seed=1)
    f = fm(x, is_query=is_query, causal=causal)
    assert f.dtype == "float32"
    f = np.asarray(f)
    assert np.isfinite(f).all()
    assert (f >= 0).all()
    if is_query:  # the per-token max puts one feature of every query at exp(0)/sqrt(m)
        # elementwise only (a subtraction, exp, a division): n = 1
        assert_close(f.max(axis=-1), np.full(f.shape[:-1], 1 / 8), n=1)


def test_causal_key_cap_prevents_overflow_for_large_key_dims():
    # A key on a random direction's tip maximizes w.x' - |x'|^2/2 = |w|^2/2,
    # about D/2 = 128 here: exp would overflow float32 without the cap.
    dim = 256
    fm = FavorPlusFeatureMap(num_features=8, seed=0)
    fm.build((None, None, 1, dim))
    w = fm.projection.numpy()[0]  # [m, D]
    assert 0.5 * np.max(np.sum(w.astype("float64") ** 2, axis=1)) > 88.8  # log(float32 max)
    keys = (w[None, :, None, :] * dim**0.25).astype("float32")  # [1, m, 1, D]
    f = np.asarray(fm(keys, is_query=False, causal=True))
    assert np.isfinite(f).all()
    # the cap, then exp and a division, elementwise: n = 1
    assert_close(f.max(), np.exp(50.0) / np.sqrt(8), n=1)


def test_favor_attention_finite_in_a_bf16_model():
    keras.config.set_dtype_policy("mixed_bfloat16")
    rng = np.random.default_rng(5)
    x = rng.uniform(-10, 10, size=(2, 20, 8)).astype("float32")
    layer = LinearAttention(num_heads=2, key_dim=D, feature_map=FavorPlusFeatureMap(num_features=32, seed=2))
    for causal in (False, True):
        out = np.asarray(layer(x, x, use_causal_mask=causal)).astype("float32")
        assert np.isfinite(out).all()


# ------------------------------------------------------------ stabilizers
def _attn(qf, kf, v, causal):
    return np.asarray(lops.linear_attention(qf, kf, v, causal=causal, chunk_size=8))


@pytest.mark.parametrize("causal", [False, True])
def test_query_stabilizer_cancels(causal):
    q, k, v = _qkv(seed=6, scale=1.0, t=19)
    fm = FavorPlusFeatureMap(num_features=32, seed=3)
    kf = fm(k, is_query=False, causal=causal)
    stabilized = _attn(fm(q, is_query=True, causal=causal), kf, v, causal)
    raw = _attn(fm(q, is_query=False, causal=True), kf, v, causal)  # no shift
    assert_close(stabilized, raw, n=19 + 32, paths=2)  # S keys + C features; two float32 paths


def test_key_shift_cancels_only_when_it_is_one_constant_for_all_keys():
    q, k, v = _qkv(seed=7, scale=1.0, t=19)
    fm = FavorPlusFeatureMap(num_features=32, seed=3)
    qf = fm(q, is_query=True)
    raw_kf = np.asarray(fm(k, is_query=False, causal=True))  # [B, S, H, m], unshifted
    for causal in (False, True):
        reference = _attn(qf, raw_kf, v, causal)
        # the non-causal stabilizer (max over keys and features of each head)
        noncausal_kf = fm(k, is_query=False, causal=False)
        n = 19 + 32  # S keys + C features; two float32 paths
        if not causal:
            assert_close(_attn(qf, noncausal_kf, v, causal), reference, n=n, paths=2, what="stabilizer")
        # any single constant cancels
        assert_close(_attn(qf, raw_kf * np.exp(-7.0), v, causal), reference, n=n, paths=2, what="constant")
        # a per-token shift (each key's own max over features) does not: it
        # reweights the keys, an O(1) change of the outputs, not rounding
        per_token = raw_kf / raw_kf.max(axis=-1, keepdims=True)
        assert rel_err(_attn(qf, per_token, v, causal), reference) > 1e-2


# ------------------------------------------------------------ in LinearAttention
def _map(name):
    return feature_maps.get(name, num_features=12, seed=7)


@pytest.mark.parametrize("name", RANDOM_MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_layer_matches_oracle_outputs_and_gradients(rng, name, causal):
    x = tf.constant(rng.normal(size=(2, 21, 8)).astype("float32") * 0.5)
    fm = _map(name)
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=fm, conv_size=None, chunk_size=8)  # the map alone
    layer(x, x)
    # Gradients (the larger n): D_in = 8 input projection + D = 4 random
    # projection + S = 21 keys + C features + H*M = 8 output projection +
    # B*T = 42 positions sharing each weight. favor_trig's signed kernel: its
    # normalizer's conditioning on these inputs.
    n = 8 + 4 + 21 + fm.feature_dim(4) + 2 * 4 + 2 * 21
    conditioning = layer_conditioning(layer, x, x, causal=causal)
    assert_self_attention_matches_oracle(layer, x, causal, n=n, conditioning=conditioning)


@pytest.mark.parametrize("name", RANDOM_MAPS)
def test_causal_outputs_never_see_the_future(rng, name):
    x = rng.normal(size=(1, 24, 8)).astype("float32")
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=_map(name), chunk_size=8)
    if name == "favor_trig":
        # The x5 noise puts later favor_trig keys past the amplitude cap: eagerly that raises
        # (KernelUnderflowError); in a graph those later rows are NaN and the earlier ones untouched.
        layer = tf.function(layer, autograph=False)
    assert_causal_outputs_never_see_the_future(layer, x, rng, positions=(0, 5, 8, 17))


def test_future_leak_check_catches_a_max_over_time():
    # The same check applied to the non-causal key features (max over all
    # keys) used in causal attention: a constant over time cancels in exact
    # arithmetic, but its value depends on later keys, and so do the rounding
    # (and, for large shifts, the underflow) of earlier keys' features.
    q, k, v = _qkv(seed=8, scale=1.0, t=16)
    fm = FavorPlusFeatureMap(num_features=16, seed=0)
    qf = fm(q, is_query=True)
    base = _attn(qf, fm(k, is_query=False, causal=False), v, True)
    k2 = k.copy()
    # later keys on a random direction's tip: the largest possible exponent
    k2[:, 10:] = fm.projection.numpy()[:, 0] * D**0.25  # [H, D] broadcast over time
    leaked = _attn(qf, fm(k2, is_query=False, causal=False), v, True)
    assert not np.array_equal(leaked[:, :10], base[:, :10])
    safe = _attn(qf, fm(k, is_query=False, causal=True), v, True)
    safe2 = _attn(qf, fm(k2, is_query=False, causal=True), v, True)
    np.testing.assert_array_equal(safe2[:, :10], safe[:, :10])


def test_step_decoding_matches_parallel_causal(rng):
    x = rng.normal(size=(2, 11, 8)).astype("float32")
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=_map("favor+"), chunk_size=4)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    steps, _ = run_steps(layer, x, self_attention=True)
    # D_in = 8 + D = 4 + S = 11 keys + C = 12 features + H*M = 8; step vs parallel, both float32
    assert_close(steps, full, n=8 + 4 + 11 + 12 + 2 * 4, paths=2)


@pytest.mark.parametrize("name", RANDOM_MAPS)
def test_fit_with_xla(rng, name):
    assert_fits_with_xla(causal_attention_model(_map(name)), rng)


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (FavorPlusFeatureMap, dict(num_features=24, kind="iid", scaling="sqrt", scale=0.3, seed=None)),
        (FavorTrigFeatureMap, dict(num_features=10, kind="orthogonal", scaling="sqrt", scale=0.4, seed=9)),
    ],
)
def test_keras_save_load_keeps_the_projection(tmp_path, rng, cls, kwargs):
    x = rng.normal(size=(2, 16, 8)).astype("float32")
    fm = cls(**kwargs)
    model = causal_attention_model(fm)
    fm.redraw()  # the saved matrix is not the one the seed gives
    expected = model.predict(x, verbose=0)
    loaded = save_and_load(model, tmp_path)
    loaded_fm = loaded.layers[1].feature_map
    assert isinstance(loaded_fm, cls)
    for key, value in kwargs.items():
        assert getattr(loaded_fm, key) == value
    np.testing.assert_array_equal(loaded_fm.projection.numpy(), fm.projection.numpy())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)


@pytest.mark.parametrize("name", RANDOM_MAPS)
def test_get_config_round_trip(name):
    fm = feature_maps.get(name, num_features=7, kind="iid", scaling="sqrt", scale=0.5, seed=3)
    clone = feature_maps.deserialize(feature_maps.serialize(fm))
    assert type(clone) is type(fm)
    assert clone.get_config() == fm.get_config()
    x = np.random.default_rng(0).normal(size=(1, 3, 2, 4)).astype("float32")
    np.testing.assert_array_equal(np.asarray(clone(x)), np.asarray(fm(x)))


def test_inference_is_deterministic(rng):
    x = rng.normal(size=(2, 16, 8)).astype("float32")
    model = causal_attention_model(_map("favor+"))
    a = model(x, training=True)
    b = model(x, training=False)
    np.testing.assert_array_equal(model.predict(x, verbose=0), model.predict(x, verbose=0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ favor_trig
def test_trig_estimate_is_unbiased_but_not_positive():
    q, k, exact = _one_query_and_key(seed=9)
    fm = FavorTrigFeatureMap(num_features=64, seed=0)
    fm.build(q.shape)
    estimates, negative_features = [], 0
    for s in range(300):
        fm.redraw(seed=s)
        fq = np.asarray(fm(q, is_query=True))
        fk = np.asarray(fm(k, is_query=False, causal=True))
        negative_features += int((fq < 0).sum())
        # the query's norm factor is left out (it cancels): put it back
        estimates.append(float(np.sum(fq * fk)) * np.exp(np.sum((q / 2) ** 2) / 2))
    _assert_unbiased(estimates, exact)
    assert negative_features > 0


def test_trig_key_stabilizer_cancels_non_causal():
    q, k, v = _qkv(seed=10, scale=0.5, t=13)
    fm = FavorTrigFeatureMap(num_features=32, seed=3)
    qf = fm(q, is_query=True)
    raw_kf = fm(k, is_query=False, causal=True)
    stabilized = _attn(qf, fm(k, is_query=False, causal=False), v, False)
    raw = _attn(qf, raw_kf, v, False)
    # S = 13 keys + C = 64 features; two float32 paths; a signed kernel: its normalizer's conditioning
    assert_close(stabilized, raw, n=13 + 64, paths=2, conditioning=normalizer_conditioning(qf, raw_kf))


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize("cls", [FavorPlusFeatureMap, FavorTrigFeatureMap])
@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(num_features=0), "num_features"),
        (dict(num_features=-3), "num_features"),
        (dict(num_features=2.5), "num_features"),
        (dict(kind="gaussian"), "kind"),
        (dict(scaling="unit"), "scaling"),
        (dict(scale=-1.0), "scale"),
        (dict(scale=0), "scale"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_arguments(cls, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        cls(**kwargs)


@pytest.mark.parametrize("cls", [FavorPlusFeatureMap, FavorTrigFeatureMap])
def test_bad_input_rank_and_shape(cls):
    assert_rejects_bad_input_rank_and_shape(cls(num_features=8, seed=0), other_shape=(1, 3, 2, 5))


def test_redraw_before_build_and_bad_seed():
    fm = FavorPlusFeatureMap(num_features=8)
    with pytest.raises(ValueError, match="built"):
        fm.redraw()
    fm(np.zeros((1, 3, 2, 4), "float32"))
    with pytest.raises(ValueError, match="seed"):
        fm.redraw(seed=-2)


def test_onnx_export_uses_the_current_projection(tmp_path, rng):
    import onnxruntime  # noqa: F401  (a hard dependency: OnnxPredictor runs on it)

    from keras_linattn.export import OnnxPredictor, export_onnx

    fm = FavorPlusFeatureMap(num_features=12, seed=1)
    model = causal_attention_model(fm)
    fm.redraw()
    x = rng.normal(size=(2, 16, 8)).astype("float32")
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / "m.onnx")
    export_onnx(model, path)
    got = list(OnnxPredictor(path, device="cpu")(x).values())[0]
    # D_in = 8 + D = 4 + S = 16 keys + C = 12 features + H*M = 8 + Dense over 8; ONNX vs Keras, both float32
    assert_close(got, expected, n=8 + 4 + 16 + 12 + 2 * 4 + 8, paths=2)
