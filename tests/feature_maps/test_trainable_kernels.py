"""Trainable feedforward kernels (ffn, glu, oglu, aoglu; Yorsh & Kovalenko 2022)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.layers import LinearAttention
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

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


def _map_reduction_length(fm, d):
    """Reduction length of the map on inputs of dim ``d``: each unit reduces over
    its input width (D for the first, C after); a low-rank gate (aoglu) adds its
    rank r on the longest path (x -> x A over the width -> (x A) B over r)."""
    c = fm.feature_dim(d)
    rank = fm.gate_rank(c) if hasattr(fm, "gate_rank") else None
    return sum((d if i == 0 else c) + (rank or 0) for i in range(fm.depth))


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
    d = 4
    x = rng.normal(size=(2, 5, 2, d)).astype("float32") * 2
    for is_query in (True, False):
        got = fm(x, is_query=is_query)
        assert got.shape == (2, 5, 2, fm.feature_dim(d))
        # n: the map's unit widths (+ gate ranks); float64 NumPy oracle.
        assert_close(got, _np_reference(fm, x, is_query), n=_map_reduction_length(fm, d), what=f"{is_query=}")


def _grads_through(fm, attention, xq, xk, v, w, causal):
    """Outputs, and the gradients of ``sum(out * w)`` w.r.t. the map's weights
    and w.r.t. the query and key features, in the map's compute dtype."""
    xq, xk, v, w = (tf.cast(x, fm.compute_dtype) for x in (xq, xk, v, w))
    with tf.GradientTape() as tape:
        qf = fm(xq, is_query=True)  # [B, T, H, C]
        kf = fm(xk, is_query=False)  # [B, S, H, C]
        out = attention(qf, kf, v, causal)  # [B, T, H, M]
        loss = tf.reduce_sum(out * w)
    grads = tape.gradient(loss, list(fm.trainable_weights) + [qf, kf])
    return out, grads[:-2], grads[-2:]


def _gradient_terms_scale(fm, xq, xk, feature_grads):
    """The map's weight gradient is a sum of one term per position (B*T queries
    and B*S keys): ``max`` over its entries of ``sum |term|``, with the
    features' gradients ``feature_grads`` (of the oracle). Where the terms
    cancel, the gradient's rounding error is relative to this scale, not to
    the gradient's own (the condition number of a sum)."""
    total = 0.0
    for x, cotangent, is_query in ((xq, feature_grads[0], True), (xk, feature_grads[1], False)):
        x = tf.cast(x, fm.compute_dtype)
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                with tf.GradientTape() as tape:
                    features = fm(x[i : i + 1, j : j + 1], is_query=is_query)  # one position
                    term = tf.reduce_sum(features * cotangent[i : i + 1, j : j + 1])
                g = tape.gradient(term, fm.trainable_weights)  # None for the other branch's weights
                g = [
                    np.zeros(wt.shape) if gw is None else np.asarray(gw)
                    for wt, gw in zip(fm.trainable_weights, g, strict=True)
                ]
                total = total + np.abs(np.concatenate([np.ravel(gw) for gw in g]))
    return float(np.max(total))


