"""The argument rules of `keras_linattn._validation`, and public constructors refusing alike.

Each rule: values it accepts (and what it returns for them), values it
refuses, with a `ValueError` in the Keras style naming the argument and the
value received. Then a handful of public constructors and functions: the same
bad value is refused the same way (same error type, the argument named, the
value repeated), and NumPy integers are accepted wherever an int is.
"""

import math
import re

import numpy as np
import pytest

from keras_linattn import _validation as v
from keras_linattn import feature_maps, samplers
from keras_linattn.layers import LinearAttention, LinearTransformerDecoder, LinearTransformerEncoder
from keras_linattn.ops import core as la_ops


def _refused(rule, name, value, *args, **kwargs):
    """Calls `rule(name, value)`; asserts the Keras-style message; returns it."""
    with pytest.raises(ValueError) as info:
        rule(name, value, *args, **kwargs)
    message = str(info.value)
    assert message.startswith(f"`{name}` must be "), message
    assert message.endswith(f"Received: {name}={value!r}"), message
    return message


INT_LIKE_BAD = [True, False, 1.0, 2.5, "3", None, [1], float("nan")]


# ---------------------------------------------------------------- the rules
@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(1), np.uint8(2)])
def test_positive_int_accepts(value):
    got = v.check_positive_int("num_heads", value)
    assert got == value and type(got) is int


@pytest.mark.parametrize("value", [0, -1, np.int64(0)] + INT_LIKE_BAD)
def test_positive_int_refuses(value):
    assert "a positive integer" in _refused(v.check_positive_int, "num_heads", value)


@pytest.mark.parametrize("value", [None, 4, np.int64(4)])
def test_optional_positive_int_accepts(value):
    got = v.check_optional_positive_int("key_dim", value)
    assert got == value and (got is None or type(got) is int)


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4"])
def test_optional_positive_int_refuses(value):
    assert "a positive integer or None" in _refused(v.check_optional_positive_int, "key_dim", value)


@pytest.mark.parametrize("value", [0, 5, np.int64(2)])
def test_non_negative_int_accepts(value):
    assert v.check_non_negative_int("batch_size", value) == value


@pytest.mark.parametrize("value", [-1, True, 1.0, None])
def test_non_negative_int_refuses(value):
    assert "a non-negative integer" in _refused(v.check_non_negative_int, "batch_size", value)


@pytest.mark.parametrize("value", [1, 2, 3, np.int64(3)])
def test_int_in_range_accepts(value):
    assert v.check_int_in_range("depth", value, 1, 3) == value


@pytest.mark.parametrize("value", [0, 4, True, 2.0, None])
def test_int_in_range_refuses(value):
    assert "an integer in [1, 3]" in _refused(v.check_int_in_range, "depth", value, 1, 3)


@pytest.mark.parametrize("value", [0, 0.0, 0.1, 0.999, np.float32(0.5), np.int64(0)])
def test_rate_accepts(value):
    got = v.check_rate("dropout", value)
    assert got == pytest.approx(float(value)) and type(got) is float


@pytest.mark.parametrize("value", [True, False, 1, 1.0, -0.1, float("nan"), float("inf"), "0.1", None])
def test_rate_refuses(value):
    assert "a number in [0, 1)" in _refused(v.check_rate, "dropout", value)


@pytest.mark.parametrize("value", [None, 0, 42, np.int64(7), np.uint32(1)])
def test_seed_accepts(value):
    got = v.check_seed("seed", value)
    assert got == value and (got is None or type(got) is int)


@pytest.mark.parametrize("value", [True, False, -1, np.int64(-2), 1.0, "3"])
def test_seed_refuses(value):
    assert "None or a non-negative integer" in _refused(v.check_seed, "seed", value)


@pytest.mark.parametrize("value", [1e-6, 1, np.float32(1e-5), 0.5])
def test_epsilon_accepts(value):
    got = v.check_epsilon("epsilon", value)
    assert got == pytest.approx(float(value)) and type(got) is float


@pytest.mark.parametrize("value", [0, 0.0, -1e-6, True, float("inf"), float("nan"), None, "1e-6"])
def test_epsilon_refuses(value):
    assert "a finite positive number" in _refused(v.check_epsilon, "epsilon", value)


def test_epsilon_allow_zero():
    assert v.check_epsilon("eps", 0, allow_zero=True) == 0.0
    for value in (-1e-9, True, math.inf, math.nan):
        assert "a finite non-negative number" in _refused(v.check_epsilon, "eps", value, allow_zero=True)


