"""ListOps tokenizer: a fixed 16-token vocabulary, with id 0 for padding."""

import tensorflow as tf

from examples.listops.generator import CLOSE, OPERATORS, VALUES

PAD = "<pad>"
VOCABULARY = (PAD,) + OPERATORS + (CLOSE,) + VALUES
PAD_ID = 0


class ListOpsTokenizer:
    """Maps ListOps sources (space-separated tokens) to int ids and back.

    Example:

    >>> tok = ListOpsTokenizer()
    >>> tok.encode("[MAX 2 9 ]")
    [2, 8, 15, 5]
    >>> tok.decode([2, 8, 15, 5, 0, 0])
    '[MAX 2 9 ]'
    """

    def __init__(self):
        self.vocabulary = VOCABULARY
        self._ids = {token: i for i, token in enumerate(VOCABULARY)}
        # Created here, eagerly: a table first created inside a tf.data map
        # function would belong to that function's graph.
        self._table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(self.vocabulary), tf.range(len(self.vocabulary), dtype=tf.int32)
            ),
            default_value=PAD_ID,
        )

    @property
    def vocabulary_size(self):
        return len(self.vocabulary)

    def encode(self, source):
        """Token ids of a source string; raises ValueError on an unknown token."""
        ids = []
        for token in source.split():
            if token not in self._ids or token == PAD:
                raise ValueError(f"Unknown ListOps token. Received: token={token!r}")
            ids.append(self._ids[token])
        return ids

    def decode(self, ids):
        """Source string of token ids (padding dropped)."""
        return " ".join(self.vocabulary[int(i)] for i in ids if int(i) != PAD_ID)

    def tf_encode(self, source):
        """TensorFlow version of `encode` for `tf.data`: scalar string -> ``[T]`` int32 (unknown -> 0)."""
        return self._table.lookup(tf.strings.split(source))  # [T]
