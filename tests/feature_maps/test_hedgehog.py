"""Hedgehog trainable feature map: definition, stability, layer integration, training, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.feature_maps import HedgehogFeatureMap
from keras_linattn.layers import LinearAttention
from tests._helpers import (
    assert_causal_outputs_never_see_the_future,
    assert_fits_with_xla,
    assert_rejects_bad_input_rank_and_shape,
    assert_self_attention_matches_oracle,
    causal_attention_model,
    save_and_load,
)
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def _np_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _np_hedgehog(x, kernel, bias):
    """[softmax(xW + b), softmax(-(xW + b))] in float64 NumPy; x [B,T,H,D], kernel [H,D,F]."""
    logits = np.einsum("bthd,hdf->bthf", x.astype("float64"), kernel.astype("float64"))  # [B, T, H, F]
    if bias is not None:
        logits = logits + bias
    return np.concatenate([_np_softmax(logits), _np_softmax(-logits)], axis=-1)


def test_identity_initialization_and_definition(rng):
    x = rng.normal(size=(2, 5, 3, 8)).astype("float32")
    fm = HedgehogFeatureMap()
    f = np.asarray(fm(x, is_query=False))
    assert fm.feature_dim(8) == 16
    for w in fm.trainable_weights:
        if "kernel" in w.path:
            np.testing.assert_array_equal(w.numpy(), np.broadcast_to(np.eye(8), (3, 8, 8)))
        else:
            np.testing.assert_array_equal(w.numpy(), np.zeros((3, 8)))
    # at init, phi(x) = [softmax(x), softmax(-x)]
    expected = np.concatenate([_np_softmax(x.astype("float64")), _np_softmax(-x.astype("float64"))], -1)
    assert_close(f, expected, n=8 + 8)  # D inputs of the kernel + F = D softmax terms; float64 oracle


@pytest.mark.parametrize("share_qk", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_numpy_with_trained_weights(rng, share_qk, use_bias):
    x = rng.normal(size=(2, 4, 3, 8)).astype("float32")
    fm = HedgehogFeatureMap(feature_dim=10, share_qk=share_qk, use_bias=use_bias)
    fm.build(x.shape)
    assert fm.feature_dim(8) == 10
    assert len(fm.trainable_weights) == (1 if share_qk else 2) * (2 if use_bias else 1)
    # a rectangular identity per head
    np.testing.assert_array_equal(fm.trainable_weights[0].numpy()[1], np.eye(8, 5))
    for w in fm.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    for is_query in (True, False):
        branch = fm._branches["qk" if share_qk else ("query" if is_query else "key")]
        kernel = branch["kernel"].numpy()
        bias = branch["bias"].numpy() if use_bias else None
        got = np.asarray(fm(x, is_query=is_query))
        # D = 8 inputs of the kernel + F = 5 softmax terms; float64 oracle
        assert_close(got, _np_hedgehog(x, kernel, bias), n=8 + 5, what=f"{is_query=}")
    q_features = np.asarray(fm(x, is_query=True))
    k_features = np.asarray(fm(x, is_query=False))
    if share_qk:
        np.testing.assert_array_equal(q_features, k_features)
    else:
        assert not np.allclose(q_features, k_features)


def test_separate_kernels_are_independent(rng):
    x = rng.normal(size=(1, 4, 2, 6)).astype("float32")
    fm = HedgehogFeatureMap(share_qk=False)
    before = np.asarray(fm(x, is_query=True))
    fm._branches["key"]["kernel"].assign(rng.normal(size=(2, 6, 6)).astype("float32"))
    np.testing.assert_array_equal(np.asarray(fm(x, is_query=True)), before)
    assert not np.allclose(np.asarray(fm(x, is_query=False)), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_positive_finite_and_normalized_for_large_inputs(rng, dtype):
    x = rng.uniform(-10, 10, size=(2, 7, 2, 8))
    x[0, 0] = 1e4
    if dtype == "bfloat16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    fm = HedgehogFeatureMap()
    f = fm(keras.ops.convert_to_tensor(x, dtype=dtype), is_query=False)
    assert f.dtype == "float32"
    f = np.asarray(f)
    assert np.isfinite(f).all()
    assert (f >= 0).all()
    # The softmax normalization over F = 8 terms runs in float32 (the map's
    # compute dtype, also under the bf16 policy); the sums here are float64.
    f = f.astype("float64")
    assert_close(f[..., :8].sum(-1), np.ones(f.shape[:-1]), n=8, what="softmax(xW)")
    assert_close(f[..., 8:].sum(-1), np.ones(f.shape[:-1]), n=8, what="softmax(-xW)")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("share_qk", [False, True])
def test_layer_matches_oracle_outputs_and_gradients(rng, causal, share_qk):
    x = tf.constant(rng.normal(size=(2, 21, 8)).astype("float32"))
    fm = HedgehogFeatureMap(feature_dim=12, share_qk=share_qk)
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=fm, conv_size=None, chunk_size=8)  # the map alone
    layer(x, x)
    for w in fm.trainable_weights:  # move away from the identity
        w.assign(w.numpy() + 0.3 * rng.normal(size=w.shape).astype("float32"))
    assert len(layer.trainable_variables) == 8 + (2 if share_qk else 4)
    # Gradients (the larger n): D_in = 8 input projection + D = 4 kernel inputs
    # + 6 softmax terms + S = 21 keys + C = 12 features + H*M = 8 output
    # projection + B*T = 42 positions sharing each weight.
    assert_self_attention_matches_oracle(layer, x, causal, n=8 + 4 + 6 + 21 + fm.feature_dim(4) + 2 * 4 + 2 * 21)


def test_causal_outputs_never_see_the_future(rng):
    x = rng.normal(size=(1, 24, 8)).astype("float32")
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map="hedgehog", chunk_size=8)
    assert_causal_outputs_never_see_the_future(layer, x, rng, positions=(0, 7, 8, 17))


def test_fit_with_xla_trains_the_kernels(rng):
    fm = HedgehogFeatureMap(feature_dim=12)
    model = causal_attention_model(fm)
    initial = [w.numpy().copy() for w in fm.trainable_weights]
    assert_fits_with_xla(model, rng)
    for before, w in zip(initial, fm.trainable_weights, strict=True):
        assert not np.allclose(before, w.numpy())


def test_keras_save_load_with_non_default_arguments(tmp_path, rng):
    x = rng.normal(size=(2, 16, 8)).astype("float32")
    fm = HedgehogFeatureMap(feature_dim=12, share_qk=False, use_bias=False)
    model = causal_attention_model(fm)
    for w in fm.trainable_weights:
        w.assign(w.numpy() + 0.3 * rng.normal(size=w.shape).astype("float32"))
    expected = model.predict(x, verbose=0)
    loaded = save_and_load(model, tmp_path)
    loaded_fm = loaded.layers[1].feature_map
    assert isinstance(loaded_fm, HedgehogFeatureMap)
    assert (loaded_fm.feature_dim(8), loaded_fm.share_qk, loaded_fm.use_bias) == (12, False, False)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)


def test_get_config_round_trip():
    fm = feature_maps.get("hedgehog", feature_dim=10, share_qk=False, use_bias=False, seed=3)
    clone = feature_maps.deserialize(feature_maps.serialize(fm))
    assert type(clone) is HedgehogFeatureMap
    assert clone.get_config() == fm.get_config()
    assert clone.get_config()["feature_dim"] == 10
    assert "feature_size" not in clone.get_config()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(feature_size=0), "feature_size"),
        (dict(feature_size=-4), "feature_size"),
        (dict(feature_size=2.0), "feature_size"),
        (dict(feature_dim=0), "feature_dim"),
        (dict(feature_dim=7), "feature_dim=7"),
        (dict(feature_dim=8, feature_size=4), "feature_size"),
        (dict(seed=-1), "seed"),
        (dict(share_qk="yes"), "share_qk"),
        (dict(use_bias=1), "use_bias"),
    ],
)
def test_bad_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        HedgehogFeatureMap(**kwargs)


def test_bad_input_rank_and_shape():
    assert_rejects_bad_input_rank_and_shape(HedgehogFeatureMap(), other_shape=(1, 3, 3, 4))


# Configs as `get_config` wrote them before Hedgehog stood on the trainable-map
# base (`feature_size` = F, an explicit `share_qk`, no `feature_dim`/`seed`).
_OLD_DTYPE = {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"}, "registered_name": None}


@pytest.mark.parametrize("share_qk", [False, True])
@pytest.mark.parametrize("use_bias", [False, True])
def test_old_config_with_feature_size_and_explicit_share_qk_loads_the_same(rng, share_qk, use_bias):
    old = {
        "name": "hh",
        "trainable": True,
        "dtype": _OLD_DTYPE,
        "feature_size": 3,
        "share_qk": share_qk,
        "use_bias": use_bias,
    }
    with pytest.warns(DeprecationWarning, match="feature_dim=6"):
        fm = HedgehogFeatureMap.from_config(old)
    assert (fm.feature_dim(4), fm.share_qk, fm.use_bias) == (6, share_qk, use_bias)
    config = fm.get_config()
    assert config["feature_dim"] == 6 and "feature_size" not in config
    x = rng.normal(size=(2, 5, 2, 4)).astype("float32")
    fm.build(x.shape)
    # the weights the old map had: eye(D, F) kernels (+ zero biases), one set or one per branch
    assert len(fm.trainable_weights) == (1 if share_qk else 2) * (2 if use_bias else 1)
    for w in fm.trainable_weights:
        assert w.dtype == "float32"
        w.assign(rng.normal(size=w.shape).astype("float32"))
    # ... and the old map's function of them
    for is_query in (True, False):
        branch = fm._branches["qk" if share_qk else ("query" if is_query else "key")]
        bias = branch["bias"].numpy() if use_bias else None
        want = _np_hedgehog(x, branch["kernel"].numpy(), bias)
        assert_close(np.asarray(fm(x, is_query=is_query)), want, n=4 + 3, what=f"{is_query=}")
    # re-saved, the config has the new name and gives the same map
    clone = HedgehogFeatureMap.from_config(config)
    clone.build(x.shape)
    clone.set_weights(fm.get_weights())
    np.testing.assert_array_equal(np.asarray(clone(x, is_query=False)), np.asarray(fm(x, is_query=False)))


def test_share_qk_defaults_to_true_like_the_other_trainable_maps():
    for name in ("hedgehog", "ffn", "glu", "oglu", "aoglu"):
        assert feature_maps.get(name).share_qk is True, name


@pytest.mark.parametrize("dtype", ["float64", "mixed_bfloat16", "bfloat16"])
def test_weights_are_float32_whatever_the_dtype_like_the_other_trainable_maps(dtype):
    for fm in (HedgehogFeatureMap(dtype=dtype), feature_maps.get("glu", dtype=dtype)):
        fm.build((1, 3, 2, 4))
        assert fm.weights and all(w.dtype == "float32" for w in fm.weights), type(fm).__name__


def test_feature_size_and_feature_dim_give_the_same_map(rng):
    x = rng.normal(size=(1, 3, 2, 4)).astype("float32")
    with pytest.warns(DeprecationWarning):
        old = HedgehogFeatureMap(feature_size=3)
    new = HedgehogFeatureMap(feature_dim=6)
    np.testing.assert_array_equal(np.asarray(old(x)), np.asarray(new(x)))
    assert old.get_config()["feature_dim"] == new.get_config()["feature_dim"] == 6


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_one_token_form_matches_the_general_form_values_and_gradients(batch, use_bias):
    """At T = 1 (a decoding step) the map folds the sign into [W, -W]: the same values and gradients."""
    rng = np.random.default_rng(11)
    fm = HedgehogFeatureMap(feature_dim=10, use_bias=use_bias)
    fm.build((None, None, 3, 8))
    for w in fm.trainable_weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    x = tf.constant(rng.normal(size=(batch, 1, 3, 8)).astype("float32"))  # [B, 1, H, D]
    up = tf.constant(rng.normal(size=(batch, 1, 3, 10)).astype("float32"))

    def run(inputs, fn):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = fn(inputs)
            loss = tf.reduce_sum(y * up)
        return [y] + tape.gradient(loss, [inputs] + fm.trainable_weights)

    # Traced with an unknown batch, as in an exported step, and eagerly.
    traced = tf.function(lambda a: fm(a, is_query=True), input_signature=[tf.TensorSpec((None, 1, 3, 8))])
    fast = run(x, traced)
    fast_eager = run(x, lambda a: fm(a, is_query=True))
    # The general form: two tokens [x, x] (T = 2 takes the einsum), the first kept (the second gets no gradient).
    general = run(x, lambda a: fm(tf.concat([a, a], axis=1), is_query=True)[:, :1])
    branch = fm._branches["qk"]
    expected = _np_hedgehog(x.numpy(), branch["kernel"].numpy(), branch["bias"].numpy() if use_bias else None)
    names = ["outputs", "d/dx", "d/dW", "d/db"][: len(fast)]
    assert len(fast) == 3 + use_bias
    for name, a, b, c in zip(names, fast, fast_eager, general, strict=True):
        assert a.shape == b.shape == c.shape, (name, a.shape, c.shape)
        assert_close(a.numpy(), b.numpy(), n=8 + 5, what=name)
        assert_close(a.numpy(), c.numpy(), n=8 + 5, what=name)
    assert_close(fast[0].numpy(), expected, n=8 + 5, what="against NumPy")
    graph = traced.get_concrete_function().graph
    ops_ = {op.type for op in graph.get_operations()}
    assert "Einsum" not in ops_ and "Neg" in ops_  # the one-token form ran: [W, -W], no einsum