def test_positive_float_and_non_negative_float():
    assert v.check_positive_float("scale", None, allow_none=True) is None
    assert v.check_positive_float("scale", np.float64(0.25)) == 0.25
    assert "a finite positive number or None" in _refused(v.check_positive_float, "scale", 0.0, allow_none=True)
    _refused(v.check_positive_float, "scale", None)
    assert v.check_non_negative_float("factor", 0) == 0.0
    for value in (-0.1, True, math.inf, "0.1"):
        assert "a finite non-negative number" in _refused(v.check_non_negative_float, "factor", value)


@pytest.mark.parametrize("value", [True, False])
def test_bool_accepts(value):
    assert v.check_bool("share_qk", value) is value


@pytest.mark.parametrize("value", [0, 1, None, "True", np.bool_(True)])
def test_bool_refuses(value):
    assert "a bool" in _refused(v.check_bool, "share_qk", value)


def test_one_of():
    assert v.check_one_of("kind", "iid", ("orthogonal", "iid")) == "iid"
    for value in ("IID", None, 1, True):
        assert "one of ('orthogonal', 'iid')" in _refused(v.check_one_of, "kind", value, ("orthogonal", "iid"))
    assert v.check_one_of("verbose", 1, (0, 1, 2)) == 1
    _refused(v.check_one_of, "verbose", True, (0, 1, 2))  # True == 1, but a bool is not a level


@pytest.mark.parametrize("value, want", [("float32", "float32"), (np.float16, "float16"), ("int64", "int64")])
def test_dtype_name_accepts(value, want):
    assert v.check_dtype_name("dtype", value) == want


@pytest.mark.parametrize("value", ["float33", None, True, 3])
def test_dtype_name_refuses(value):
    assert "a dtype name" in _refused(v.check_dtype_name, "dtype", value)


def test_dtype_name_allowed():
    assert v.check_dtype_name("dtype", "int32", allowed=("int32", "int64")) == "int32"
    assert "('int32', 'int64')" in _refused(v.check_dtype_name, "dtype", "float32", allowed=("int32", "int64"))


def test_rank():
    v.check_rank("q", np.zeros((1, 2, 3, 4)), 4)
    v.check_rank("q", np.zeros((1, 2, 3)), (3, 4))
    with pytest.raises(ValueError, match=re.escape("`q` must have rank 4. Received: q.shape=(1, 2, 3)")):
        v.check_rank("q", np.zeros((1, 2, 3)), 4)
    with pytest.raises(ValueError, match=re.escape("`q` must have rank 3 or 4. Received: q.shape=(2,)")):
        v.check_rank("q", np.zeros((2,)), (3, 4))


def test_no_module_keeps_its_own_positive_int_rule():
    assert not hasattr(la_ops, "_check_positive_int") and not hasattr(la_ops, "_check_rank")


# ------------------------------------------ public constructors refuse alike
def _message(make):
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


def _blocks(**kwargs):
    return [
        lambda: LinearTransformerEncoder(2, 8, **kwargs),
        lambda: LinearTransformerDecoder(2, 8, **kwargs),
    ]


@pytest.mark.parametrize("value", [True, 1.0, -0.1, "0.1"])
def test_dropout_refused_the_same_way(value):
    want = _refused(v.check_rate, "dropout", value)
    for make in _blocks(dropout=value):
        assert _message(make) == want
    # LinearAttention (its checks live in layers/_projections.py) refuses the same values.
    assert _message(lambda: LinearAttention(2, 4, dropout=value)).endswith(f"Received: dropout={value!r}")


@pytest.mark.parametrize("value", [True, -1, 1.5, "3"])
def test_seed_refused_the_same_way(value):
    want = _refused(v.check_seed, "seed", value)
    makers = _blocks(seed=value) + [
        lambda: feature_maps.get("favor+", seed=value),
        lambda: feature_maps.get("favor_trig", seed=value),
        lambda: feature_maps.get("glu", seed=value),
        lambda: feature_maps.get("hedgehog", seed=value),
    ]
    for make in makers:
        assert _message(make) == want
    assert _message(lambda: LinearAttention(2, 4, seed=value)).endswith(f"Received: seed={value!r}")


