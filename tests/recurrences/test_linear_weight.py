"""The window's learned linear weight (`linear_weight`): the weight of the linear terms beside the softmax window.

Checked against a different code path that computes the same function: a
linear weight ``lambda`` with a softmax weight ``gamma`` is the window with
softmax weight ``gamma / lambda`` and no linear weight (the normalizer is
shared, so only the ratio counts). Also: it cancels when the window covers
the sequence, attention transfer trains it, the shorthand and its errors,
and a linearized student with it.
"""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import AttentionSpec, LinearAttention
from keras_linattn.linearization import transfer_variables
from keras_linattn.recurrences import SparseCacheRecurrence, WindowRecurrence
from tests._backend import gradients
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

T, DIM, HEADS, KEY_DIM = 13, 16, 2, 8


def _shared(layer):
    """The layer's weights other than the window's gamma and linear weight, in build order."""
    return [w for w in layer.weights if "gamma" not in w.path and "linear_weight" not in w.path]


def _pair(recurrence_a, recurrence_b, seed=3):
    """Two built layers with the same random projections and feature map (the window's own weights as built)."""
    a = LinearAttention(HEADS, KEY_DIM, feature_map="hedgehog", chunk_size=4, recurrence=recurrence_a)
    b = LinearAttention(HEADS, KEY_DIM, feature_map="hedgehog", chunk_size=4, recurrence=recurrence_b)
    for layer in (a, b):
        layer.build((None, None, DIM), (None, None, DIM))
    rng = np.random.default_rng(seed)
    for w_a, w_b in zip(_shared(a), _shared(b), strict=True):
        value = rng.normal(size=w_a.shape).astype("float32") * 0.5
        w_a.assign(value)
        w_b.assign(value)
    return a, b


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: WindowRecurrence(3, **kw),
        lambda **kw: SparseCacheRecurrence(3, 2, **kw),
    ],
    ids=["window", "sparse_cache"],
)
def test_a_linear_weight_is_the_window_with_gamma_over_lambda(rng, make):
    # gamma = 0.2 with lambda = 0.5 weighs the softmax terms 0.4 times the linear ones: gamma = 0.4 alone.
    a, b = _pair(make(gamma=0.2, linear_weight=0.5), make(gamma=0.4))
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[1, :3] = False
    n = T + 2 * 2 * KEY_DIM + 2 * DIM  # keys, the feature dim, the projections
    out_a = a(x, x, key_mask=mask, use_causal_mask=True)
    out_b = b(x, x, key_mask=mask, use_causal_mask=True)
    assert_close(out_a, out_b, n=n, paths=2, what="lambda = 0.5, gamma = 0.2 vs gamma = 0.4")
    s_a, s_b = a.get_initial_state(2), b.get_initial_state(2)
    for t in range(T):
        o_a, s_a = a.step(x[:, t], x[:, t], s_a)
        o_b, s_b = b.step(x[:, t], x[:, t], s_b)
        assert_close(o_a, o_b, n=n, paths=2, what=f"step {t}")
    # ... and the linear weight matters: without it A is a different function.
    c, _ = _pair(make(gamma=0.2), make(gamma=0.4))  # the same seed: A's projections and maps
    out_c = np.asarray(c(x, x, key_mask=mask, use_causal_mask=True))
    assert np.abs(out_c - np.asarray(out_a)).max() > 1e-2 * np.abs(np.asarray(out_a)).max()


def test_a_window_covering_the_sequence_cancels_the_linear_weight(rng):
    a, b = _pair(WindowRecurrence(T, gamma=0.3, linear_weight=0.05), WindowRecurrence(T, gamma=0.3))
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    n = T + 2 * 2 * KEY_DIM + 2 * DIM
    assert_close(a(x, x, use_causal_mask=True), b(x, x, use_causal_mask=True), n=n, paths=2, what="W = T")


def test_the_linear_weight_is_a_trained_per_head_weight(rng):
    layer = LinearAttention(HEADS, KEY_DIM, feature_map="hedgehog", window_size=2, linear_weight=0.05)
    x = rng.normal(size=(1, 9, DIM)).astype("float32")
    layer(x, x, use_causal_mask=True)
    weight = layer.recurrence.linear_weight_log
    assert weight.path.endswith("window_linear_weight_log") and tuple(weight.shape) == (HEADS,)
    np.testing.assert_allclose(np.exp(weight.numpy()), 0.05, rtol=1e-6)
    assert any(v is weight for v in transfer_variables(layer))
    _, (grad,) = gradients(lambda: (keras.ops.sum(layer(x, x, use_causal_mask=True) ** 2), ()), variables=[weight])
    assert np.all(np.abs(np.asarray(grad)) > 0)  # T > W: every head has linear terms


