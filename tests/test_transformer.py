"""LinearTransformerDecoder / LinearTransformerEncoder: parallel vs recurrent, masks, gradients, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.layers import LinearTransformerDecoder, LinearTransformerEncoder
from tests._helpers import run_steps
from tests.conftest import rel_err

DIM = 8
T = 7
FEATURE_MAPS = feature_maps.available()


def _block(cls, feature_map="elu", **kwargs):
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("intermediate_dim", 16)
    kwargs.setdefault("chunk_size", 3)
    block = cls(feature_map=feature_map, **kwargs)
    block.build((None, None, DIM))
    return block


def _reference_block(block, x, causal, key_mask=None):
    """The block's maths with its own weights and the quadratic attention oracle."""
    att = block.attention
    h = block._attention_norm(x)
    q, k, v = att.project(h, h)
    qf = att.feature_map(q, is_query=True, causal=causal)
    kf = att.feature_map(k, is_query=False, causal=causal)
    a = att.output_dense(lops.kernel_attention_reference(qf, kf, v, causal=causal, key_mask=key_mask))
    x = x + a
    f = block._ffn_output(block._ffn_intermediate(block._ffn_norm(x)))
    return x + f


@pytest.mark.parametrize("cls,causal", [(LinearTransformerDecoder, True), (LinearTransformerEncoder, False)])
def test_block_matches_oracle_outputs_and_gradients(rng, cls, causal):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[1, 5:] = False
    block = _block(cls)
    target = rng.normal(size=x.shape).astype("float32")

    def loss_and_grads(fn):
        with tf.GradientTape() as tape:
            y = fn()
            loss = tf.reduce_sum(tf.where(mask[..., None], (y - target) ** 2, 0.0))
        return y, tape.gradient(loss, block.trainable_weights)

    y, g = loss_and_grads(lambda: block(x, padding_mask=mask))
    y_ref, g_ref = loss_and_grads(lambda: _reference_block(block, x, causal, key_mask=mask))
    assert rel_err(np.where(mask[..., None], y, 0), np.where(mask[..., None], y_ref, 0)) <= 1e-5
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_decoder_step_matches_parallel(rng, feature_map):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder, feature_map)
    parallel, (s, z) = block(x, return_state=True)
    stepped, (s_step, z_step) = run_steps(block, x)
    assert rel_err(stepped, parallel) <= 1e-5
    assert rel_err(s_step, s) <= 1e-5
    assert rel_err(z_step, z) <= 1e-5


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_encoder_step_is_streaming_encoding(rng, feature_map):
    x = rng.normal(size=(2, 5, DIM)).astype("float32")
    block = _block(LinearTransformerEncoder, feature_map)
    q, k, _ = block.attention.project(x, x)
    fm = block.attention.feature_map
    kernel = np.einsum("bthc,bshc->bhts", fm(q, is_query=True), fm(k, is_query=False))
    if kernel.min() < 0:
        # The non-causal path normalizes keys with a per-sequence constant that
        # cancels in out = num / den, except where a signed kernel drives den
        # below the epsilon guard; there the two forms legitimately differ.
        pytest.skip(f"{feature_map} has a signed kernel (min {kernel.min():.3g})")
    stepped, _ = run_steps(block, x)
    for t in range(x.shape[1]):
        prefix = np.asarray(block(x[:, : t + 1]))
        assert rel_err(stepped[:, t], prefix[:, t]) <= 1e-5