def _float64_copy(fm, name, kwargs, input_shape):
    """The same map in float64, with ``fm``'s weights: the oracle's map."""
    fm64 = feature_maps.get(name, dtype="float64", **kwargs)
    fm64.build(input_shape)
    assert [w.path.split("/")[-1] for w in fm64.weights] == [w.path.split("/")[-1] for w in fm.weights]
    for w64, w in zip(fm64.weights, fm.weights, strict=True):
        w64.assign(np.asarray(w, np.float64))
    return fm64


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

    out_fast, g_fast, _ = _grads_through(fm, fast, xq, xk, v, w, causal)
    # The oracle runs the map (forward and backward) in float64 too: with the
    # float32 map its own gradient error is as large as the fast path's.
    fm64 = _float64_copy(fm, name, dict(kwargs, seed=11), xq.shape)
    out_ref, g_ref, feature_grads = _grads_through(fm64, oracle, xq, xk, v, w, causal)
    c = fm.feature_dim(d)
    n_out = _map_reduction_length(fm, d) + t + c  # map widths + S keys (S = T) + C features
    assert_close(out_fast, out_ref, n=n_out, what="outputs")
    assert len(g_fast) == len(fm.trainable_weights) > 0
    # A weight's gradient sums over the positions that use it: B*T queries
    # and B*S keys for a shared kernel, B*T (or B*S) for a separate one.
    n_grad = n_out + (2 * b * t if fm.share_qk else b * t)
    # The gradient w.r.t. all the map's weights, as one vector. Conditioning:
    # its per-position terms partly cancel (by up to ~15x on shared kernels).
    flat_fast = np.concatenate([np.ravel(g) for g in g_fast])
    flat_ref = np.concatenate([np.ravel(g) for g in g_ref])
    whole = float(np.abs(flat_ref).max())
    terms = max(whole, _gradient_terms_scale(fm64, xq, xk, feature_grads))
    assert_close(flat_fast, flat_ref, n=n_grad, conditioning=terms / whole, what="all map gradients")
    # Per weight, conditioned by the ratio of the whole gradient's scale (of
    # its terms) to the weight's: each weight's absolute error is inherited
    # from the whole backward pass, and the first units of a deep stack get
    # gradients ~100x smaller than the last ones.
    for var, gf, gr in zip(fm.trainable_weights, g_fast, g_ref, strict=True):
        scale = np.abs(np.asarray(gr)).max()
        assert scale > 0, var.path
        assert_close(gf, gr, n=n_grad, conditioning=terms / scale, what=var.path)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_layer_with_trainable_map_equals_composed_oracle(rng, name, causal):
    h, d, m, t, dim = 2, 4, 3, 9, 8
    fm = feature_maps.get(name, share_qk=False)
    layer = LinearAttention(
        num_heads=h,
        key_dim=d,
        value_dim=m,
        chunk_size=4,
        feature_map=fm,
        conv_size=None,  # the composed oracle starts from `project`, which stops before the convolution
    )
    x = rng.normal(size=(2, t, dim)).astype("float32")
    out = layer(x, x, use_causal_mask=causal)
    q, k, v = layer.project(x, x)
    qf = layer.feature_map(q, is_query=True)  # [B, T, H, C]
    kf = layer.feature_map(k, is_query=False)  # [B, T, H, C]
    want = layer.output_dense(lops.kernel_attention_reference(qf, kf, v, causal=causal))  # float64 attention
    # D_in input projection + map widths + S keys + C features + H*M output projection
    n = dim + _map_reduction_length(fm, d) + t + fm.feature_dim(d) + h * m
    assert_close(out, want, n=n)


@pytest.mark.parametrize("name", MAP_NAMES)
def test_share_qk_selects_one_or_two_kernels(rng, name):
    x = rng.normal(size=(1, 4, 2, 4)).astype("float32")
    shared = feature_maps.get(name, share_qk=True)
    np.testing.assert_array_equal(shared(x, is_query=True), shared(x, is_query=False))
    split = feature_maps.get(name, share_qk=False)
    split.build(x.shape)
    assert split.count_params() == 2 * shared.count_params()
    # Not a rounding bound: two independently initialized kernels give O(0.1-1) different features.
    assert np.abs(np.asarray(split(x, is_query=True)) - np.asarray(split(x, is_query=False))).max() > 1e-3
    # The key features depend on the key kernel only.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(split(x, is_query=False))
    grads = tape.gradient(loss, split.trainable_weights)
    for var, g in zip(split.trainable_weights, grads, strict=True):
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
# aoglu (orthogonal filters), and each XLA compile is the costliest step of these tests.
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
    for b, w in zip(before, fm.trainable_weights, strict=True):
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
    "oglu": dict(
        depth=2,
        feature_dim=10,
        hidden_activation="relu",
        share_qk=False,
        orthogonal_penalty=0.5,
        gate_initializer="lecun_normal",
        seed=4,
    ),
    "aoglu": dict(
        depth=2,
        feature_dim=12,
        hidden_activation="gelu",
        share_qk=False,
        rank=5,
        orthogonal_penalty=0.2,
        gate_initializer="he_uniform",
        seed=9,
    ),
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
        got = fm2.feature_dim(4) if key == "feature_dim" else getattr(fm2, key)
        if isinstance(got, keras.initializers.Initializer):
            assert got.get_config() == keras.initializers.get(value).get_config()
        else:
            assert got == value, key
    assert len(loaded.losses) == len(model.losses) == (0 if name == "glu" else 2 * 2)
    penalized = [] if name == "glu" else [w for w in fm.weights if "kernel" in w.path or "filter" in w.path]
    assert len(penalized) == len(model.losses)
    for got, want_loss, w in zip(loaded.losses, model.losses, penalized, strict=True):
        # the same penalty computed twice (loaded vs original), in float32
        assert_close(got, want_loss, n=_penalty_reduction_length(w), paths=2, what=w.path)
    again = feature_maps.deserialize(feature_maps.serialize(fm))
    assert again.get_config() == fm.get_config()


