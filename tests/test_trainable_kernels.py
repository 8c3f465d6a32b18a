"""Trainable feedforward kernels (ffn, glu, oglu, aoglu; Yorsh & Kovalenko 2022)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.layers import LinearAttention
from tests.conftest import rel_err

# (registry name, non-default constructor arguments): every map, every
# hidden activation, depths 1-3, shared and separate q/k kernels.
CASES = [
    ("ffn", dict(depth=1)),
    ("ffn", dict(depth=3, feature_dim=6, hidden_activation="gelu", share_qk=False)),
    ("glu", dict(depth=2, hidden_activation="relu", share_qk=False)),
    ("oglu", dict(depth=2, feature_dim=12, hidden_activation="tanh")),
    ("aoglu", dict(depth=3, feature_dim=12, rank=2, hidden_activation="gelu", share_qk=False)),
    ("aoglu", dict(depth=2, feature_dim=12, rank=2)),
]
CASE_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]
MAP_NAMES = ["ffn", "glu", "oglu", "aoglu"]


def _np_softplus(x):
    return np.logaddexp(0.0, x)


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


NP_ACT = {"sigmoid": _np_sigmoid, "relu": lambda x: np.maximum(x, 0.0), "tanh": np.tanh, "gelu": _np_gelu_tanh}


def _np_headwise(x, w):
    return np.einsum("bthd,hdc->bthc", x, w)  # [B, T, H, C]


def _np_reference(fm, x, is_query):
    """The documented formula, in float64 numpy, from the map's weights."""
    branch = "qk" if fm.share_qk else ("query" if is_query else "key")
    weights = {w.path.split("/")[-1]: np.asarray(w, np.float64) for w in fm.weights}
    act = NP_ACT[fm.hidden_activation]
    h = np.asarray(x, np.float64)
    for i in range(fm.depth):
        last = i == fm.depth - 1
        f = act if not last else _np_softplus
        if isinstance(fm, feature_maps.FFNFeatureMap):
            h = f(_np_headwise(h, weights[f"{branch}_kernel_{i}"]))
            continue
        if f"{branch}_gate_{i}" in weights:
            gate = _np_headwise(h, weights[f"{branch}_gate_{i}"])
        else:
            wg = np.einsum("hdr,hrc->hdc", weights[f"{branch}_gate_a_{i}"], weights[f"{branch}_gate_b_{i}"])
            gate = _np_headwise(h, wg)
        h = f(_np_headwise(h, weights[f"{branch}_filter_{i}"])) * _np_sigmoid(gate)
    return h


@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_map_computes_the_documented_formula(rng, name, kwargs):
    fm = feature_maps.get(name, seed=3, **kwargs)
    x = rng.normal(size=(2, 5, 2, 4)).astype("float32") * 2
    for is_query in (True, False):
        got = fm(x, is_query=is_query)
        assert got.shape == (2, 5, 2, fm.feature_dim(4))
        assert rel_err(got, _np_reference(fm, x, is_query)) <= 1e-5


