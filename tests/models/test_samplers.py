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
    with pytest.raises(ValueError, match="temperature=-1"):  # 0 is greedy: tests/contracts/test_sampler_settings.py
        samplers.RandomSampler(temperature=-1)
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


# ------------------------------------------------ the noise at its extremes
# Seeds [0, t] whose hash reaches the largest 23-bit value (top bits all ones) somewhere in a
# [16, 128256] draw: (t, row, column), found by scanning t = 0..99 with `samplers._hash_bits`
# (the top 23 of its 32 bits all ones).
# Until the 23-bit mapping, these entries were exactly 1.0 in float32: Gumbel noise +inf,
# NaN on a filtered (-inf) logit, and the id 128256 (= V) from a top-k draw.
LLAMA_VOCAB, EXTREME_ROWS = 128256, 16
EXTREME_SEEDS = [(15, 14, 118788), (30, 15, 64330), (33, 2, 29030), (86, 3, 125598)]


def test_uniform_from_bits_every_value_exact_centred_and_inside_the_open_interval():
    m = np.arange(2**samplers.UNIFORM_BITS, dtype=np.int32)  # all 2^23 values
    u = np.asarray(samplers.uniform_from_bits(m))
    assert u.dtype == np.float32
    np.testing.assert_array_equal(u.astype(np.float64), (2.0 * m + 1.0) / 2.0**24)  # exact: centred in each bin
    assert u[0] == 2.0**-24 and u[-1] == 1.0 - 2.0**-24
    assert (np.diff(u) > 0).all()  # strictly increasing: no two bit patterns share a value
    gumbel = np.asarray(samplers.gumbel_noise(u))
    assert np.isfinite(gumbel).all(), (gumbel.min(), gumbel.max())
    assert (np.diff(gumbel) >= 0).all()  # monotone in u
    assert -2.82 < gumbel.min() and gumbel.max() < 17.34


@pytest.mark.parametrize("jit_compile", [False, True])
def test_uniform_noise_never_reaches_1_at_the_extreme_hash(jit_compile):
    t, row, column = EXTREME_SEEDS[0]
    seed = tf.constant([0, t], "int32")
    shape = (EXTREME_ROWS, LLAMA_VOCAB)
    noise = tf.function(lambda s: samplers.uniform_noise(s, shape), jit_compile=jit_compile)
    u = np.asarray(noise(seed))
    assert u[row, column] == u.max() == np.float32(1.0 - 2.0**-24)  # the largest value, never 1.0
    assert 0.0 < u.min()
    gumbel = np.asarray(tf.function(samplers.gumbel_noise, jit_compile=jit_compile)(u))
    assert np.isfinite(gumbel).all(), gumbel[row, column]


