"""Long Range Arena ListOps, generated locally with LRA's rules.

An example is a nested expression over single digits, e.g.
``[MAX 2 9 [MIN 4 7 ] 0 ]`` (label 9), with four operators: ``MIN``,
``MAX``, ``MED`` (median, truncated to an int as ``int(np.median(...))``)
and ``SM`` (sum modulo 10). The label is the value of the expression (10
classes).

The random trees follow LRA's ``generate_tree``: at depth < ``max_depth`` a
node is a digit with probability 0.75, otherwise an operator over
``randint(2, max_args)`` sub-trees; at ``max_depth`` it is a digit. The
length of an example counts operator, digit and closing-bracket tokens (LRA's
``length``); LRA's parentheses carry no information and are not emitted.
Examples are drawn until their length lies in ``[min_length, max_length]``;
duplicates are skipped (LRA keeps a set of trees). A tree that grows past
``max_length`` is abandoned as soon as it does, which only saves time: it
would have been rejected anyway.

Everything is driven by one ``random.Random(seed)``: the same seed gives the
same examples.
"""

import random

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
VALUES = tuple(str(v) for v in range(10))
# Probability that a node above the maximum depth is an operator (LRA: VALUE_P = 0.25).
OPERATOR_PROBABILITY = 0.25
NUM_CLASSES = 10


class _TooLong(Exception):
    """Raised while growing a tree that already exceeds the length budget."""


def _median(values):
    s = sorted(values)
    n = len(s)
    mid = n // 2
    if n % 2:
        return s[mid]
    # int(np.median) truncates toward zero; all values are >= 0, so floor.
    return (s[mid - 1] + s[mid]) // 2


_APPLY = {
    "[MIN": min,
    "[MAX": max,
    "[MED": _median,
    "[SM": lambda values: sum(values) % 10,
}


def _grow(rng, depth, max_depth, max_args, budget, tokens):
    """Appends a random sub-tree's tokens to `tokens`; returns its value."""
    if depth < max_depth and rng.random() <= OPERATOR_PROBABILITY:
        num_args = rng.randint(2, max_args)
        # Children are drawn before the operator, as in LRA's generate_tree.
        start = len(tokens)
        tokens.append(None)  # Placeholder for the operator.
        values = [_grow(rng, depth + 1, max_depth, max_args, budget, tokens) for _ in range(num_args)]
        op = rng.choice(OPERATORS)
        tokens[start] = op
        tokens.append(CLOSE)
        if len(tokens) > budget:
            raise _TooLong
        return _APPLY[op](values)
    value = rng.randrange(10)
    tokens.append(VALUES[value])
    if len(tokens) > budget:
        raise _TooLong
    return value


def random_example(rng, min_length, max_length, max_depth=10, max_args=10):
    """Draws examples until one has a length in ``[min_length, max_length]``.

    Args:
        rng: a `random.Random`.
        min_length, max_length: inclusive token-length bounds.
        max_depth: maximum nesting depth (LRA: 10).
        max_args: maximum number of arguments of an operator (LRA: 10).

    Returns:
        ``(tokens, label)``: a list of token strings and the int value.
    """
    while True:
        tokens = []
        try:
            value = _grow(rng, 1, max_depth, max_args, max_length, tokens)
        except _TooLong:
            continue
        if len(tokens) >= min_length:
            return tokens, value


def _check(name, value, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")


def generate(num_examples, seed, min_length, max_length, max_depth=10, max_args=10):
    """Generates disjoint splits of unique ListOps examples.

    Args:
        num_examples: dict ``split name -> count``; splits are generated in
            the dict's order from one random stream, so the same dict and seed
            give the same splits, and no expression occurs twice across splits.
        seed: int seed.
        min_length, max_length: inclusive token-length bounds (LRA: 500, 2000).
        max_depth, max_args: tree shape limits (LRA: 10, 10).

    Returns:
        dict ``split name -> list of (source string, label)``; the source is
        the space-separated tokens.
    """
    _check("min_length", min_length)
    _check("max_length", max_length)
    _check("max_depth", max_depth)
    _check("max_args", max_args, low=2)
    if min_length > max_length:
        raise ValueError(
            f"`min_length` must be <= `max_length`. Received: min_length={min_length}, max_length={max_length}"
        )
    if min_length > 1 and max_length < 4:
        # The shortest expression with an operator is "[OP a b ]" (4 tokens).
        raise ValueError(
            f"No expression has a length in [2, 3]. Received: min_length={min_length}, max_length={max_length}"
        )
    if min_length > 1 and max_depth < 2:
        raise ValueError(
            "With `max_depth` 1 every example is a single digit (length 1). "
            f"Received: max_depth={max_depth}, min_length={min_length}"
        )
    rng = random.Random(seed)
    seen = set()
    splits = {}
    for split, count in num_examples.items():
        _check(f"num_examples[{split!r}]", count, low=0)
        examples = []
        while len(examples) < count:
            tokens, label = random_example(rng, min_length, max_length, max_depth, max_args)
            source = " ".join(tokens)
            if source in seen:
                continue
            seen.add(source)
            examples.append((source, label))
        splits[split] = examples
    return splits
