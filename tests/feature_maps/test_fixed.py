"""Fixed feature maps (elu, relu, taylor) and the registry."""

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps
from tests.tolerance import assert_close, bound

# numeric: run again with oneDNN off (`make test-onednn-off`); jax: run again on JAX (`make test-jax`)
pytestmark = [pytest.mark.numeric, pytest.mark.jax]


def test_elu_formula(rng):
    x = rng.normal(size=(2, 3, 2, 5)).astype("float32") * 3
    x64 = x.astype("float64")
    want = np.where(x64 > 0, x64 + 1.0, np.exp(x64))
    assert_close(feature_maps.get("elu")(x), want, n=1)  # elementwise: no reduction


def test_relu_formula_and_epsilon(rng):
    x = rng.normal(size=(2, 3, 2, 5)).astype("float32")
    got = np.asarray(feature_maps.get("relu", epsilon=0.5)(x))
    assert_close(got, np.maximum(x.astype("float64"), 0) + 0.5, n=1)  # elementwise: no reduction
    with pytest.raises(ValueError, match="epsilon"):
        feature_maps.get("relu", epsilon=-1.0)


def test_taylor_kernel_is_second_order_exp(rng):
    d = 4
    q = rng.normal(size=(1, 6, 2, d)).astype("float32")
    k = rng.normal(size=(1, 6, 2, d)).astype("float32")
    fm = feature_maps.get("taylor")
    c = fm.feature_dim(d)
    assert c == 1 + d + d * d
    # The map's float32 features, their dot products taken in float64.
    qf, kf = (np.asarray(fm(x), np.float64) for x in (q, k))
    kernel = np.einsum("bthc,bshc->bhts", qf, kf)
    dot = np.einsum("bthd,bshd->bhts", q.astype("float64"), k.astype("float64")) / np.sqrt(d)
    # The kernel sums C float32-rounded feature products.
    assert_close(kernel, 1.0 + dot + dot**2 / 2.0, n=c)  # C features
    # 1 + a + a^2/2 >= 1/2, up to the same rounding (absolute: relative bound times the scale).
    assert (kernel >= 0.5 - bound("float32", n=c) * np.abs(kernel).max()).all()


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
