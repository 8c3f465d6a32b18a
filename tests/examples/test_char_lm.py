"""Char LM example: corpus loader, vocabulary, training windows, a tiny end-to-end run."""

import os
import sysconfig

import numpy as np
import pytest

from examples.char_lm import data
from tests.conftest import TEST_SEED


def _write(path, text, encoding="utf-8"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding=encoding) as f:
        f.write(text)


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    _write(str(root / "b.py"), "import os\n")
    _write(str(root / "a.py"), "x = 1\n")
    _write(str(root / "pkg" / "c.py"), "def f():\n    return 2\n")
    _write(str(root / "test" / "test_a.py"), "assert True\n")
    _write(str(root / "notes.txt"), "not python\n")
    with open(root / "pkg" / "latin.py", "wb") as f:
        f.write(b"s = '\xe9'\n")  # not UTF-8: skipped
    return str(root)


def test_stdlib_files_sorted_filtered(fake_stdlib):
    files = [os.path.relpath(p, fake_stdlib) for p in data.stdlib_files(fake_stdlib)]
    assert files == ["a.py", "b.py", os.path.join("pkg", "c.py"), os.path.join("pkg", "latin.py")]


def test_load_corpus_concatenates_and_truncates(fake_stdlib):
    text = data.load_stdlib_corpus(max_chars=10_000, stdlib_dir=fake_stdlib)
    assert text == "x = 1\n\n\nimport os\n\n\ndef f():\n    return 2\n\n\n"
    assert data.load_stdlib_corpus(max_chars=8, stdlib_dir=fake_stdlib) == "x = 1\n\n\n"[:8]
    with pytest.raises(ValueError, match="max_chars=0"):
        data.load_stdlib_corpus(max_chars=0, stdlib_dir=fake_stdlib)
    with pytest.raises(ValueError, match="stdlib_dir="):
        data.load_stdlib_corpus(stdlib_dir=os.path.join(fake_stdlib, "missing"))


def test_real_stdlib_corpus():
    files = data.stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert os.path.join(root, "os.py") in files
    assert not any(f"{os.sep}test{os.sep}" in os.path.relpath(p, root) for p in files)
    text = data.load_stdlib_corpus(max_chars=50_000)
    assert len(text) == 50_000
    assert text == data.load_stdlib_corpus(max_chars=50_000)  # deterministic
    with open(files[0], encoding="utf-8") as f:
        first = f.read()
    assert text.startswith(first[:1000])


def test_vocabulary_round_trip_unknown_and_cap():
    vocab = data.CharVocabulary.from_text("hello world")
    assert vocab.size == len(set("hello world")) + 2
    ids = vocab.encode("low")
    assert ids.dtype == np.int32 and ids.min() >= 2
    assert vocab.decode(ids) == "low"
    assert vocab.encode("z").tolist() == [data.UNK]
    assert vocab.decode([data.PAD, *ids.tolist(), data.PAD]) == "low"
    assert vocab.decode([data.UNK]) == "\ufffd"
    capped = data.CharVocabulary.from_text("aaaabbbc", max_size=4)  # 2 reserved + 2 most frequent
    assert capped.characters == ["a", "b"]
    assert data.CharVocabulary(**vocab.get_config()).characters == vocab.characters
    with pytest.raises(ValueError, match="distinct single characters"):
        data.CharVocabulary(["a", "a"])


def test_windows_are_next_character_pairs():
    ids = np.arange(2, 2 + 103, dtype=np.int32)
    ds = data.windows(ids, sequence_length=9, batch_size=4)
    batches = list(ds.as_numpy_iterator())
    # 103 ids -> 10 windows of 10 -> 2 full batches of 4 (remainder dropped).
    assert len(batches) == 2
    x, y = batches[0]
    assert x.shape == (4, 9) and y.shape == (4, 9)
    np.testing.assert_array_equal(x[1], ids[10:19])
    np.testing.assert_array_equal(y[1], ids[11:20])
    shuffled = np.concatenate([b[0] for b in data.windows(ids, 9, 4, shuffle=True, seed=1).as_numpy_iterator()])
    # Shuffling permutes whole windows: every shuffled row is one of the 10 windows.
    windows = {tuple(ids[i * 10 : i * 10 + 9]) for i in range(10)}
    assert shuffled.shape == (8, 9) and {tuple(r) for r in shuffled} <= windows
    with pytest.raises(ValueError, match="Corpus too short"):
        data.windows(ids[:30], sequence_length=9, batch_size=4)


def test_split_ids():
    train, val = data.split_ids(np.arange(100), validation_fraction=0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="validation_fraction=1.0"):
        data.split_ids(np.arange(10), validation_fraction=1.0)


def test_tiny_shakespeare_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tiny_shakespeare is not prepared"):
        data.load_tiny_shakespeare(data_dir=str(tmp_path))


def test_end_to_end_tiny_run(tmp_path, capsys):
    from examples.char_lm import train
    from keras_linattn.models import LinearCausalLM

    max_chars, sequence_length, batch_size, validation_steps = 30000, 32, 4, 2
    model, vocab, samples, summary = train.main(
        [
            "--steps",
            "400",
            "--eval-every",
            "200",
            "--validation-steps",
            str(validation_steps),
            "--max-chars",
            str(max_chars),
            "--sequence-length",
            str(sequence_length),
            "--batch-size",
            str(batch_size),
            "--num-layers",
            "1",
            "--hidden-dim",
            "16",
            "--num-heads",
            "2",
            "--intermediate-dim",
            "32",
            "--prompt",
            "def ",
            "--generate-length",
            "12",
            "--num-samples",
            "2",
            "--sampler",
            "greedy",
            "--verbose",
            "0",
            "--seed",
            str(TEST_SEED),
            "--save",
            str(tmp_path / "lm.keras"),
        ]
    )
    assert isinstance(model, LinearCausalLM)
    assert len(samples) == 2
    for s in samples:
        assert s.startswith("def ")
    assert samples[0] == samples[1]  # greedy: same prompt, same continuation
    assert np.isfinite(summary["train_loss"]) and np.isfinite(summary["val_loss"])
    # Chance levels of the evaluated characters (the run's corpus, split and validation windows):
    # a uniform guess costs log2(V) bits/char; the best context-free guess, the training
    # split's character frequencies (add-one smoothed), costs their cross-entropy. Learning
    # criterion: the trained model beats both, i.e. it uses the context.
    train_ids, val_ids = data.split_ids(vocab.encode(data.load_stdlib_corpus(max_chars=max_chars)))
    windows = data.windows(val_ids, sequence_length, batch_size).take(validation_steps)
    targets = np.concatenate([y.ravel() for _, y in windows.as_numpy_iterator()])
    frequencies = (np.bincount(train_ids, minlength=vocab.size) + 1) / (len(train_ids) + vocab.size)
    unigram_bits = float(-np.log2(frequencies[targets]).mean())
    assert unigram_bits < np.log2(vocab.size)
    assert summary["val_bits_per_char"] < unigram_bits, (summary["val_bits_per_char"], unigram_bits)
    out = capsys.readouterr().out
    assert "--- sample 0 ---" in out and "val bits/char" in out
    assert os.path.exists(tmp_path / "lm.keras")