def test_numpy_integer_seed_accepted_and_stored_as_int():
    seed = np.int64(5)
    for layer in [make() for make in _blocks(seed=seed)] + [
        feature_maps.get("favor+", seed=seed),
        feature_maps.get("glu", seed=seed),
        feature_maps.get("hedgehog", seed=seed),
    ]:
        assert layer.get_config()["seed"] == 5 and type(layer.get_config()["seed"]) is int


def test_linear_attention_accepts_numpy_integer_seed():
    layer = LinearAttention(2, 4, seed=np.int64(5))
    assert type(layer.get_config()["seed"]) is int


@pytest.mark.parametrize("value", [-1.0, True, float("inf"), float("nan"), "1e-6"])
def test_epsilon_refused_the_same_way(value):
    want = _refused(v.check_epsilon, "epsilon", value, allow_zero=True)
    assert _message(lambda: feature_maps.get("relu", epsilon=value)) == want
    eps_want = _refused(v.check_epsilon, "eps", value, allow_zero=True)
    q = np.ones((1, 2, 1, 3), "float32")
    assert _message(lambda: la_ops.linear_attention(q, q, q, eps=value)) == eps_want
    # LinearAttention (layers/linear_attention.py, owned elsewhere) refuses the same values.
    assert _message(lambda: LinearAttention(2, 4, epsilon=value)).endswith(f"Received: epsilon={value!r}")
    for make in _blocks(layer_norm_epsilon=value):
        assert _message(make) == _refused(v.check_epsilon, "layer_norm_epsilon", value)


def test_zero_epsilon_accepted_where_zero_is_meaningful_only():
    assert feature_maps.get("relu", epsilon=0).epsilon == 0.0
    LinearAttention(2, 4, epsilon=0.0)
    for make in _blocks(layer_norm_epsilon=0):
        assert _message(make) == _refused(v.check_epsilon, "layer_norm_epsilon", 0)


@pytest.mark.parametrize("value", [0, -2, True, 2.0])
def test_positive_ints_refused_the_same_way(value):
    want = _refused(v.check_positive_int, "num_heads", value)
    makers = [
        lambda: LinearAttention(value, 4),
        lambda: LinearTransformerEncoder(value, 8),
        lambda: LinearTransformerDecoder(value, 8),
        lambda: la_ops._zero_state(1, value, 4, 4),
    ]
    for make in makers:
        assert _message(make) == want
    want = _refused(v.check_positive_int, "num_features", value)
    for name in ("favor+", "favor_trig"):
        assert _message(lambda name=name: feature_maps.get(name, num_features=value)) == want


def test_numpy_integers_accepted_where_ints_are():
    n = np.int64(2)
    assert LinearAttention(n, np.int32(4), chunk_size=np.int64(8)).get_config()["num_heads"] == 2
    assert LinearTransformerEncoder(n, np.int64(8)).get_config()["intermediate_dim"] == 8
    assert feature_maps.get("favor+", num_features=np.int64(8)).get_config()["num_features"] == 8
    assert feature_maps.get("glu", depth=np.int64(2), feature_dim=np.int64(6)).get_config()["feature_dim"] == 6
    assert feature_maps.get("hedgehog", feature_dim=np.int64(6)).feature_dim(3) == 6


@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_share_qk_refused_the_same_way_by_every_trainable_map(value):
    want = _refused(v.check_bool, "share_qk", value)
    for name in ("hedgehog", "ffn", "glu", "oglu", "aoglu"):
        assert _message(lambda name=name: feature_maps.get(name, share_qk=value)) == want


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_feature_dim_refused_the_same_way_by_every_trainable_map(value):
    want = _refused(v.check_optional_positive_int, "feature_dim", value)
    for name in ("hedgehog", "ffn", "glu", "oglu", "aoglu"):
        assert _message(lambda name=name: feature_maps.get(name, feature_dim=value)) == want


def test_samplers_refuse_bools_and_non_positive_values():
    # samplers.py is owned elsewhere: its messages are not all the rules' yet,
    # but bad values are refused with the argument named.
    for make, name in [
        (lambda: samplers.TopKSampler(k=True), "k"),
        (lambda: samplers.TopKSampler(k=0), "k"),
        (lambda: samplers.GreedySampler(temperature=True), "temperature"),
        (lambda: samplers.RandomSampler(temperature=-1.0), "temperature"),  # 0 is greedy (the rule table)
    ]:
        assert f"`{name}` must be" in _message(make)
