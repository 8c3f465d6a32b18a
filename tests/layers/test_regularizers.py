"""keras_linattn.regularizers.OrthogonalRegularizer: sum_h ||W_h W_h^T - I||_F^2."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn.regularizers import OrthogonalRegularizer
from tests.tolerance import assert_close, bound

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


def _np_penalty(w, factor):
    """factor * sum_h ||G_h - I||_F^2 with G the smaller Gram matrix, float64."""
    w = np.asarray(w, np.float64)
    if w.ndim == 2:
        w = w[None]
    total = 0.0
    for wh in w:
        gram = wh @ wh.T if wh.shape[0] <= wh.shape[1] else wh.T @ wh
        total += np.sum((gram - np.eye(gram.shape[0])) ** 2)
    return factor * total


def _n(shape):
    """Reduction length of the penalty of a [H,] a x b weight: the Gram reduces
    over max(a, b), then the sum runs over its H * min(a, b)^2 entries."""
    h, a, b = (1,) * (3 - len(shape)) + tuple(shape)
    return max(a, b) + h * min(a, b) ** 2


@pytest.mark.parametrize("shape", [(4, 6), (6, 4), (5, 5), (3, 4, 7), (2, 7, 3), (1, 5, 5)])
def test_value_equals_the_formula(rng, shape):
    w = rng.normal(size=shape).astype("float32")
    got = OrthogonalRegularizer(0.3)(w)
    assert got.dtype == "float32"
    assert_close(got, _np_penalty(w, 0.3), n=_n(shape))  # float64 NumPy oracle


def test_hand_computed_values():
    def check(factor, w, want):
        w = np.asarray(w, "float32")
        assert_close(OrthogonalRegularizer(factor)(w), want, n=_n(w.shape))

    # 2 I (2x2): G = 4 I, ||3 I||^2 = 18.
    check(0.5, 2.0 * np.eye(2), 9.0)
    # [[1, 1]] (1x2, D < C): G = W W^T = [[2]] -> (2 - 1)^2 = 1.
    check(1.0, [[1.0, 1.0]], 1.0)
    # Same matrix transposed (2x1, D > C): G = W^T W = [[2]] as well.
    check(1.0, [[1.0], [1.0]], 1.0)
    # Heads are summed: two copies of 2 I -> twice 18.
    check(1.0, np.stack([2.0 * np.eye(2)] * 2), 36.0)


@pytest.mark.parametrize("shape", [(3, 4, 6), (3, 6, 4)])
def test_zero_for_orthonormal_heads(rng, shape):
    h, d, c = shape
    heads = []
    for _ in range(h):
        q, _ = np.linalg.qr(rng.normal(size=(max(d, c), min(d, c))))
        heads.append(q.T if d < c else q)
    w = np.stack(heads).astype("float32")  # [H, D, C], orthonormal rows or columns
    # Each of the H * min(D, C)^2 entries of G - I is float32 rounding of the
    # rows (or columns) and of the Gram over max(D, C): at most bound(n = max(D, C)).
    per_entry = bound("float32", n=max(d, c))
    assert float(OrthogonalRegularizer(1.0)(w)) <= h * min(d, c) ** 2 * per_entry**2


def test_gradient_equals_the_analytic_gradient(rng):
    # d/dW ||W W^T - I||^2 = 4 (W W^T - I) W  (rows <= cols),
    # d/dW ||W^T W - I||^2 = 4 W (W^T W - I)  (rows > cols).
    for shape in [(2, 3, 5), (2, 5, 3)]:
        w = tf.Variable(rng.normal(size=shape).astype("float32"))
        with tf.GradientTape() as tape:
            loss = OrthogonalRegularizer(0.25)(w)
        got = tape.gradient(loss, w)
        w64 = np.asarray(w, np.float64)
        wt = np.swapaxes(w64, 1, 2)
        if shape[1] <= shape[2]:
            want = 4 * 0.25 * (w64 @ wt - np.eye(shape[1])) @ w64
        else:
            want = 4 * 0.25 * w64 @ (wt @ w64 - np.eye(shape[2]))
        # the Gram over max(D, C), then (G - I) W over min(D, C)
        assert_close(got, want, n=max(shape[1:]) + min(shape[1:]), what=str(shape))


def test_differs_from_keras_orthogonal_regularizer(rng):
    ours, theirs = OrthogonalRegularizer(1.0), keras.regularizers.OrthogonalRegularizer(1.0)
    # Orthogonal rows of norm 2: Keras' mean |cosine| is 0, the Frobenius penalty is not.
    w = 2.0 * np.eye(3, dtype="float32")
    assert float(theirs(w)) == 0.0
    assert_close(ours(w), 27.0, n=_n(w.shape))
    # Unit rows with cosine 0.6: Keras gives the mean |cos| over pairs, ours the squared deviation.
    w = np.array([[1.0, 0.0], [0.6, 0.8]], "float32")
    # Keras: row norms over D = 2, then the Gram over D = 2, then a sum over the Gram's 2 x 2 entries
    assert_close(theirs(w), 0.6, n=2 + 2 + 2 * 2)
    assert_close(ours(w), 2 * 0.6**2, n=_n(w.shape))
    # Keras' one refuses head-wise weights; ours sums over heads.
    w3 = rng.normal(size=(2, 3, 3)).astype("float32")
    with pytest.raises(ValueError, match="rank 2"):
        theirs(w3)
    # two float32 computations of the same penalty (the per-head ones added in float64)
    assert_close(ours(w3), float(ours(w3[0])) + float(ours(w3[1])), n=_n(w3.shape), paths=2)


def test_serialization_and_saving_in_a_model(rng, tmp_path):
    reg = OrthogonalRegularizer(0.125)
    assert reg.get_config() == {"factor": 0.125}
    again = keras.regularizers.deserialize(keras.regularizers.serialize(reg))
    assert type(again) is OrthogonalRegularizer and again.factor == 0.125
    assert OrthogonalRegularizer.from_config(reg.get_config()).factor == 0.125

    inputs = keras.Input((6,))
    model = keras.Model(inputs, keras.layers.Dense(4, kernel_regularizer=reg)(inputs))
    kernel = model.layers[1].kernel
    assert len(model.losses) == 1
    assert_close(model.losses[0], _np_penalty(kernel, 0.125), n=_n(kernel.shape))
    path = str(tmp_path / "reg.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.layers[1].kernel_regularizer) is OrthogonalRegularizer
    assert loaded.layers[1].kernel_regularizer.factor == 0.125
    assert_close(loaded.losses[0], model.losses[0], n=_n(kernel.shape), paths=2)  # float32 vs float32


@pytest.mark.parametrize("factor", [-0.1, float("nan"), float("inf"), "0.1", True, None])
def test_rejects_bad_factor(factor):
    with pytest.raises(ValueError, match="factor"):
        OrthogonalRegularizer(factor)


@pytest.mark.parametrize("shape", [(4,), (2, 2, 3, 3)])
def test_rejects_bad_rank(shape):
    with pytest.raises(ValueError, match="x.shape"):
        OrthogonalRegularizer(0.1)(np.ones(shape, "float32"))