def test_the_shorthand_and_its_errors():
    spec = AttentionSpec.create("elu", window_size=4, window_gamma=0.2, linear_weight=0.05)
    recurrence = spec.make_recurrence()
    assert isinstance(recurrence, WindowRecurrence)
    assert recurrence.get_config() == {"window_size": 4, "gamma": 0.2, "linear_weight": 0.05}
    cached = AttentionSpec.create("elu", window_size=4, cache_size=2, linear_weight=0.5).make_recurrence()
    assert cached.get_config() == {"window_size": 4, "cache_size": 2, "linear_weight": 0.5}
    assert WindowRecurrence(4).get_config() == {"window_size": 4}  # configs without it stay as they were
    with pytest.raises(ValueError, match="`linear_weight` weights the linear terms beside a softmax window"):
        AttentionSpec.create("elu", linear_weight=0.5)
    for bad in (-1.0, float("inf"), float("nan"), True, "0.5"):  # 0 is the window alone
        with pytest.raises(ValueError, match="`linear_weight`"):
            WindowRecurrence(4, linear_weight=bad)
    with pytest.raises(ValueError, match="not both"):
        AttentionSpec.create("elu", recurrence="window", linear_weight=0.5)


def test_a_layer_with_a_linear_weight_saves_and_loads(tmp_path, rng):
    inputs = keras.Input((None, DIM))
    layer = LinearAttention(HEADS, KEY_DIM, feature_map="hedgehog", window_size=3, cache_size=2, linear_weight=0.1)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    layer.recurrence.linear_weight_log.assign(np.log([0.1, 0.7]).astype("float32"))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


def test_linearize_passes_the_linear_weight():
    from tests.linearization._models import causal_teacher, data

    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=3, cache_size=1, linear_weight=0.05)
    recurrence = student.get_layer("att1").recurrence
    # linearize's default gamma (0.9) and the weight given.
    assert recurrence.get_config() == {"window_size": 3, "cache_size": 1, "gamma": 0.9, "linear_weight": 0.05}
    assert np.all(np.isfinite(np.asarray(student(data(2)))))


def test_linearize_defaults_the_linear_weight_with_a_cache_only():
    from tests.linearization._models import causal_teacher

    teacher, _ = causal_teacher()
    cached = keras_linattn.linearize(teacher, window_size=3, cache_size=1).get_layer("att1").recurrence
    assert cached.linear_weight == keras_linattn.linearization.convert.LOLA_LINEAR_WEIGHT == 0.001
    window = keras_linattn.linearize(teacher, window_size=3).get_layer("att1").recurrence
    assert window.linear_weight is None and "linear_weight" not in window.get_config()


def test_linear_weight_zero_is_the_window_alone(rng):
    # W = 4 < T: each output is exact softmax over the last 4 tokens, i.e. the same layer's output at the
    # end of those 4 tokens alone (where the window covers the sequence). No weight is learned.
    window = 4
    # No convolution: a piece alone would not see the inputs before it that the convolution reads in the full pass.
    plain = dict(feature_map="hedgehog", conv_size=None, chunk_size=4, window_size=window)
    layer = LinearAttention(HEADS, KEY_DIM, linear_weight=0, **plain)
    x = rng.normal(size=(1, T, DIM)).astype("float32")
    full = np.asarray(layer(x, x, use_causal_mask=True))
    assert "window_linear_weight_log" not in [w.name for w in layer.weights]
    for i in range(window - 1, T):
        part = x[:, i - window + 1 : i + 1]
        alone = np.asarray(layer(part, part, use_causal_mask=True))[:, -1]
        assert_close(full[:, i], alone, paths=4, n=window * KEY_DIM)
    with_linear = LinearAttention(HEADS, KEY_DIM, **plain)
    with_linear.build((None, None, DIM), (None, None, DIM))
    with_linear.set_weights(layer.get_weights())
    assert np.abs(np.asarray(with_linear(x, x, use_causal_mask=True)) - full).max() > 1e-3