def _grads_through(fm, attention, xq, xk, v, w, causal):
    with tf.GradientTape() as tape:
        qf = fm(xq, is_query=True)  # [B, T, H, C]
        kf = fm(xk, is_query=False)  # [B, S, H, C]
        out = attention(qf, kf, v, causal)  # [B, T, H, M]
        loss = tf.reduce_sum(out * w)
    return out, tape.gradient(loss, fm.trainable_weights)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_linear_attention_matches_oracle_outputs_and_map_gradients(rng, name, kwargs, causal):
    b, t, h, d, m = 2, 7, 2, 4, 3  # T=7 is not a multiple of chunk_size=3
    fm = feature_maps.get(name, seed=11, **kwargs)
    xq = tf.constant(rng.normal(size=(b, t, h, d)).astype("float32"))
    xk = tf.constant(rng.normal(size=(b, t, h, d)).astype("float32"))
    v = tf.constant(rng.normal(size=(b, t, h, m)).astype("float32"))
    w = tf.constant(rng.normal(size=(b, t, h, m)).astype("float32"))

    def fast(qf, kf, v, causal):
        return lops.linear_attention(qf, kf, v, causal=causal, chunk_size=3)

    def oracle(qf, kf, v, causal):
        return lops.kernel_attention_reference(qf, kf, v, causal=causal)

    out_fast, g_fast = _grads_through(fm, fast, xq, xk, v, w, causal)
    out_ref, g_ref = _grads_through(fm, oracle, xq, xk, v, w, causal)
    assert rel_err(out_fast, out_ref) <= 1e-5
    assert len(g_fast) == len(fm.trainable_weights) > 0
    # The gradient w.r.t. all the map's weights, as one vector.
    flat_fast = np.concatenate([np.ravel(g) for g in g_fast])
    flat_ref = np.concatenate([np.ravel(g) for g in g_ref])
    assert rel_err(flat_fast, flat_ref) <= 1e-5
    # Per weight too (measured up to 5.1e-6 on these cases). The first units of
    # a 3-unit stack with sigmoid hidden activations get gradients ~100x
    # smaller than the last; there float32 cancellation gave up to 8.6e-5 per
    # weight (7.1e-6 for the whole gradient), so that case is not listed here.
    for var, gf, gr in zip(fm.trainable_weights, g_fast, g_ref):
        assert np.abs(np.asarray(gr)).max() > 0, var.path
        assert rel_err(gf, gr) <= 1e-5, var.path


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_layer_with_trainable_map_equals_composed_oracle(rng, name, causal):
    layer = LinearAttention(
        num_heads=2, key_dim=4, value_dim=3, chunk_size=4, feature_map=feature_maps.get(name, share_qk=False)
    )
    x = rng.normal(size=(2, 9, 8)).astype("float32")
    out = layer(x, x, use_causal_mask=causal)
    q, k, v = layer.project(x, x)
    qf = layer.feature_map(q, is_query=True)  # [B, T, H, C]
    kf = layer.feature_map(k, is_query=False)  # [B, T, H, C]
    want = layer.output_dense(lops.kernel_attention_reference(qf, kf, v, causal=causal))
    assert rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("name", MAP_NAMES)
def test_share_qk_selects_one_or_two_kernels(rng, name):
    x = rng.normal(size=(1, 4, 2, 4)).astype("float32")
    shared = feature_maps.get(name, share_qk=True)
    np.testing.assert_array_equal(shared(x, is_query=True), shared(x, is_query=False))
    split = feature_maps.get(name, share_qk=False)
    split.build(x.shape)
    assert split.count_params() == 2 * shared.count_params()
    assert np.abs(np.asarray(split(x, is_query=True)) - np.asarray(split(x, is_query=False))).max() > 1e-3
    # The key features depend on the key kernel only.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(split(x, is_query=False))
    grads = tape.gradient(loss, split.trainable_weights)
    for var, g in zip(split.trainable_weights, grads):
        assert (g is not None) == var.path.split("/")[-1].startswith("key_"), var.path


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("name,kwargs", CASES, ids=CASE_IDS)
def test_features_positive_and_finite_for_large_inputs(rng, name, kwargs, dtype):
    x = rng.uniform(-10.0, 10.0, size=(2, 16, 2, 8)).astype("float32")
    x[0, 0] = 10.0
    x[0, 1] = -10.0
    x[0, 2, :, ::2] = -10.0
    x[0, 2, :, 1::2] = 10.0
    fm = feature_maps.get(name, dtype=dtype, seed=5, **kwargs)
    out = fm(x, is_query=False)
    assert out.dtype == ("bfloat16" if dtype == "mixed_bfloat16" else "float32")
    out = np.asarray(tf.cast(out, "float32"))
    assert np.isfinite(out).all()
    assert (out > 0).all(), out.min()


