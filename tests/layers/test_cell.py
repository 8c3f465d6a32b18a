"""Recurrent form of LinearAttention: `step`, resumable state, and LinearAttentionCell in keras.layers.RNN.

Every registered feature map is exercised (the list is read from the
registry, so maps added later are covered automatically). The parallel
chunked causal path is compared with the token-by-token recurrence.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention, LinearAttentionCell
from tests._helpers import layer_conditioning, run_steps, step_test_feature_map
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

DIM = 8
T = 7  # not a multiple of the chunk length
CHUNK = 3
FEATURE_MAPS = feature_maps.available()


def _layer(feature_map="elu", **kwargs):
    # Each feature map's (S, z) state and bounds, without the default's convolution (its buffers join the state).
    kwargs.setdefault("conv_size", None)
    layer = LinearAttention(
        num_heads=2, key_dim=4, feature_map=step_test_feature_map(feature_map), chunk_size=CHUNK, **kwargs
    )
    layer.build((None, None, DIM), (None, None, DIM))
    return layer


def _n_output(layer, s):
    """Reduction length of the layer's output over ``s`` keys: DIM (input
    projection) + D (the map's own projection, e.g. favor's W x) + S keys +
    C features + H*M (output projection)."""
    return DIM + layer.key_dim + s + layer.feature_dim + layer.num_heads * layer.value_dim


def _n_state(layer, s):
    """Reduction length of the state ``S = sum_s phi(k_s) v_s^T`` (and ``z``):
    DIM (input projection) + D (the map's own projection) + S keys."""
    return DIM + layer.key_dim + s


def _conditioning(layer, x):
    """Normalizer conditioning of causal self-attention on ``x`` (1 for positive maps)."""
    return layer_conditioning(layer, x, x, causal=True)


def _inputs(rng, batch=2, length=T):
    return rng.normal(size=(batch, length, DIM)).astype("float32")


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_step_matches_parallel_causal(rng, feature_map):
    x = _inputs(rng)
    layer = _layer(feature_map)
    parallel = np.asarray(layer(x, x, use_causal_mask=True))
    stepped, (s, z) = run_steps(layer, x, self_attention=True)
    # Step and parallel are both float32 (paths=2).
    assert_close(
        stepped, parallel, n=_n_output(layer, T), conditioning=_conditioning(layer, x), paths=2, what="outputs"
    )
    # The final recurrent state is the parallel path's returned state.
    _, (s_par, z_par) = layer(x, x, use_causal_mask=True, return_state=True)
    assert_close(s, s_par, n=_n_state(layer, T), paths=2, what="S")
    assert_close(z, z_par, n=_n_state(layer, T), paths=2, what="z")


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_prefill_then_steps_matches_one_pass(rng, feature_map):
    x = _inputs(rng, length=9)
    layer = _layer(feature_map)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    head, state = layer(x[:, :5], x[:, :5], use_causal_mask=True, return_state=True)
    tail, _ = run_steps(layer, x[:, 5:], state, self_attention=True)
    n, conditioning = _n_output(layer, x.shape[1]), _conditioning(layer, x)  # S = 9 keys at most
    assert_close(np.asarray(head), full[:, :5], n=n, conditioning=conditioning, paths=2, what="prefill")
    assert_close(tail, full[:, 5:], n=n, conditioning=conditioning, paths=2, what="steps")


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_split_and_resume_matches_one_pass(rng, feature_map):
    x = _inputs(rng, length=11)
    layer = _layer(feature_map)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    pieces, state = [], None
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        y, state = layer(x[:, lo:hi], x[:, lo:hi], use_causal_mask=True, return_state=True, initial_state=state)
        pieces.append(np.asarray(y))
    assert_close(
        np.concatenate(pieces, axis=1),
        full,
        n=_n_output(layer, x.shape[1]),
        conditioning=_conditioning(layer, x),
        paths=2,  # S = 11 keys at most
    )


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_cell_in_keras_rnn_matches_parallel_layer(rng, feature_map):
    x = _inputs(rng)
    layer = _layer(feature_map)
    rnn = keras.layers.RNN(LinearAttentionCell(layer), return_sequences=True, return_state=True)
    outputs, s_flat, z_flat = rnn(x)
    parallel, (s, z) = layer(x, x, use_causal_mask=True, return_state=True)
    # keras.layers.RNN runs the recurrent step: float32 against float32 (paths=2).
    assert_close(
        outputs, parallel, n=_n_output(layer, T), conditioning=_conditioning(layer, x), paths=2, what="outputs"
    )
    assert_close(np.reshape(s_flat, s.shape), s, n=_n_state(layer, T), paths=2, what="S")
    assert_close(np.reshape(z_flat, z.shape), z, n=_n_state(layer, T), paths=2, what="z")


def test_cell_shares_weights_and_gradients_with_parallel_layer(rng):
    x = _inputs(rng)
    layer = _layer("elu")
    cell = LinearAttentionCell(layer)
    rnn = keras.layers.RNN(cell, return_sequences=True)
    rnn(x)
    assert {id(v) for v in rnn.trainable_weights} == {id(v) for v in layer.trainable_weights}
    target = rng.normal(size=(2, T, DIM)).astype("float32")

    def grads(fn):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((fn() - target) ** 2)
        return tape.gradient(loss, layer.trainable_weights)

    g_rnn = grads(lambda: rnn(x))
    g_par = grads(lambda: layer(x, x, use_causal_mask=True))
    # A weight's gradient adds the sum over the B*T positions that share it.
    n = _n_output(layer, T) + x.shape[0] * T
    whole = max(float(np.abs(np.asarray(g)).max()) for g in g_par)
    for w, a, b in zip(layer.trainable_weights, g_rnn, g_par, strict=True):
        # Conditioned by the whole gradient's scale over this weight's: its
        # absolute error is inherited from the whole backward pass.
        scale = float(np.abs(np.asarray(b)).max())
        assert scale > 0, w.path
        assert_close(a, b, n=n, conditioning=whole / scale, paths=2, what=w.path)


def test_cell_in_compiled_functional_model_and_saving(rng, tmp_path):
    x = _inputs(rng)
    layer = _layer("elu")
    inputs = keras.Input((None, DIM))
    outputs = keras.layers.RNN(LinearAttentionCell(layer), return_sequences=True)(inputs)
    model = keras.Model(inputs, outputs)
    expected = np.asarray(layer(x, x, use_causal_mask=True))
    compiled = tf.function(model, jit_compile=True)
    # The XLA-compiled recurrence against the eager parallel layer: two float32 computations.
    n = _n_output(layer, T)
    assert_close(compiled(x), expected, n=n, paths=2, what="XLA")
    path = os.path.join(tmp_path, "rnn.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert_close(restored(x), expected, n=n, paths=2, what="restored")


def test_rnn_initial_state_resumes_parallel_state(rng):
    x = _inputs(rng, length=10)
    layer = _layer("elu")
    cell = LinearAttentionCell(layer)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    _, state = layer(x[:, :6], x[:, :6], use_causal_mask=True, return_state=True)
    rnn = keras.layers.RNN(cell, return_sequences=True)
    tail = rnn(x[:, 6:], initial_state=cell.pack_state(state))
    assert_close(tail, full[:, 6:], n=_n_output(layer, x.shape[1]), paths=2)  # S = 10 keys at most
    s, z = cell.unpack_state(cell.pack_state(state))
    np.testing.assert_array_equal(s, state[0])
    np.testing.assert_array_equal(z, state[1])


def test_step_is_causal_and_state_batch_independent(rng):
    x = _inputs(rng)
    layer = _layer("elu")
    a, _ = run_steps(layer, x, self_attention=True)
    x2 = x.copy()
    x2[1] = rng.normal(size=x2[1].shape)  # change the other batch row
    b, _ = run_steps(layer, x2, self_attention=True)
    np.testing.assert_array_equal(a[0], b[0])


def test_bad_state_and_inputs_raise():
    layer = _layer("elu")
    x_t = np.zeros((2, DIM), "float32")
    good = layer.get_initial_state(2)
    with pytest.raises(ValueError, match="state"):
        layer.step(x_t, x_t, (good[0][:, :1], good[1]))
    with pytest.raises(ValueError, match="state"):
        layer.step(x_t, x_t, layer.get_initial_state(3))
    with pytest.raises(ValueError, match="state"):
        layer.step(x_t, x_t, good[0])
    with pytest.raises(ValueError, match="query_t"):
        layer.step(np.zeros((2, 1, DIM), "float32"), x_t, good)
    with pytest.raises(ValueError, match="attention"):
        LinearAttentionCell(keras.layers.Dense(3))
    cell = LinearAttentionCell(layer)
    with pytest.raises(ValueError, match=r"states\[0\]"):
        cell.unpack_state([np.zeros((2, 5), "float32"), np.zeros((2, layer.num_heads * layer.feature_dim))])


def test_cell_config_round_trip(rng):
    layer = _layer("taylor")
    cell = LinearAttentionCell(layer, name="cell")
    config = cell.get_config()
    clone = LinearAttentionCell.from_config(config)
    assert clone.get_config() == config
    assert clone.state_size == cell.state_size == [2 * 21 * 4, 2 * 21]


def test_cell_keeps_float32_state_under_mixed_precision(rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    x = _inputs(rng)
    layer = _layer("elu")
    cell = LinearAttentionCell(layer)
    assert cell.compute_dtype == "float32" and layer.compute_dtype == "bfloat16"
    # keras.layers.RNN casts the states it returns to its own compute dtype:
    # a float32 RNN hands them back as accumulated (float32 inside the loop).
    rnn = keras.layers.RNN(cell, return_sequences=True, return_state=True, dtype="float32")
    outputs, s_flat, z_flat = rnn(x)
    assert keras.backend.standardize_dtype(s_flat.dtype) == "float32"
    parallel, (s, _) = layer(x, x, use_causal_mask=True, return_state=True)
    # Both sides run the layer's projections in bfloat16 (paths=2); the
    # attention accumulates in float32, whose S + C terms round at float32's
    # eps, negligible next to bfloat16's. The state sums bfloat16 keys and
    # values projected over DIM inputs; the outputs add the output projection.
    assert_close(np.reshape(s_flat, s.shape), s, n=DIM, dtype="mixed_bfloat16", paths=2, what="S")
    n = DIM + layer.num_heads * layer.value_dim  # DIM input projection + H*M output projection
    assert_close(outputs, parallel, n=n, dtype="mixed_bfloat16", paths=2, what="outputs")
