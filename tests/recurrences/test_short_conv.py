"""keras_linattn.ops short convolution (causal depthwise conv) against its float64 oracle.

Both methods (depthwise kernel, shifted sum) against the reference, outputs
and gradients, with NaN junk at padded positions; pieces and steps against
one pass; the method chosen under XLA; empty pieces; bad kernels.
"""

import numpy as np
import pytest

from keras_linattn import ops as lops
from tests.recurrences._common import B, D, H, _grads, _padding
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("method", ["depthwise", "shifted"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_conv_matches_oracle_outputs_and_gradients(rng, t, size, method):
    x = rng.normal(size=(B, t, H, D)).astype("float32")
    kernel = rng.normal(size=(size, H, D)).astype("float32")
    buffer = rng.normal(size=(B, size - 1, H, D)).astype("float32")
    mask = _padding(rng, t)
    x[~mask] = np.nan  # junk at padded positions enters as zero
    w = rng.normal(size=(B, t, H, D))

    def fast(x_, k_, b_):
        return lops.causal_conv(x_, k_, b_, mask, method=method)

    def oracle(x_, k_, b_):
        return lops.causal_conv_reference(x_, k_, b_, mask)

    assert_close(fast(x, kernel, buffer), oracle(x, kernel, buffer), n=size, what="outputs")
    g_fast, g_oracle = _grads(fast, (x, kernel, buffer), w), _grads(oracle, (x, kernel, buffer), w)
    finite = np.isfinite(g_oracle)  # d/dx at NaN inputs is NaN in both: compare the rest
    assert (np.isfinite(g_fast) == finite).all()
    assert_close(g_fast[finite], g_oracle[finite], n=size + t, what="gradients")


def test_conv_pieces_and_steps_equal_one_pass(rng):
    t, size = 11, 4
    x = rng.normal(size=(B, t, H, D)).astype("float32")
    kernel = rng.normal(size=(size, H, D)).astype("float32")
    full, buf = lops.causal_conv(x, kernel, return_buffer=True)
    a, buf_a = lops.causal_conv(x[:, :2], kernel, return_buffer=True)  # shorter than the buffer
    b, buf_b = lops.causal_conv(x[:, 2:], kernel, buf_a, return_buffer=True)
    assert_close(np.concatenate([a, b], 1), full, n=size, paths=2, what="pieces")
    np.testing.assert_array_equal(buf_b, buf)
    state = np.zeros((B, size - 1, H, D), "float32")
    outs = []
    for i in range(t):
        y, state = lops.causal_conv_step(x[:, i], kernel, state)
        outs.append(np.asarray(y))
    assert_close(np.stack(outs, 1), full, n=size, paths=2, what="steps")
    np.testing.assert_array_equal(state, buf)


@pytest.mark.tf_only("tf.function(jit_compile=...) decides the method")
def test_conv_takes_the_shifted_sum_under_xla_and_the_depthwise_kernel_elsewhere(rng, monkeypatch):
    import tensorflow as tf

    from keras_linattn.ops import short_conv

    seen = []
    real = short_conv._shifted_sum
    monkeypatch.setattr(short_conv, "_shifted_sum", lambda *a: seen.append("shifted") or real(*a))
    x = rng.normal(size=(B, 9, H, D)).astype("float32")
    kernel = rng.normal(size=(4, H, D)).astype("float32")
    eager = lops.causal_conv(x, kernel)
    graph = tf.function(lambda x_: lops.causal_conv(x_, kernel))(x)
    assert seen == []  # eager and plain graphs (what export traces) use the depthwise kernel
    xla = tf.function(lambda x_: lops.causal_conv(x_, kernel), jit_compile=True)(x)
    nested = tf.function(lambda x_: tf.function(lambda y: lops.causal_conv(y, kernel))(x_), jit_compile=True)(x)
    assert seen == ["shifted", "shifted"]
    for got in (graph, xla, nested):
        assert_close(got, eager, n=4, paths=2, what="auto method")


def test_conv_refuses_bad_kernels(rng):
    x = rng.normal(size=(B, 5, H, D)).astype("float32")
    with pytest.raises(ValueError, match="K >= 2"):
        lops.causal_conv(x, np.ones((1, H, D), "float32"))
    with pytest.raises(ValueError, match="must have shape"):
        lops.causal_conv(x, np.ones((3, H, D + 1), "float32"))
    with pytest.raises(ValueError, match="`method` must be one of"):
        lops.causal_conv(x, np.ones((3, H, D), "float32"), method="fft")
    with pytest.raises(ValueError, match="`buffer` must have shape"):
        lops.causal_conv(x, np.ones((3, H, D), "float32"), np.zeros((B, 3, H, D), "float32"))


@pytest.mark.tf_only("traces with an unknown length through tf.function(input_signature=...)")
def test_conv_of_an_empty_piece_is_empty_and_keeps_the_buffer(rng):
    import tensorflow as tf

    kernel = rng.normal(size=(4, H, D)).astype("float32")
    buffer = rng.normal(size=(B, 3, H, D)).astype("float32")
    empty = np.zeros((B, 0, H, D), "float32")
    traced = tf.function(
        lambda x: lops.causal_conv(x, kernel, buffer, return_buffer=True),
        input_signature=[tf.TensorSpec((B, None, H, D), tf.float32)],
    )
    for fn in (lambda x: lops.causal_conv(x, kernel, buffer, return_buffer=True), traced):
        y, new = fn(empty)
        assert tuple(y.shape) == (B, 0, H, D)
        np.testing.assert_array_equal(new, buffer)