def test_maps_stay_float32_under_global_mixed_policy(rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    for name in MAP_NAMES:
        fm = feature_maps.get(name)
        assert fm.compute_dtype == "float32"
        out = fm(tf.constant(rng.uniform(-10, 10, size=(1, 3, 2, 8)), dtype="bfloat16"))
        assert out.dtype == "float32"
        assert all(w.dtype == "float32" for w in fm.weights)
        assert (np.asarray(out) > 0).all()


# oglu runs only with --runslow: its code paths are those of glu (full gate) and
# aoglu (orthogonal filters), and each XLA compile costs ~15 s on a 2-core CPU.
@pytest.mark.parametrize("name", ["ffn", "glu", pytest.param("oglu", marks=pytest.mark.slow), "aoglu"])
def test_fit_with_xla(rng, name):
    keras.utils.set_random_seed(0)
    fm = feature_maps.get(name, depth=2, share_qk=False)
    inputs = keras.Input((12, 8))
    h = LinearAttention(num_heads=2, key_dim=4, chunk_size=4, feature_map=fm)(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    before = [np.asarray(w) for w in fm.trainable_weights]
    x = rng.normal(size=(16, 12, 8)).astype("float32")
    y = x.mean(axis=(1, 2))[:, None]
    hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    for b, w in zip(before, fm.trainable_weights):
        assert np.abs(np.asarray(w) - b).max() > 0, w.path


NON_DEFAULT = {
    "ffn": dict(
        depth=2,
        feature_dim=6,
        hidden_activation="tanh",
        share_qk=False,
        kernel_initializer=keras.initializers.Orthogonal(gain=0.5),
        orthogonal_penalty=0.1,
        seed=7,
    ),
    "glu": dict(
        depth=3, feature_dim=5, hidden_activation="gelu", share_qk=False, kernel_initializer="he_normal", seed=2
    ),
    "oglu": dict(depth=2, feature_dim=10, hidden_activation="relu", share_qk=False, orthogonal_penalty=0.5,
                 gate_initializer="lecun_normal", seed=4),
    "aoglu": dict(depth=2, feature_dim=12, hidden_activation="gelu", share_qk=False, rank=5, orthogonal_penalty=0.2,
                  gate_initializer="he_uniform", seed=9),
}


@pytest.mark.parametrize("name", MAP_NAMES)
def test_keras_save_load_with_non_default_arguments(rng, tmp_path, name):
    fm = feature_maps.get(name, **NON_DEFAULT[name])
    inputs = keras.Input((6, 8))
    out = LinearAttention(num_heads=2, key_dim=4, feature_map=fm)(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, out)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    want = np.asarray(model(x))
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(x)), want)
    fm2 = loaded.layers[1].feature_map
    assert type(fm2) is type(fm)
    assert fm2.get_config() == fm.get_config()
    for key, value in NON_DEFAULT[name].items():
        got = getattr(fm2, "feature_dim_" if key == "feature_dim" else key)
        if isinstance(got, keras.initializers.Initializer):
            assert got.get_config() == keras.initializers.get(value).get_config()
        else:
            assert got == value, key
    assert len(loaded.losses) == len(model.losses) == (0 if name == "glu" else 2 * 2)
    for got, want_loss in zip(loaded.losses, model.losses):
        assert rel_err(got, want_loss) <= 1e-6
    again = feature_maps.deserialize(feature_maps.serialize(fm))
    assert again.get_config() == fm.get_config()


def _gram_dev(w):
    """max |G - I| per head, G the smaller Gram matrix of w [H, n_in, n_out]."""
    w = np.asarray(w, np.float64)
    gram = w @ np.swapaxes(w, 1, 2) if w.shape[1] <= w.shape[2] else np.swapaxes(w, 1, 2) @ w
    return np.abs(gram - np.eye(gram.shape[-1])).max()


