"""Multi-query associative recall (MQAR), after Zoology (Arora, Eyuboglu et al. 2023).

A sequence of length T starts with ``P = num_kv_pairs`` key-value pairs
``k_1 v_1 k_2 v_2 ... k_P v_P`` (keys distinct, values distinct), keys drawn
from the lower half of the vocabulary ``[1, V/2)`` and values from the upper
half ``[V/2, V)``. The rest of the sequence has ``(T - 2P) / 2`` slots at even
offsets after the context; each key is repeated once as a query in one of
them. Query slots are drawn without replacement with Zoology's power law,
``p(gap i) ∝ a * i^(a - 1)`` for ``i = 1 .. slots`` (``a = power_a``, default
0.01: queries crowd towards the start of the free space, as repeated bigrams
do in text). Every other position holds a uniformly random token of the whole
vocabulary (Zoology's ``random_non_queries``).

Labels are next-token targets aligned with the inputs: position t's label is
what the model must output at t. It is the value bound to the key at a query
position and `IGNORE` (-100) everywhere else, so only queries are scored.

Example (V = 16, T = 16, P = 2; ``.`` = random filler)::

    inputs   3 12  5  9  .  .  5  .  .  .  3  .  .  .  .  .
    labels   -  -  -  -  -  -  9  -  -  -  12 -  -  -  -  -

Zoology's defaults are V = 8192, 100k training and 3k test examples; the
benchmark here uses smaller vocabularies (see `benchmarks.bench_quality`).
"""

import numpy as np

#: Label of the positions that are not scored.
IGNORE = -100


def query_gap_probabilities(num_slots, power_a=0.01):
    """Zoology's power law over query slots: ``p_i ∝ a * i^(a-1)``, ``i = 1 .. num_slots`` (sums to 1)."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
        raise ValueError(f"`num_slots` must be a positive integer. Received: num_slots={num_slots!r}")
    if not 0.0 < power_a <= 1.0:
        raise ValueError(f"`power_a` must be in (0, 1]. Received: power_a={power_a!r}")
    i = np.arange(1, num_slots + 1, dtype=np.float64)
    p = power_a * i ** (power_a - 1.0)
    return p / p.sum()


def check_config(sequence_length, num_kv_pairs, vocabulary_size):
    """Raises ValueError unless (T, P, V) make a valid MQAR task (see `generate`)."""
    for name, value in (
        ("sequence_length", sequence_length),
        ("num_kv_pairs", num_kv_pairs),
        ("vocabulary_size", vocabulary_size),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    if sequence_length % 2:
        raise ValueError(f"`sequence_length` must be even. Received: sequence_length={sequence_length}")
    if 4 * num_kv_pairs > sequence_length:
        raise ValueError(
            "The context (2 * num_kv_pairs tokens) and the queries (num_kv_pairs slots of 2 tokens) must fit: "
            f"4 * num_kv_pairs <= sequence_length. Received: num_kv_pairs={num_kv_pairs}, "
            f"sequence_length={sequence_length}"
        )
    if vocabulary_size // 2 - 1 < num_kv_pairs:
        raise ValueError(
            f"The key half [1, V/2) must hold num_kv_pairs distinct keys. Received: vocabulary_size="
            f"{vocabulary_size}, num_kv_pairs={num_kv_pairs}"
        )


def generate(num_examples, sequence_length, num_kv_pairs, vocabulary_size, seed, power_a=0.01, random_non_queries=True):
    """MQAR examples (see the module docstring).

    Args:
        num_examples: number of sequences N.
        sequence_length: T (even).
        num_kv_pairs: P key-value pairs per sequence (``4 P <= T``).
        vocabulary_size: V; keys come from ``[1, V/2)``, values from ``[V/2, V)``.
        seed: seed of a `numpy.random.Generator`; the same seed gives the same data.
        power_a: exponent of the query-placement power law (1.0 = uniform).
        random_non_queries: fill the non-query positions after the context with
            random tokens (True, Zoology's default) or with 0.

    Returns:
        ``(inputs [N, T] int32, labels [N, T] int32)``; labels are `IGNORE`
        except at the P query positions of each row.
    """
    check_config(sequence_length, num_kv_pairs, vocabulary_size)
    if isinstance(num_examples, bool) or not isinstance(num_examples, (int, np.integer)) or num_examples < 1:
        raise ValueError(f"`num_examples` must be a positive integer. Received: num_examples={num_examples!r}")
    rng = np.random.default_rng(seed)
    n, t, p, v = num_examples, sequence_length, num_kv_pairs, vocabulary_size
    half = v // 2
    # P distinct keys from [1, V/2) and P distinct values from [V/2, V) per row: the first P of a random
    # permutation (argsort of uniform noise), vectorized over rows.
    keys = 1 + np.argsort(rng.random((n, half - 1)), axis=1)[:, :p]  # [N, P]
    values = half + np.argsort(rng.random((n, v - half)), axis=1)[:, :p]  # [N, P]
    context = 2 * p
    slots = (t - context) // 2
    probs = query_gap_probabilities(slots, power_a)
    # P distinct slots per row drawn with probabilities `probs` (without replacement): Gumbel top-k.
    scores = np.log(probs)[None] - np.log(-np.log(rng.random((n, slots))))  # [N, slots]
    gaps = np.argsort(-scores, axis=1)[:, :p]  # [N, P], gap j of key j
    if random_non_queries:
        inputs = rng.integers(0, v, size=(n, t))
    else:
        inputs = np.zeros((n, t), dtype=np.int64)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    query_pos = context + 2 * gaps  # [N, P]
    rows = np.arange(n)[:, None]
    inputs[rows, query_pos] = keys
    labels = np.full((n, t), IGNORE, dtype=np.int64)
    labels[rows, query_pos] = values
    return inputs.astype(np.int32), labels.astype(np.int32)


def chance_accuracy(num_kv_pairs, vocabulary_size):
    """Two reference accuracies of a model that does not recall.

    Returns:
        ``{"uniform_value": 1 / |values|, "in_context_value": 1 / P}``: a model
        that knows only that the answer is a value token (the best guess
        without looking at the context) scores ``1 / (V - V/2)``; one that
        picks one of the P values seen in the sequence at random scores ``1 / P``.
    """
    check_config(4 * num_kv_pairs, num_kv_pairs, vocabulary_size)
    return {"uniform_value": 1.0 / (vocabulary_size - vocabulary_size // 2), "in_context_value": 1.0 / num_kv_pairs}
