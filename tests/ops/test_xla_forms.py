"""The forms some computations take where XLA compiles them, against the plain ones.

Under ``jit_compile=True`` the short convolution runs as K shifted
multiply-adds instead of a depthwise convolution
(`keras_linattn._xla.under_xla` decides), and every product with a
transposed operand hands the transpose to the matmul on every path. The
layer under XLA is checked against the eager layer (outputs and gradients
with respect to the input and every weight), and the decision itself:
XLA graphs take the XLA form, eager code and plain graphs (what SavedModel
and ONNX export trace) never do.
"""

import pytest

from keras_linattn._xla import under_xla
from keras_linattn.layers import LinearAttention
from tests._backend import flat
from tests.tolerance import assert_close

pytestmark = pytest.mark.tf_only("tf.function(jit_compile=...) is what selects the XLA forms on TensorFlow")

DIM, HEADS, KEY_DIM, VALUE_DIM, T, OUT = 12, 2, 8, 4, 9, 10


def _layer(**kwargs):
    layer = LinearAttention(HEADS, KEY_DIM, VALUE_DIM, output_shape=OUT, chunk_size=4, **kwargs)
    layer.build((None, T, DIM), (None, T, DIM))
    return layer


def _loss_and_grads(layer, x, w, causal):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, x, use_causal_mask=causal)  # [B, T, OUT]
        loss = tf.reduce_sum(y * w)
    return y, tape.gradient(loss, [x] + layer.trainable_variables)


@pytest.mark.parametrize(
    "causal, kwargs",
    [
        (False, {}),
        (True, {}),
        (True, dict(conv_size=3)),
        (True, dict(conv_size=4, update="delta", normalize=False, feature_map=None)),
    ],
)
def test_layer_under_xla_matches_eager_outputs_and_gradients(rng, causal, kwargs):
    import tensorflow as tf

    layer = _layer(**kwargs)
    x = tf.constant(rng.normal(size=(2, T, DIM)).astype("float32"))
    w = tf.constant(rng.normal(size=(2, T, OUT)).astype("float32"))
    eager, g_eager = _loss_and_grads(layer, x, w, causal)
    compiled, g_xla = tf.function(lambda a: _loss_and_grads(layer, a, w, causal), jit_compile=True)(x)
    # Reductions on the way: the projection (DIM), the attention over T keys and
    # KEY_DIM features, the convolution, the output projection (HEADS * VALUE_DIM).
    n = DIM + T + KEY_DIM + kwargs.get("conv_size", 0) + HEADS * VALUE_DIM
    assert_close(compiled, eager, n=n, paths=2, what="XLA vs eager outputs")
    assert_close(flat(g_xla), flat(g_eager), n=n + OUT, paths=2, what="XLA vs eager gradients")


def _op_types(fn, x):
    return {op.type for op in fn.get_concrete_function(x).graph.get_operations()}


def test_xla_forms_are_taken_under_xla_only(rng):
    import tensorflow as tf

    layer = _layer(conv_size=3)
    x = tf.constant(rng.normal(size=(2, T, DIM)).astype("float32"))

    def call(a):
        return layer(a, a, use_causal_mask=True)

    plain = _op_types(tf.function(call), x)
    compiled = _op_types(tf.function(call, jit_compile=True), x)
    # Plain graphs (what SavedModel and ONNX export trace) convolve with the depthwise kernel;
    # XLA graphs with multiply-adds.
    assert "DepthwiseConv2dNative" in plain and "DepthwiseConv2dNative" not in compiled
    assert not under_xla()
    flags = []
    tf.function(lambda: flags.append(under_xla()) or tf.constant(0.0), jit_compile=True)()
    tf.function(lambda: flags.append(under_xla()) or tf.constant(0.0))()
    tf.function(lambda: tf.function(lambda: flags.append(under_xla()) or tf.constant(0.0))(), jit_compile=True)()
    assert flags == [True, False, True]  # nested plain functions inside an XLA one are compiled by XLA too
