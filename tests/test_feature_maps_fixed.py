"""Fixed feature maps (elu, relu, taylor) and the registry."""

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps
from tests.conftest import rel_err


def test_elu_formula(rng):
    x = rng.normal(size=(2, 3, 2, 5)).astype("float32") * 3
    want = np.where(x > 0, x + 1.0, np.exp(x))
    assert rel_err(feature_maps.get("elu")(x), want) <= 1e-6


def test_relu_formula_and_epsilon(rng):
    x = rng.normal(size=(2, 3, 2, 5)).astype("float32")
    got = np.asarray(feature_maps.get("relu", epsilon=0.5)(x))
    np.testing.assert_allclose(got, np.maximum(x, 0) + 0.5, rtol=1e-6)
    with pytest.raises(ValueError, match="epsilon"):
        feature_maps.get("relu", epsilon=-1.0)


def test_taylor_kernel_is_second_order_exp(rng):
    d = 4
    q = rng.normal(size=(1, 6, 2, d)).astype("float32")
    k = rng.normal(size=(1, 6, 2, d)).astype("float32")
    fm = feature_maps.get("taylor")
    assert fm.feature_dim(d) == 1 + d + d * d
    kernel = np.einsum("bthc,bshc->bhts", fm(q), fm(k))
    dot = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    assert rel_err(kernel, 1.0 + dot + dot**2 / 2.0) <= 1e-5
    assert (kernel >= 0.5 - 1e-6).all()


def test_feature_maps_compute_in_float32_under_mixed_policy(rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    fm = feature_maps.get("elu")
    assert fm.compute_dtype == "float32"
    out = fm(rng.normal(size=(1, 2, 1, 3)).astype("float32"))
    assert out.dtype == "float32"


def test_registry_round_trip_and_errors():
    for name in ("elu", "relu", "taylor"):
        assert name in feature_maps.available()
    fm = feature_maps.get("taylor", scale=0.3)
    again = feature_maps.deserialize(feature_maps.serialize(fm))
    assert type(again) is type(fm) and again.scale == 0.3
    assert feature_maps.get(fm) is fm
    with pytest.raises(ValueError, match="nope"):
        feature_maps.get("nope")
    with pytest.raises(ValueError, match="class_name"):
        feature_maps.deserialize({"class_name": "os.system", "config": {}})
    with pytest.raises(ValueError, match="kwargs"):
        feature_maps.get(fm, scale=2.0)
    with pytest.raises(ValueError, match="scale"):
        feature_maps.get("taylor", scale=0.0)


def test_wrong_rank_is_rejected(rng):
    with pytest.raises(ValueError, match="rank 4"):
        feature_maps.get("elu")(rng.normal(size=(2, 3, 4)).astype("float32"))