@pytest.mark.parametrize("d,c", [(4, 6), (6, 4), (5, 5)])
def test_orthogonal_init_is_per_head_and_heads_differ(d, c):
    h = 3
    ffn = feature_maps.get("ffn", depth=2, feature_dim=c, share_qk=False, seed=1)
    ffn.build((None, None, h, d))
    oglu = feature_maps.get("oglu", depth=2, feature_dim=c, seed=1)
    oglu.build((None, None, h, d))
    aoglu = feature_maps.get("aoglu", feature_dim=c, rank=1)
    aoglu.build((None, None, h, d))
    kernels = list(ffn.weights) + [w for fm in (oglu, aoglu) for w in fm.weights if "filter" in w.path]
    assert len(kernels) == 4 + 2 + 1
    for w in kernels:
        assert _gram_dev(w) <= 1e-5, w.path
        arr = np.asarray(w)
        for i in range(h):
            for j in range(i):
                assert np.abs(arr[i] - arr[j]).max() > 0.1, w.path
    # Query and key kernels are different matrices too.
    assert np.abs(np.asarray(ffn.weights[0]) - np.asarray(ffn.weights[2])).max() > 0.1


def test_seeds_reproduce_and_unseeded_maps_differ():
    def weights(**kwargs):
        fm = feature_maps.get("oglu", **kwargs)
        fm.build((None, None, 2, 4))
        return [np.asarray(w) for w in fm.weights]

    for a, b in zip(weights(seed=3), weights(seed=3)):
        np.testing.assert_array_equal(a, b)
    assert np.abs(weights(seed=3)[0] - weights(seed=4)[0]).max() > 0.1
    assert np.abs(weights()[0] - weights()[0]).max() > 0.1


def _np_penalty(w, factor):
    w = np.asarray(w, np.float64)
    gram = w @ np.swapaxes(w, 1, 2) if w.shape[1] <= w.shape[2] else np.swapaxes(w, 1, 2) @ w
    return factor * np.sum((gram - np.eye(gram.shape[-1])) ** 2)


@pytest.mark.parametrize(
    "name,kwargs,factor",
    [
        ("ffn", dict(depth=2, orthogonal_penalty=0.3, share_qk=False), 0.3),
        ("oglu", dict(depth=2, feature_dim=6, orthogonal_penalty=0.2), 0.2),
        ("aoglu", dict(feature_dim=8, rank=2), 0.01),
    ],
)
def test_orthogonal_penalty_appears_in_model_losses(rng, name, kwargs, factor):
    fm = feature_maps.get(name, **kwargs)
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, LinearAttention(num_heads=2, key_dim=4, feature_map=fm)(inputs, inputs))
    penalized = [w for w in fm.weights if "kernel" in w.path or "filter" in w.path]
    for w in fm.weights:  # move away from the orthogonal init: a non-zero penalty
        w.assign(rng.normal(size=w.shape).astype("float32"))
    want = sum(_np_penalty(w, factor) for w in penalized)
    assert want > 1.0
    assert len(model.losses) == len(penalized)
    assert rel_err(sum(np.asarray(loss) for loss in model.losses), want) <= 1e-5


def test_no_penalty_no_losses():
    for fm in (feature_maps.get("ffn"), feature_maps.get("glu"), feature_maps.get("oglu", orthogonal_penalty=0.0)):
        fm.build((None, None, 2, 4))
        assert fm.losses == []


