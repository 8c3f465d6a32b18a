"""Loading and tokenizing TFDS ``imdb_reviews`` into fixed-length padded batches.

Two tokenizers: ``bytes`` (UTF-8 bytes, id = byte + 1, no vocabulary to
learn) and ``words`` (`keras.layers.TextVectorization` adapted on the
training text). Id 0 is padding in both; every batch is padded or truncated
to one length so that the XLA train step compiles once.
"""

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

BYTE_VOCABULARY_SIZE = 257  # 256 byte values + padding (id 0).


def encode_bytes(text, sequence_length):
    """Scalar string -> ``[T]`` int32 ids (byte + 1), truncated and zero-padded to `sequence_length`."""
    ids = tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32)[:sequence_length] + 1  # [<=T]
    ids = tf.pad(ids, [[0, sequence_length - tf.shape(ids)[0]]])  # [T]
    return tf.ensure_shape(ids, (sequence_length,))


def load_imdb(
    sequence_length=256,
    batch_size=32,
    tokenizer="bytes",
    vocabulary_size=20000,
    data_dir=None,
    max_train_examples=None,
    max_test_examples=None,
    seed=0,
    download=False,
):
    """Train and test pipelines of ``(ids [B, T] int32, label [B] int64)``.

    Args:
        sequence_length: padded length T.
        batch_size: batch size B (the training remainder is dropped).
        tokenizer: ``"bytes"`` or ``"words"``.
        vocabulary_size: vocabulary size of the ``words`` tokenizer.
        data_dir: TFDS data_dir.
        max_train_examples, max_test_examples: optional caps (small CPU runs).
        seed: shuffle seed.
        download: let TFDS download the dataset if it is not prepared.

    Returns:
        ``(train_ds, test_ds, vocabulary_size)``; `train_ds` repeats forever.
    """
    if tokenizer not in ("bytes", "words"):
        raise ValueError(f"`tokenizer` must be 'bytes' or 'words'. Received: tokenizer={tokenizer!r}")
    train, test = tfds.load(
        "imdb_reviews", split=["train", "test"], as_supervised=True, data_dir=data_dir, download=download
    )
    if max_train_examples:
        train = train.take(max_train_examples)
    if max_test_examples:
        test = test.take(max_test_examples)
    if tokenizer == "bytes":

        def encode(text, label):
            return encode_bytes(text, sequence_length), label

        vocab_size = BYTE_VOCABULARY_SIZE
    else:
        vectorizer = keras.layers.TextVectorization(max_tokens=vocabulary_size, output_sequence_length=sequence_length)
        vectorizer.adapt(train.map(lambda text, label: text).batch(256))
        vocab_size = vectorizer.vocabulary_size()

        def encode(text, label):
            return tf.cast(vectorizer(text[None])[0], tf.int32), label  # [T]

    train = (
        train.map(encode, num_parallel_calls=tf.data.AUTOTUNE)
        .cache()
        .shuffle(10_000, seed=seed)
        .repeat()
        .batch(batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    test = test.map(encode, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).cache().prefetch(tf.data.AUTOTUNE)
    return train, test, vocab_size
