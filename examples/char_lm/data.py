"""Corpus loading, character vocabulary and training windows for the char LM.

Default corpus: the Python standard library's own ``.py`` files (found with
``sysconfig.get_paths()["stdlib"]``), which every Python installation has,
so the example runs offline. ``tiny_shakespeare`` is used through TFDS when it
has been prepared locally (``tfds.load(..., download=False)``).
"""

import os
import sysconfig

import numpy as np
import tensorflow as tf

PAD = 0
UNK = 1
_RESERVED = 2
# Directories of the standard library that hold test data, generated files or
# vendored code rather than ordinary library source.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}


def stdlib_files(stdlib_dir=None):
    """Sorted paths of the standard library's ``.py`` files (tests and site-packages excluded).

    Args:
        stdlib_dir: root to search; defaults to ``sysconfig.get_paths()["stdlib"]``.
    """
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"Standard library directory not found. Received: stdlib_dir={root!r}")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return paths


def load_stdlib_corpus(max_chars=2_000_000, stdlib_dir=None):
    """Concatenated standard-library source, files in sorted order, truncated to `max_chars`.

    Files that are not valid UTF-8 are skipped. Each file is followed by a
    blank line. Deterministic for a given Python installation.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0:
        raise ValueError(f"`max_chars` must be a positive integer. Received: max_chars={max_chars!r}")
    pieces, total = [], 0
    for path in stdlib_files(stdlib_dir):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        pieces.append(text + "\n\n")
        total += len(text) + 2
        if total >= max_chars:
            break
    corpus = "".join(pieces)[:max_chars]
    if not corpus:
        raise ValueError(f"No readable .py files under {stdlib_dir or sysconfig.get_paths()['stdlib']!r}.")
    return corpus


def load_tiny_shakespeare(data_dir=None, max_chars=None):
    """The TFDS ``tiny_shakespeare`` train text, if prepared locally (no download is attempted)."""
    import tensorflow_datasets as tfds

    try:
        ds = tfds.load("tiny_shakespeare", split="train", data_dir=data_dir, download=False)
    except Exception as e:  # TFDS raises several error types for a missing dataset.
        raise ValueError(
            "tiny_shakespeare is not prepared in the TFDS data_dir (downloads are not attempted). "
            f"Received: data_dir={data_dir!r}; error: {e}"
        ) from e
    text = "".join(ex["text"].numpy().decode("utf-8") for ex in ds)
    return text[:max_chars] if max_chars else text


class CharVocabulary:
    """Character vocabulary: id 0 padding, id 1 unknown, then the corpus' characters.

    Args:
        characters: the characters, in id order (ids start at 2).

    Example:

    >>> vocab = CharVocabulary.from_text("hello")
    >>> vocab.decode(vocab.encode("hole"))
    'hole'
    """

    def __init__(self, characters):
        characters = list(characters)
        if len(set(characters)) != len(characters) or any(len(c) != 1 for c in characters):
            raise ValueError(
                "`characters` must be distinct single characters. "
                f"Received: {len(characters)} entries, {len(set(characters))} distinct"
            )
        self.characters = characters
        self._ids = {c: i + _RESERVED for i, c in enumerate(characters)}

    @classmethod
    def from_text(cls, text, max_size=None):
        """Vocabulary of the characters in `text`, the most frequent first when `max_size` caps it."""
        chars, counts = np.unique(np.array(list(text)), return_counts=True)
        order = np.argsort(-counts, kind="stable")
        chars = [str(chars[i]) for i in order]
        if max_size is not None:
            chars = chars[: max_size - _RESERVED]
        return cls(sorted(chars))

    @property
    def size(self):
        return len(self.characters) + _RESERVED

    def encode(self, text):
        """int32 numpy ids of `text` (unknown characters -> 1)."""
        return np.fromiter((self._ids.get(c, UNK) for c in text), dtype=np.int32, count=len(text))

    def decode(self, ids):
        """Text of ids; padding is dropped, unknown shows as U+FFFD."""
        out = []
        for i in np.asarray(ids).reshape(-1):
            i = int(i)
            if i == PAD:
                continue
            out.append(self.characters[i - _RESERVED] if i >= _RESERVED else "\ufffd")
        return "".join(out)

    def get_config(self):
        return {"characters": "".join(self.characters)}


def split_ids(ids, validation_fraction=0.05):
    """Splits a 1-D id array into (train, validation) at ``1 - validation_fraction``."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            f"`validation_fraction` must be in (0, 1). Received: validation_fraction={validation_fraction!r}"
        )
    cut = int(len(ids) * (1.0 - validation_fraction))
    return ids[:cut], ids[cut:]


def windows(ids, sequence_length, batch_size, shuffle=False, seed=None):
    """`tf.data` of ``(inputs [B, T], targets [B, T])`` next-character pairs.

    Non-overlapping windows of ``T + 1`` ids; every batch has the static
    shape ``[batch_size, sequence_length]`` (the remainder is dropped), so an
    XLA train step is compiled once.

    Raises:
        ValueError: if `ids` is too short for one batch.
    """
    ids = np.asarray(ids, dtype=np.int32)
    span = sequence_length + 1
    num_windows = len(ids) // span
    if num_windows < batch_size:
        raise ValueError(
            f"Corpus too short: {len(ids)} ids give {num_windows} windows of {span}, fewer than "
            f"batch_size={batch_size}. Received: len(ids)={len(ids)}, sequence_length={sequence_length}"
        )
    blocks = ids[: num_windows * span].reshape(num_windows, span)  # [W, T + 1]
    ds = tf.data.Dataset.from_tensor_slices(blocks)
    if shuffle:
        ds = ds.shuffle(num_windows, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda w: (w[:, :-1], w[:, 1:])).prefetch(tf.data.AUTOTUNE)  # [B, T], [B, T]
