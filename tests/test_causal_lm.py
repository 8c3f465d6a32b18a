"""LinearCausalLM: parallel vs recurrent logits, state resume, generate() vs parallel greedy decoding."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps, samplers
from keras_linattn.models import LinearCausalLM
from tests._helpers import run_steps
from tests.conftest import rel_err

VOCAB = 23
FEATURE_MAPS = feature_maps.available()


def _lm(feature_map="elu", **kwargs):
    kwargs.setdefault("num_layers", 2)
    kwargs.setdefault("hidden_dim", 8)
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("intermediate_dim", 16)
    kwargs.setdefault("chunk_size", 3)
    return LinearCausalLM(vocabulary_size=VOCAB, feature_map=feature_map, **kwargs)


def _ids(rng, batch=2, length=7):
    return rng.integers(1, VOCAB, size=(batch, length)).astype("int32")


def _parallel_greedy(lm, prompt, max_length):
    """Reference decoding: the parallel model on the growing sequence, argmax each time."""
    seq = prompt
    while seq.shape[1] < max_length:
        nxt = np.asarray(lm(seq))[:, -1].argmax(-1).astype("int32")
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_step_matches_parallel_for_every_feature_map(rng, feature_map):
    ids = _ids(rng)
    lm = _lm(feature_map)
    parallel = np.asarray(lm(ids))
    stepped, _ = run_steps(lm, ids)
    assert rel_err(stepped, parallel) <= 1e-5


@pytest.mark.parametrize("max_sequence_length", [None, 16])
def test_prefill_steps_and_resume_match_one_pass(rng, max_sequence_length):
    ids = _ids(rng, length=11)
    lm = _lm(max_sequence_length=max_sequence_length)
    full = np.asarray(lm(ids))
    state = lm.get_initial_state(2)
    head, state = lm.call_with_state(ids[:, :4], state)
    mid, state = lm.call_with_state(ids[:, 4:8], state)
    tail, state = run_steps(lm, ids[:, 8:], state)
    assert rel_err(np.concatenate([head, mid, tail], axis=1), full) <= 1e-5
    np.testing.assert_array_equal(state[-1], [11, 11])
    stepped, _ = run_steps(lm, ids)
    assert rel_err(stepped, full) <= 1e-5


def test_recurrent_gradients_match_parallel(rng):
    ids = _ids(rng, length=6)
    lm = _lm()

    def grads(fn):
        with tf.GradientTape() as tape:
            logits = fn()
            loss = tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(ids[:, 1:], logits[:, :-1], from_logits=True)
            )
        return tape.gradient(loss, lm.trainable_weights)

    def stepped():
        state, outs = lm.get_initial_state(2), []
        for t in range(ids.shape[1]):
            logits, state = lm.step(ids[:, t], state)
            outs.append(logits)
        return tf.stack(outs, axis=1)

    # Some gradients (e.g. of the query biases, |g| ~ 1e-5) are tiny sums of
    # larger terms; the two summation orders differ there by float32 rounding
    # (seen: 1.5e-5 relative), so gradients get 1e-4, outputs 1e-5.
    for a, b in zip(grads(lambda: lm(ids)), grads(stepped)):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("feature_map", ["elu", "taylor"])
@pytest.mark.parametrize("max_sequence_length", [None, 20])
def test_greedy_generate_equals_parallel_argmax_decoding(rng, feature_map, max_sequence_length):
    lm = _lm(feature_map, max_sequence_length=max_sequence_length)
    prompt = _ids(rng, batch=3, length=4)
    out = lm.generate(prompt, max_length=15, sampler="greedy")
    np.testing.assert_array_equal(out, _parallel_greedy(lm, prompt, 15))
    # Block-wise decoding with a progress bar gives the same tokens.
    np.testing.assert_array_equal(lm.generate(prompt, max_length=15, verbose=True, block_size=4), out)


@pytest.mark.parametrize("max_sequence_length", [None, 20])
def test_left_padded_prompts_generate_like_unpadded(rng, max_sequence_length):
    lm = _lm(max_sequence_length=max_sequence_length)
    long_prompt = _ids(rng, batch=1, length=5)
    short_prompt = _ids(rng, batch=1, length=2)
    batch = np.concatenate([long_prompt, np.concatenate([[[0, 0, 0]], short_prompt], axis=1)]).astype("int32")
    mask = batch != 0  # prompts hold ids >= 1
    out = lm.generate(batch, max_length=12, padding_mask=mask)
    np.testing.assert_array_equal(out[0], lm.generate(long_prompt, max_length=12)[0])
    np.testing.assert_array_equal(out[1, 3:], lm.generate(short_prompt, max_length=9)[0])


def test_stop_tokens_pad_finished_rows(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=3)
    free = lm.generate(prompt, max_length=14)
    stop = int(free[0, 5])
    out = lm.generate(prompt, max_length=14, stop_token_ids=[stop], pad_token_id=VOCAB + 5)
    assert (out[0] == VOCAB + 5).any()
    for row in range(2):
        hits = np.flatnonzero(free[row, 3:] == stop)  # generated positions only
        end = 3 + hits[0] + 1 if len(hits) else 14
        np.testing.assert_array_equal(out[row, :end], free[row, :end])
        assert (out[row, end:] == VOCAB + 5).all()


def test_seeded_sampling_is_reproducible(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=3)
    for sampler in ("random", "top_k", "top_p"):
        a = lm.generate(prompt, max_length=16, sampler=sampler, seed=7)
        b = lm.generate(prompt, max_length=16, sampler=sampler, seed=7)
        np.testing.assert_array_equal(a, b)
    c = lm.generate(prompt, max_length=16, sampler="random", seed=8)
    assert (c != a).any()
    hot = lm.generate(prompt, max_length=16, sampler=samplers.RandomSampler(temperature=1e-4), seed=3)
    np.testing.assert_array_equal(hot, lm.generate(prompt, max_length=16))


def test_generate_returns_prompt_when_nothing_to_generate(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=4)
    np.testing.assert_array_equal(lm.generate(prompt, max_length=4), prompt)


def test_save_and_load(rng, tmp_path):
    lm = _lm("taylor", max_sequence_length=32, tie_embeddings=False, key_dim=2)
    ids = _ids(rng)
    expected = np.asarray(lm(ids))
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored, LinearCausalLM)
    np.testing.assert_allclose(restored(ids), expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(restored.generate(ids[:, :3], 10), lm.generate(ids[:, :3], 10))
    assert restored.get_config() == lm.get_config()


def test_xla_fit_reduces_loss(rng):
    lm = _lm()
    ids = rng.integers(1, VOCAB, size=(16, 9)).astype("int32")
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    history = lm.fit(ids[:, :-1], ids[:, 1:], epochs=4, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_bad_inputs_raise(rng):
    lm = _lm(max_sequence_length=10)
    prompt = _ids(rng, batch=2, length=4)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.zeros((2, 0), "int32"), max_length=5)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.zeros((4,), "int32"), max_length=5)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.full((1, 2), VOCAB), max_length=5)
    with pytest.raises(ValueError, match="max_length"):
        lm.generate(prompt, max_length=3)
    with pytest.raises(ValueError, match="max_length"):
        lm.generate(prompt, max_length=11)
    with pytest.raises(ValueError, match="padding_mask"):
        lm.generate(prompt, max_length=6, padding_mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="padding_mask"):
        lm.generate(prompt, max_length=6, padding_mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="sampler"):
        lm.generate(prompt, max_length=6, sampler="beam")
    with pytest.raises(ValueError, match="token_ids"):
        lm(np.zeros((1, 11), "int32"))
    state = lm.get_initial_state(2)
    with pytest.raises(ValueError, match="state"):
        lm.step(prompt[:, 0], state[:-1])
    with pytest.raises(ValueError, match="state"):
        lm.step(prompt[:, 0], lm.get_initial_state(3))
    with pytest.raises(ValueError, match="state"):
        lm.call_with_state(prompt, [state[1], state[0]] + state[2:])
    with pytest.raises(ValueError, match="token_t"):
        lm.step(prompt, state)
    with pytest.raises(ValueError, match="hidden_dim"):
        LinearCausalLM(vocabulary_size=5, num_layers=1, hidden_dim=9, num_heads=2, intermediate_dim=4)


def test_mixed_precision_keeps_float32_state(rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    lm = _lm()
    ids = _ids(rng)
    parallel = np.asarray(lm(ids))
    stepped, state = run_steps(lm, ids)
    assert all(keras.backend.standardize_dtype(x.dtype) == "float32" for x in state[:-1])
    assert parallel.dtype == np.float32
    assert rel_err(stepped, parallel) <= 5e-2


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_save_and_load_every_feature_map(rng, tmp_path, feature_map):
    lm = _lm(feature_map, num_layers=1)
    ids = _ids(rng)
    # Move every weight off its initial value so a reload that re-initialized
    # anything (e.g. a feature map's kernel or random projection) would show.
    for w in lm.weights:
        w.assign(w + rng.normal(scale=0.05, size=w.shape).astype(w.dtype))
    expected = np.asarray(lm(ids))
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    restored = keras.models.load_model(path)
    np.testing.assert_allclose(restored(ids), expected, rtol=0, atol=1e-6)