@pytest.mark.parametrize("share_qk", [True, False])
@pytest.mark.parametrize("h,d,c,k", [(1, 8, 8, 1), (2, 4, 8, 2), (3, 8, 4, 3)])
def test_parameter_counts_follow_the_formulas(h, d, c, k, share_qk):
    copies = 1 if share_qk else 2
    r = max(1, c // 4)
    want = {
        "ffn": h * (d * c + (k - 1) * c * c),
        "glu": h * (2 * d * c + (k - 1) * 2 * c * c),
        "oglu": h * (2 * d * c + (k - 1) * 2 * c * c),
        "aoglu": h * ((d * c + d * r + r * c) + (k - 1) * (c * c + 2 * c * r)),
    }
    for name, count in want.items():
        fm = feature_maps.get(name, depth=k, feature_dim=c, share_qk=share_qk)
        fm.build((None, None, h, d))
        assert fm.count_params() == copies * count, name


def test_aoglu_saves_a_quarter_of_oglu_parameters():
    # n = 16, r = n/4 = 4: OGLU 2 n^2 = 512 per unit per head, AOGLU n^2 + 2 n r = 384.
    oglu = feature_maps.get("oglu")
    oglu.build((None, None, 1, 16))
    aoglu = feature_maps.get("aoglu")
    aoglu.build((None, None, 1, 16))
    assert oglu.count_params() == 512
    assert aoglu.count_params() == 384
    assert aoglu.count_params() == 0.75 * oglu.count_params()
    gates = {w.path.split("/")[-1]: tuple(w.shape) for w in aoglu.weights}
    assert gates == {"qk_filter_0": (1, 16, 16), "qk_gate_a_0": (1, 16, 4), "qk_gate_b_0": (1, 4, 16)}


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("ffn", dict(hidden_activation="swish"), "hidden_activation"),
        ("glu", dict(hidden_activation="softmax"), "hidden_activation"),
        ("aoglu", dict(hidden_activation=None), "hidden_activation"),
        ("ffn", dict(depth=0), "depth"),
        ("ffn", dict(depth=4), "depth"),
        ("glu", dict(depth=4), "depth"),
        ("oglu", dict(depth=0), "depth"),
        ("aoglu", dict(depth=2.0), "depth"),
        ("ffn", dict(feature_dim=0), "feature_dim"),
        ("glu", dict(feature_dim=-3), "feature_dim"),
        ("oglu", dict(feature_dim=4.5), "feature_dim"),
        ("ffn", dict(orthogonal_penalty=-0.1), "orthogonal_penalty"),
        ("oglu", dict(orthogonal_penalty=-1.0), "orthogonal_penalty"),
        ("aoglu", dict(orthogonal_penalty=float("nan")), "orthogonal_penalty"),
        ("aoglu", dict(feature_dim=16, rank=8), "rank"),
        ("aoglu", dict(feature_dim=16, rank=0), "rank"),
        ("aoglu", dict(feature_dim=16, rank=2.0), "rank"),
        ("glu", dict(share_qk="yes"), "share_qk"),
        ("ffn", dict(seed=-1), "seed"),
    ],
)
def test_constructors_reject_bad_arguments(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        feature_maps.get(name, **kwargs)


def test_aoglu_rank_checked_at_build_when_width_comes_from_input():
    fm = feature_maps.get("aoglu", rank=4)  # width n = D, known at build only
    with pytest.raises(ValueError, match="rank"):
        fm.build((None, None, 2, 8))  # 4 >= 8 / 2
    fm = feature_maps.get("aoglu")  # default r = max(1, n // 4) = 1 is not < 2 / 2
    with pytest.raises(ValueError, match="rank"):
        fm.build((None, None, 2, 2))
    fm = feature_maps.get("aoglu", rank=3)
    fm.build((None, None, 2, 8))
    assert fm.count_params() == 2 * (8 * 8 + 2 * 8 * 3)


def test_rebuild_keeps_weights_and_checks_the_shape():
    fm = feature_maps.get("glu")
    fm.build((None, None, 2, 4))
    before = [np.asarray(w) for w in fm.weights]
    fm.build((None, None, 2, 4))  # as when a deserialized map is built again by its layer
    assert len(fm.weights) == len(before)
    for a, w in zip(before, fm.weights):
        np.testing.assert_array_equal(a, np.asarray(w))
    with pytest.raises(ValueError, match="input_shape"):
        fm.build((None, None, 3, 4))
