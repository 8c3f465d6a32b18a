"""ListOps example: generator vs an independent evaluator, determinism, bounds, TFDS builder offline."""

import socket
import statistics

import numpy as np
import pytest

from examples.listops import generator
from examples.listops.tokenizer import PAD_ID, ListOpsTokenizer
from tests.conftest import TEST_SEED

# ---------------------------------------------------------------------------
# An independent evaluator: a recursive-descent parser over the token list,
# written from LRA's definition (MED = int(median), SM = sum mod 10) and
# sharing no code with the generator.


def _parse(tokens, pos, depth):
    """Returns (value, next position, max depth, max number of arguments) of the sub-tree at `pos`."""
    token = tokens[pos]
    if token.isdigit() and len(token) == 1:
        return int(token), pos + 1, depth, 0
    if not token.startswith("["):
        raise SyntaxError(f"unexpected token {token!r} at {pos}")
    op = token[1:]
    args, pos, max_depth, max_args = [], pos + 1, depth, 0
    while tokens[pos] != "]":
        value, pos, d, a = _parse(tokens, pos, depth + 1)
        args.append(value)
        max_depth, max_args = max(max_depth, d), max(max_args, a)
    if len(args) < 2:
        raise SyntaxError(f"operator {op} with {len(args)} arguments")
    max_args = max(max_args, len(args))
    if op == "MIN":
        value = min(args)
    elif op == "MAX":
        value = max(args)
    elif op == "MED":
        value = int(statistics.median(args))
    elif op == "SM":
        value = sum(args) % 10
    else:
        raise SyntaxError(f"unknown operator {op!r}")
    return value, pos + 1, max_depth, max_args


def evaluate(source):
    """(value, depth, max arguments) of a whole ListOps source string."""
    tokens = source.split()
    value, end, depth, max_args = _parse(tokens, 0, 1)
    if end != len(tokens):
        raise SyntaxError(f"trailing tokens after position {end}")
    return value, depth, max_args


def test_independent_evaluator_on_hand_written_examples():
    assert evaluate("7") == (7, 1, 0)
    assert evaluate("[MAX 2 9 [MIN 4 7 ] 0 ]")[0] == 9
    assert evaluate("[MED 1 2 ]")[0] == 1  # median 1.5 truncated, as int(np.median)
    assert evaluate("[MED 3 1 2 ]")[0] == 2
    assert evaluate("[SM 5 6 7 ]")[0] == 8
    # Depth counts the digits: root operator at depth 1, its digits at depth 2.
    assert evaluate("[MAX 2 9 ]") == (9, 2, 2)
    assert evaluate("[MIN [SM 9 9 ] [MAX 3 4 ] ]") == (4, 3, 2)


# ---------------------------------------------------------------------------
# Generator.


@pytest.fixture(scope="module")
def splits():
    return generator.generate({"train": 400, "validation": 50, "test": 50}, seed=3, min_length=4, max_length=80)


def test_labels_match_independent_evaluation(splits):
    examples = [ex for split in splits.values() for ex in split]
    labels = [label for _, label in examples]
    for source, label in examples:
        value, _, _ = evaluate(source)
        assert value == label, source
    # Labels are not degenerate: most of the 10 classes occur.
    assert len(set(labels)) >= 8


@pytest.mark.parametrize("min_length,max_length", [(1, 12), (20, 40), (60, 64)])
def test_length_depth_and_arity_bounds(min_length, max_length):
    out = generator.generate(
        {"train": 60}, seed=0, min_length=min_length, max_length=max_length, max_depth=4, max_args=5
    )
    for source, _ in out["train"]:
        length = len(source.split())
        assert min_length <= length <= max_length
        _, depth, max_args = evaluate(source)
        assert depth <= 4
        assert max_args <= 5


def test_lra_bounds_reachable():
    out = generator.generate({"train": 3}, seed=0, min_length=500, max_length=2000)
    for source, label in out["train"]:
        assert 500 <= len(source.split()) <= 2000
        value, depth, max_args = evaluate(source)
        assert value == label and depth <= 10 and max_args <= 10


def test_deterministic_by_seed_and_unique(splits):
    again = generator.generate({"train": 400, "validation": 50, "test": 50}, seed=3, min_length=4, max_length=80)
    assert again == splits
    other = generator.generate({"train": 400, "validation": 50, "test": 50}, seed=4, min_length=4, max_length=80)
    assert other["train"] != splits["train"]
    sources = [s for split in splits.values() for s, _ in split]
    assert len(sources) == len(set(sources))  # no duplicates within or across splits


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_length": 0, "max_length": 10},
        {"min_length": 20, "max_length": 10},
        {"min_length": 2, "max_length": 3},
        {"min_length": 5, "max_length": 10, "max_args": 1},
        {"min_length": 5, "max_length": 10, "max_depth": 1},
    ],
)
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="Received"):
        generator.generate({"train": 1}, seed=0, **kwargs)