def test_top_k_draws_at_a_128k_vocabulary_are_all_in_range():
    """Millions of draws (16 rows x 128,256 x 6 seeds, four of them at the extreme of the noise)
    with top-k 50, so that almost every logit is -inf: every id is one of the row's top 50.

    In a TensorFlow graph, where a NaN row gave the id V (XLA picked a valid token there)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((EXTREME_ROWS, LLAMA_VOCAB)).astype("float32")
    top50 = np.argsort(-logits, axis=1)[:, :50]
    draw = tf.function(lambda x, s: samplers.sample(x, s, 1.0, 50, 1.0))
    for t in [t for t, _, _ in EXTREME_SEEDS] + [0, 1]:
        ids = np.asarray(draw(logits, tf.constant([0, t], "int32")))
        assert ((ids >= 0) & (ids < LLAMA_VOCAB)).all(), (t, ids)
        assert all(ids[r] in top50[r] for r in range(EXTREME_ROWS)), t


# ---------------------------------------------------- non-finite logits
def _poisoned_logits(rng):
    """Rows 0 and 5 normal (row 5 with -inf logits beside finite ones); rows 1-4 have no distribution."""
    logits = rng.normal(size=(6, 12)).astype("float32")
    logits[1, 7] = np.nan  # one NaN
    logits[2, 3] = np.inf  # one +inf
    logits[3, :] = -np.inf  # every logit -inf
    logits[4, :] = np.nan  # every logit NaN
    logits[5, ::2] = -np.inf  # masked tokens: normal
    return logits


BAD_ROWS = [1, 2, 3, 4]


def test_nonfinite_rows():
    logits = _poisoned_logits(np.random.default_rng(0))
    assert np.asarray(samplers.nonfinite_rows(logits)).tolist() == [False, True, True, True, True, False]
    assert samplers.INVALID_TOKEN == -1


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize(
    "sampler",
    [
        samplers.get("greedy"),
        samplers.get("random", temperature=0.8),
        samplers.get("top_k", k=3),
        samplers.get("top_p", p=0.7, temperature=1.3),
    ],
    ids=lambda s: type(s).__name__,
)
def test_nonfinite_rows_give_the_sentinel_and_other_rows_are_unchanged(rng, mode, sampler):
    logits = _poisoned_logits(rng)
    clean = logits.copy()
    clean[BAD_ROWS] = rng.normal(size=(len(BAD_ROWS), 12))
    seed = tf.constant([3, 9], "int32")
    call = lambda x, s: sampler(x, seed=s)  # noqa: E731
    if mode != "eager":
        call = tf.function(call, jit_compile=mode == "xla")
    ids = np.asarray(call(logits, seed))
    assert ids[BAD_ROWS].tolist() == [-1] * len(BAD_ROWS)  # the sentinel, samplers.INVALID_TOKEN
    np.testing.assert_array_equal(ids[[0, 5]], np.asarray(call(clean, seed))[[0, 5]])
    assert ids[5] % 2 == 1  # never a -inf token


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_sample_kernel_gives_the_sentinel_greedy_and_sampled(rng, mode):
    """`sample` with tensor settings (as in the exported graphs): temperature 0 is greedy."""
    logits = _poisoned_logits(rng)
    seed = tf.constant([5, 2], "int32")
    call = samplers.sample
    if mode != "eager":
        call = tf.function(call, jit_compile=mode == "xla")
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 4, 1.0), (1.2, 0, 0.6), (1.0, 3, 0.5)]:
        ids = np.asarray(call(logits, seed, tf.constant(temperature), tf.constant(top_k, "int32"), tf.constant(top_p)))
        assert ids[BAD_ROWS].tolist() == [-1] * len(BAD_ROWS), (temperature, top_k, top_p)
        assert 0 <= ids[0] < 12 and ids[5] % 2 == 1, (temperature, top_k, top_p, ids)


# Settings that rank all tokens (top-p), `k` of them (top-k alone) or one (nothing filters).
TENSOR_SETTINGS = [
    (0.0, 0, 1.0),
    (1.0, 0, 1.0),
    (0.7, 1, 1.0),
    (0.7, 4, 1.0),
    (1.3, 50, 1.0),
    (1.3, 57, 1.0),
    (1.2, 0, 0.6),
    (1.0, 3, 0.5),
    (0.9, 0, 0.999),
    (1.0, 60, 0.3),
]


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_sample_with_tensor_settings_draws_what_static_settings_draw(rng, mode):
    """The tensor-settings path (the exported graphs': it ranks only as many tokens as the settings read)
    against the static one (a full sort), on logits with ties, for many seeds."""
    logits = np.round(rng.normal(size=(16, 50)) * 2).astype("float32") / 2  # many ties
    call = samplers.sample
    if mode != "eager":
        call = tf.function(call, jit_compile=mode == "xla")
    for temperature, top_k, top_p in TENSOR_SETTINGS:
        for s in range(6):
            seed = tf.constant([s, 3 * s + 1], "int32")
            got = np.asarray(
                call(logits, seed, tf.constant(temperature), tf.constant(top_k, "int32"), tf.constant(top_p))
            )
            if temperature == 0:
                expected = logits.argmax(-1)
            else:
                expected = np.asarray(samplers.sample(logits, seed, temperature, top_k, top_p))
            np.testing.assert_array_equal(got, expected, err_msg=str((temperature, top_k, top_p, s)))


def test_sample_with_tensor_settings_ranks_a_computed_number_of_tokens():
    """No sort over the whole vocabulary for settings that do not need one: the graph's one ranking op
    takes its size from the settings (a guard against a full sort on every token of greedy decoding)."""
    fn = tf.function(samplers.sample).get_concrete_function(
        tf.TensorSpec((None, 1000), tf.float32),
        tf.TensorSpec((2,), tf.int32),
        tf.TensorSpec((), tf.float32),
        tf.TensorSpec((), tf.int32),
        tf.TensorSpec((), tf.float32),
    )
    ranking = [op for op in fn.graph.get_operations() if op.type in ("TopKV2", "TopK")]
    assert len(ranking) == 1 and ranking[0].inputs[1].op.type != "Const", ranking