def test_decoder_prefill_steps_and_resume(rng):
    x = rng.normal(size=(2, 10, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    full = np.asarray(block(x))
    head, state = block(x[:, :4], return_state=True)
    mid, state = block(x[:, 4:7], return_state=True, initial_state=state)
    tail, _ = run_steps(block, x[:, 7:], state)
    assert rel_err(np.concatenate([head, mid, tail], axis=1), full) <= 1e-5


def test_decoder_never_sees_the_future(rng):
    x = rng.normal(size=(2, 12, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    a = np.asarray(block(x))
    x2 = x.copy()
    x2[:, 8:] = rng.normal(size=x2[:, 8:].shape)
    b = np.asarray(block(x2))
    np.testing.assert_array_equal(a[:, :8], b[:, :8])


def test_decoder_left_padding_matches_unpadded(rng):
    x = rng.normal(size=(1, 6, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    plain = np.asarray(block(x))
    padded = np.concatenate([rng.normal(size=(1, 3, DIM)).astype("float32"), x], axis=1)
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]], bool)
    out, state = block(padded, padding_mask=mask, return_state=True)
    assert rel_err(np.asarray(out)[:, 3:], plain) <= 1e-5
    _, state_plain = block(x, return_state=True)
    assert rel_err(state[0], state_plain[0]) <= 1e-5


def test_encoder_padding_is_ignored(rng):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[0, 4:] = False
    block = _block(LinearTransformerEncoder)
    out = np.asarray(block(x, padding_mask=mask))
    alone = np.asarray(block(x[:1, :4]))
    assert rel_err(out[0, :4], alone[0]) <= 1e-5
    x2 = x.copy()
    x2[0, 4:] = 100.0
    np.testing.assert_allclose(np.asarray(block(x2, padding_mask=mask))[0, :4], out[0, :4], rtol=0, atol=1e-6)


def test_keras_mask_is_used_as_padding_mask(rng):
    ids = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    emb = keras.layers.Embedding(8, DIM, mask_zero=True)
    block = _block(LinearTransformerEncoder)
    with_keras_mask = np.asarray(block(emb(ids)))
    explicit = np.asarray(block(emb(ids), padding_mask=ids != 0))
    np.testing.assert_allclose(with_keras_mask, explicit, rtol=0, atol=1e-6)


def test_dropout_only_in_training(rng):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder, dropout=0.5, seed=1)
    np.testing.assert_array_equal(block(x, training=False), block(x))
    assert np.abs(np.asarray(block(x, training=True)) - np.asarray(block(x))).max() > 1e-3


@pytest.mark.parametrize("cls", [LinearTransformerDecoder, LinearTransformerEncoder])
def test_config_and_keras_saving(rng, tmp_path, cls):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = cls(num_heads=2, intermediate_dim=16, feature_map="taylor", key_dim=2, dropout=0.1, name="blk")
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, block(inputs))
    expected = np.asarray(model(x))
    path = os.path.join(tmp_path, "block.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(restored(x), expected, rtol=0, atol=1e-6)
    config = block.get_config()
    assert cls.from_config(config).get_config() == config


def test_xla_fit_runs_and_reduces_loss(rng):
    x = rng.normal(size=(16, T, DIM)).astype("float32")
    y = np.roll(x, 1, axis=1)
    inputs = keras.Input((T, DIM))
    model = keras.Model(inputs, _block(LinearTransformerDecoder)(inputs))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    history = model.fit(x, y, epochs=5, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_bad_arguments_raise(rng):
    with pytest.raises(ValueError, match="intermediate_dim"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=4, dropout=1.5)
    with pytest.raises(ValueError, match="num_heads"):
        LinearTransformerDecoder(num_heads=3, intermediate_dim=4).build((None, None, DIM))
    with pytest.raises(ValueError, match="batch_size"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=4).get_initial_state(2)
    block = _block(LinearTransformerDecoder)
    state = block.get_initial_state(2)
    with pytest.raises(ValueError, match="inputs_t"):
        block.step(np.zeros((2, 1, DIM), "float32"), state)
    with pytest.raises(ValueError, match="inputs_t"):
        block.step(np.zeros((2, DIM + 1), "float32"), state)
    with pytest.raises(ValueError, match="state"):
        block.step(np.zeros((3, DIM), "float32"), state)
    with pytest.raises(ValueError, match="padding_mask"):
        block(np.zeros((2, T, DIM), "float32"), padding_mask=np.ones((2, T, 1)))