def _gram(w):
    """The smaller Gram matrix per head of w [H, n_in, n_out], in float64."""
    w = np.asarray(w, np.float64)
    return w @ np.swapaxes(w, 1, 2) if w.shape[1] <= w.shape[2] else np.swapaxes(w, 1, 2) @ w


def _penalty_reduction_length(w):
    """``sum_h ||G_h - I||^2`` of w [H, a, b]: the Gram reduces over max(a, b),
    then the sum runs over the H * min(a, b)^2 entries."""
    h, a, b = w.shape
    return max(a, b) + h * min(a, b) ** 2


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
        gram = _gram(w)
        _, a, b = w.shape
        # Float32 QR of an [max, min] Gaussian (min(a, b) reflections of length
        # max(a, b), in sequence) rounded to float32, then the Gram over max(a, b).
        assert_close(gram, np.broadcast_to(np.eye(gram.shape[-1]), gram.shape), n=a * b + max(a, b), what=w.path)
        arr = np.asarray(w)
        for i in range(h):
            for j in range(i):
                # Not a rounding bound: independent draws differ by O(1).
                assert np.abs(arr[i] - arr[j]).max() > 0.1, w.path
    # Query and key kernels are different matrices too.
    assert np.abs(np.asarray(ffn.weights[0]) - np.asarray(ffn.weights[2])).max() > 0.1


def test_seeds_reproduce_and_unseeded_maps_differ():
    def weights(**kwargs):
        fm = feature_maps.get("oglu", **kwargs)
        fm.build((None, None, 2, 4))
        return [np.asarray(w) for w in fm.weights]

    for a, b in zip(weights(seed=3), weights(seed=3), strict=True):
        np.testing.assert_array_equal(a, b)
    # Not rounding bounds: different draws differ by O(1).
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
    # the largest penalty's reductions + the float32 sum of the losses
    n = max(_penalty_reduction_length(w) for w in penalized) + len(penalized)
    assert_close(sum(np.asarray(loss) for loss in model.losses), want, n=n)


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
    for a, w in zip(before, fm.weights, strict=True):
        np.testing.assert_array_equal(a, np.asarray(w))
    with pytest.raises(ValueError, match="input_shape"):
        fm.build((None, None, 3, 4))


@pytest.mark.numeric
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_headwise_matmul_at_one_token_matches_the_einsum_values_and_gradients(batch):
    """The one-token form (constant reshapes around a batched product) against the einsum it stands for."""
    from keras_linattn.feature_maps import _trainable

    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(batch, 1, 4, 16)).astype("float32"))  # [B, 1, H, D]
    w = tf.constant(rng.normal(size=(4, 16, 8)).astype("float32"))  # [H, D, C]
    up = tf.constant(rng.normal(size=(batch, 1, 4, 8)).astype("float32"))

    def run(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = fn(x, w)
            loss = tf.reduce_sum(y * up)
        return [y] + tape.gradient(loss, [x, w])

    fast = run(tf.function(_trainable.headwise_matmul))  # traced: the batch is unknown there, as in a step
    plain = run(lambda a, b: tf.einsum("bthd,hdc->bthc", a, b))
    # Sums of D = 16 (outputs), C = 8 (d/dx) and B (d/dw) products.
    for name, a, b, n in zip(["outputs", "d/dx", "d/dw"], fast, plain, [16, 8, max(batch, 1)], strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert_close(a.numpy(), b.numpy(), n=n, what=name)
    graph = (
        tf.function(_trainable.headwise_matmul)
        .get_concrete_function(tf.TensorSpec((None, 1, 4, 16)), tf.TensorSpec((4, 16, 8)))
        .graph
    )
    assert not [op for op in graph.get_operations() if op.type in ("Einsum", "Shape")]  # the one-token form ran
