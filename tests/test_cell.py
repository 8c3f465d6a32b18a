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
from tests._helpers import run_steps
from tests.conftest import rel_err

DIM = 8
T = 7  # not a multiple of the chunk length
CHUNK = 3
FEATURE_MAPS = feature_maps.available()


def _layer(feature_map="elu", **kwargs):
    layer = LinearAttention(num_heads=2, key_dim=4, feature_map=feature_map, chunk_size=CHUNK, **kwargs)
    layer.build((None, None, DIM), (None, None, DIM))
    return layer


def _inputs(rng, batch=2, length=T):
    return rng.normal(size=(batch, length, DIM)).astype("float32")


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_step_matches_parallel_causal(rng, feature_map):
    x = _inputs(rng)
    layer = _layer(feature_map)
    parallel = np.asarray(layer(x, x, use_causal_mask=True))
    stepped, (s, z) = run_steps(layer, x, self_attention=True)
    assert rel_err(stepped, parallel) <= 1e-5
    # The final recurrent state is the parallel path's returned state.
    _, (s_par, z_par) = layer(x, x, use_causal_mask=True, return_state=True)
    assert rel_err(s, s_par) <= 1e-5
    assert rel_err(z, z_par) <= 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_prefill_then_steps_matches_one_pass(rng, feature_map):
    x = _inputs(rng, length=9)
    layer = _layer(feature_map)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    head, state = layer(x[:, :5], x[:, :5], use_causal_mask=True, return_state=True)
    tail, _ = run_steps(layer, x[:, 5:], state, self_attention=True)
    assert rel_err(np.asarray(head), full[:, :5]) <= 1e-5
    assert rel_err(tail, full[:, 5:]) <= 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_split_and_resume_matches_one_pass(rng, feature_map):
    x = _inputs(rng, length=11)
    layer = _layer(feature_map)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    pieces, state = [], None
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        y, state = layer(x[:, lo:hi], x[:, lo:hi], use_causal_mask=True, return_state=True, initial_state=state)
        pieces.append(np.asarray(y))
    assert rel_err(np.concatenate(pieces, axis=1), full) <= 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_cell_in_keras_rnn_matches_parallel_layer(rng, feature_map):
    x = _inputs(rng)
    layer = _layer(feature_map)
    rnn = keras.layers.RNN(LinearAttentionCell(layer), return_sequences=True, return_state=True)
    outputs, s_flat, z_flat = rnn(x)
    parallel, (s, z) = layer(x, x, use_causal_mask=True, return_state=True)
    assert rel_err(outputs, parallel) <= 1e-5
    assert rel_err(np.reshape(s_flat, s.shape), s) <= 1e-5
    assert rel_err(np.reshape(z_flat, z.shape), z) <= 1e-5


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
    for a, b in zip(g_rnn, g_par):
        assert rel_err(a, b) <= 1e-5


def test_cell_in_compiled_functional_model_and_saving(rng, tmp_path):
    x = _inputs(rng)
    layer = _layer("elu")
    inputs = keras.Input((None, DIM))
    outputs = keras.layers.RNN(LinearAttentionCell(layer), return_sequences=True)(inputs)
    model = keras.Model(inputs, outputs)
    expected = np.asarray(layer(x, x, use_causal_mask=True))
    compiled = tf.function(model, jit_compile=True)
    assert rel_err(compiled(x), expected) <= 1e-5
    path = os.path.join(tmp_path, "rnn.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert rel_err(restored(x), expected) <= 1e-5


def test_rnn_initial_state_resumes_parallel_state(rng):
    x = _inputs(rng, length=10)
    layer = _layer("elu")
    cell = LinearAttentionCell(layer)
    full = np.asarray(layer(x, x, use_causal_mask=True))
    _, state = layer(x[:, :6], x[:, :6], use_causal_mask=True, return_state=True)
    rnn = keras.layers.RNN(cell, return_sequences=True)
    tail = rnn(x[:, 6:], initial_state=cell.pack_state(state))
    assert rel_err(tail, full[:, 6:]) <= 1e-5
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
    assert rel_err(np.reshape(s_flat, s.shape), s) <= 1e-5
    assert rel_err(outputs, parallel) <= 5e-2