# ---------------------------------------------------------------------------
# Tokenizer.


def test_tokenizer_round_trip_and_tf_encode(splits):
    tok = ListOpsTokenizer()
    assert tok.vocabulary_size == 16
    for source, _ in splits["test"][:20]:
        ids = tok.encode(source)
        assert PAD_ID not in ids
        assert tok.decode(ids + [PAD_ID] * 3) == source
        np.testing.assert_array_equal(tok.tf_encode(source).numpy(), ids)
    with pytest.raises(ValueError, match="token='\\(MAX'"):
        tok.encode("(MAX 1 2 ]")


# ---------------------------------------------------------------------------
# TFDS builder.


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access attempted in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_builder_download_and_prepare_offline(tmp_path, no_network):
    from examples.listops.listops_dataset import ListOps, ListOpsConfig

    config = ListOpsConfig(
        name="unit", min_length=6, max_length=40, num_train=40, num_validation=8, num_test=8, seed=11
    )
    builder = ListOps(config=config, data_dir=str(tmp_path))
    builder.download_and_prepare()
    assert builder.info.splits["train"].num_examples == 40
    assert builder.info.splits["validation"].num_examples == 8
    assert builder.info.splits["test"].num_examples == 8
    expected = generator.generate({"train": 40, "validation": 8, "test": 8}, seed=11, min_length=6, max_length=40)
    for split in ("train", "test"):
        got = sorted(
            (ex["source"].numpy().decode(), int(ex["label"].numpy()), int(ex["length"].numpy()))
            for ex in builder.as_dataset(split=split)
        )
        # The stored examples are the generator's (TFDS reorders them), with
        # labels that the independent evaluator agrees with.
        assert sorted((s, label) for s, label, _ in got) == sorted(expected[split])
        for source, label, length in got:
            assert evaluate(source)[0] == label
            assert length == len(source.split())
    # A second builder over the same directory reuses the files.
    again = ListOps(config=config, data_dir=str(tmp_path))
    again.download_and_prepare()
    assert again.info.splits["train"].num_examples == 40


def test_train_script_small_run(tmp_path, capsys):
    from examples.listops import train

    num_train, num_eval, min_length, max_length = 1000, 200, 4, 32
    seeds = (TEST_SEED, TEST_SEED + 1)
    results = train.main(
        [
            "--variants",
            "softmax,elu",
            "--seeds",
            ",".join(map(str, seeds)),
            "--data-seed",
            str(TEST_SEED),
            "--steps",
            "200",
            "--eval-every",
            "100",
            "--batch-size",
            "32",
            "--num-train",
            str(num_train),
            "--num-eval",
            str(num_eval),
            "--min-length",
            str(min_length),
            "--max-length",
            str(max_length),
            "--seq-len",
            str(max_length),  # nothing truncated
            "--hidden-dim",
            "16",
            "--intermediate-dim",
            "16",
            "--data-dir",
            str(tmp_path),
            "--no-jit",
            "--verbose",
            "0",
        ]
    )
    assert [(r["variant"], r["seed"]) for r in results] == [
        ("softmax", seeds[0]),
        ("softmax", seeds[1]),
        ("elu", seeds[0]),
        ("elu", seeds[1]),
    ]
    # Chance: the majority-class rate p0 of the test split (10 classes, not balanced: p0 >= 1/10; the
    # builder's splits are the generator's). A predictor that ignores its input scores at
    # most p0 in expectation; learning criterion: 3 standard errors of a frequency over the
    # N test examples above it, p0 + 3 * sqrt(p0 (1 - p0) / N).
    splits = generator.generate(
        {"train": num_train, "validation": num_eval, "test": num_eval},
        seed=TEST_SEED,
        min_length=min_length,
        max_length=max_length,
    )
    counts = np.bincount([label for _, label in splits["test"]], minlength=generator.NUM_CLASSES)
    p0 = counts.max() / num_eval
    chance = p0 + 3 * np.sqrt(p0 * (1 - p0) / num_eval)
    for r in results:
        assert r["test_accuracy"] > chance, (r["variant"], r["seed"], r["test_accuracy"], p0)
        assert len(r["val_accuracy"]) == 2
        assert all(np.isfinite(r["train_loss"]))
    # Different seeds give different initial weights, hence different losses.
    assert results[0]["train_loss"] != results[1]["train_loss"]
    out = capsys.readouterr().out
    assert "| softmax |" in out and "| elu |" in out


def test_unknown_variant_raises():
    from examples.listops import train

    with pytest.raises(ValueError, match="variant='nope'"):
        train.resolve_variants(["nope"], [1])
