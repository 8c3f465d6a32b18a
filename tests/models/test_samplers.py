"""Samplers: the distributions they draw from, determinism under a seed, registry and errors."""

import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import samplers

LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], "float32"))
N = 40000  # rows drawn in one call
# Statistical bound: a frequency over N independent draws has standard error
# sqrt(p (1 - p) / N) (at most 0.0025 here); K = 5 standard errors are
# exceeded with probability < 6e-7 per token (the seeds are fixed anyway).
K = 5


def _frequencies(sampler, logits=LOGITS, seed=(3, 4)):
    batch = np.tile(logits[None], (N, 1))
    ids = np.asarray(sampler(batch, seed=tf.constant(seed, "int32")))
    return np.bincount(ids, minlength=len(logits)) / N


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_frequencies(freq, p):
    """Each empirical frequency within K standard errors of its probability ``p``
    (a token of probability 0 must never be drawn)."""
    p = np.asarray(p, np.float64)
    tolerance = K * np.sqrt(p * (1 - p) / N)
    assert (np.abs(freq - p) <= tolerance).all(), (freq, p, tolerance)


def test_greedy_is_argmax(rng):
    logits = rng.normal(size=(6, 11)).astype("float32")
    np.testing.assert_array_equal(samplers.get("greedy")(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_random_sampler_matches_softmax_with_temperature(temperature):
    freq = _frequencies(samplers.RandomSampler(temperature=temperature))
    _assert_frequencies(freq, _softmax(LOGITS.astype(np.float64) / temperature))


def test_top_k_matches_renormalized_top_k():
    freq = _frequencies(samplers.TopKSampler(k=2))
    _assert_frequencies(freq, np.array([0.4, 0.3, 0, 0, 0]) / 0.7)


def test_top_p_matches_nucleus():
    # Mass before token i: 0, .4, .7, .85, .95 -> p=0.75 keeps the first three.
    freq = _frequencies(samplers.TopPSampler(p=0.75))
    _assert_frequencies(freq, np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85)
    capped = _frequencies(samplers.TopPSampler(p=0.75, k=2))
    _assert_frequencies(capped, np.array([0.4, 0.3, 0, 0, 0]) / 0.7)


def test_degenerate_settings_are_greedy(rng):
    logits = rng.normal(size=(8, 13)).astype("float32")
    seed = tf.constant([1, 2], "int32")
    for sampler in (samplers.TopKSampler(k=1), samplers.TopPSampler(p=1e-6), samplers.RandomSampler(temperature=1e-4)):
        np.testing.assert_array_equal(sampler(logits, seed=seed), logits.argmax(-1))


def test_seed_determinism_inside_xla(rng):
    logits = rng.normal(size=(16, 50)).astype("float32")
    sampler = samplers.get("top_p", p=0.9, temperature=1.5)
    fn = tf.function(lambda x, s: sampler(x, seed=s), jit_compile=True)
    a = np.asarray(fn(logits, tf.constant([5, 6])))
    np.testing.assert_array_equal(a, fn(logits, tf.constant([5, 6])))
    assert (a != np.asarray(fn(logits, tf.constant([5, 7])))).any()


def test_registry_and_serialization():
    assert samplers.available() == ["greedy", "random", "top_k", "top_p"]
    for sampler in (
        samplers.get("top_k", k=3, temperature=0.5),
        samplers.TopPSampler(p=0.8, k=4),
        samplers.GreedySampler(),
    ):
        clone = samplers.deserialize(samplers.serialize(sampler))
        assert type(clone) is type(sampler) and clone.get_config() == sampler.get_config()
        assert samplers.get(samplers.serialize(sampler)).get_config() == sampler.get_config()
        assert samplers.get(sampler) is sampler


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="sampler"):
        samplers.get("beam")
    with pytest.raises(ValueError, match="sampler"):
        samplers.get(3)
    with pytest.raises(ValueError, match="temperature"):
        samplers.RandomSampler(temperature=0)
    with pytest.raises(ValueError, match="k"):
        samplers.TopKSampler(k=0)
    with pytest.raises(ValueError, match="p"):
        samplers.TopPSampler(p=1.5)
    with pytest.raises(ValueError, match="seed"):
        samplers.RandomSampler()(LOGITS[None])
    with pytest.raises(ValueError, match="logits"):
        samplers.GreedySampler()(LOGITS)
    with pytest.raises(ValueError, match="kwargs"):
        samplers.get(samplers.GreedySampler(), temperature=2.0)
