"""IMDB example: loading and tokenization under tfds.testing.mock_data (no download), one short run."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from examples.text_classification import data
from tests.conftest import TEST_SEED


def test_encode_bytes_pads_and_truncates():
    text = "héllo"  # 'é' is two UTF-8 bytes
    ids = data.encode_bytes(tf.constant(text), 8).numpy()
    expected = [b + 1 for b in text.encode("utf-8")] + [0, 0]
    assert ids.tolist() == expected
    ids = data.encode_bytes(tf.constant("abcdefghij"), 4).numpy()
    assert ids.tolist() == [ord(c) + 1 for c in "abcd"]
    assert data.encode_bytes(tf.constant(""), 3).numpy().tolist() == [0, 0, 0]


@pytest.mark.parametrize("tokenizer", ["bytes", "words"])
def test_load_imdb_with_mock_data(tokenizer):
    with tfds.testing.mock_data(num_examples=24):
        raw_train = list(tfds.load("imdb_reviews", split="train", as_supervised=True).take(24))
        train, test, vocab_size = data.load_imdb(
            sequence_length=16, batch_size=4, tokenizer=tokenizer, max_test_examples=10, seed=0
        )
        x, y = next(iter(train))
        test_batches = list(test)
    assert x.shape == (4, 16) and x.dtype == tf.int32
    assert y.shape == (4,)
    assert set(np.unique(y.numpy())) <= {0, 1}
    assert 0 <= int(tf.reduce_min(x)) and int(tf.reduce_max(x)) < vocab_size
    assert sum(int(b[0].shape[0]) for b in test_batches) == 10  # capped, last batch kept
    if tokenizer == "bytes":
        assert vocab_size == data.BYTE_VOCABULARY_SIZE
        # Every training row is the byte encoding of one of the mock reviews.
        expected = {tuple(data.encode_bytes(text, 16).numpy().tolist()): int(label) for text, label in raw_train}
        for row, label in zip(x.numpy().tolist(), y.numpy().tolist(), strict=True):
            assert tuple(row) in expected and expected[tuple(row)] == label
    else:
        # Padding (id 0) only at the end of a row: words map to ids >= 1 (1 = OOV).
        for row in x.numpy():
            nz = np.flatnonzero(row)
            assert len(nz) == 0 or np.all(row[: nz[-1] + 1] != 0)


def test_bad_tokenizer_raises():
    with pytest.raises(ValueError, match="tokenizer='chars'"):
        data.load_imdb(tokenizer="chars")


# Synthetic reviews with a sentiment to learn (tfds' default mock data has random labels,
# and the same examples in every split): three neutral words and one sentiment word, at
# most 21 bytes (< the 24 the run keeps), labels balanced; train and test from separate streams.
POSITIVE = ("great", "good", "superb", "loved", "fine")
NEGATIVE = ("awful", "bad", "boring", "hated", "poor")
NEUTRAL = ("the", "film", "plot", "was", "cast", "so", "a", "it", "this", "show")
SPLIT_SIZES = {"train": 256, "test": 200}


def synthetic_reviews(split):
    rng = np.random.default_rng([TEST_SEED, list(SPLIT_SIZES).index(split)])
    labels = rng.permutation(np.arange(SPLIT_SIZES[split]) % 2)  # balanced
    texts = []
    for label in labels:
        words = [*rng.choice(NEUTRAL, 3), rng.choice(POSITIVE if label else NEGATIVE)]
        rng.shuffle(words)
        texts.append(" ".join(words))
    return texts, labels


def _synthetic_as_dataset(self, split, *args, **kwargs):
    texts, labels = synthetic_reviews(str(split))
    return tf.data.Dataset.from_tensor_slices({"text": texts, "label": labels.astype("int64")})


def test_train_script_learns_synthetic_sentiment(capsys):
    from examples.text_classification import train

    with tfds.testing.mock_data(as_dataset_fn=_synthetic_as_dataset):
        model, summary = train.main(
            [
                "--steps",
                "100",
                "--eval-every",
                "50",
                "--batch-size",
                "8",
                "--sequence-length",
                "24",
                "--num-layers",
                "1",
                "--hidden-dim",
                "16",
                "--num-heads",
                "2",
                "--intermediate-dim",
                "16",
                "--feature-map",
                "oglu",
                "--verbose",
                "0",
                "--seed",
                str(TEST_SEED),
            ]
        )
    assert model.jit_compile is True
    assert np.isfinite(summary["test_loss"])
    # Chance: the majority-class rate p0 of the test labels (balanced: 1/2). A predictor that
    # ignores its input scores at most p0 in expectation; learning criterion: 3 standard errors
    # of a frequency over the N test reviews above it, p0 + 3 * sqrt(p0 (1 - p0) / N).
    _, labels = synthetic_reviews("test")
    n = len(labels)
    p0 = max(labels.mean(), 1 - labels.mean())
    assert summary["test_accuracy"] > p0 + 3 * np.sqrt(p0 * (1 - p0) / n), (summary["test_accuracy"], p0)
    assert "| oglu | bytes | 24 | 100 |" in capsys.readouterr().out


def test_missing_dataset_is_a_clear_error(tmp_path):
    from examples.text_classification import train

    with pytest.raises(SystemExit, match="imdb_reviews could not be loaded"):
        train.main(["--data-dir", str(tmp_path), "--steps", "1"])
