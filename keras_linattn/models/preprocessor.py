"""LinearCausalLMPreprocessor: any keras-hub tokenizer, left padding, next-token labels."""

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_linattn import _validation

__all__ = ["LinearCausalLMPreprocessor"]


@keras.saving.register_keras_serializable(package="keras_linattn")
class LinearCausalLMPreprocessor(keras_hub.models.CausalLMPreprocessor):
    """Turns strings into `LinearCausalLM` inputs: tokens, left padding, next-token labels.

    A keras-hub `CausalLMPreprocessor` with any keras-hub tokenizer
    (`GPT2Tokenizer`, `ByteTokenizer`, a SentencePiece tokenizer, ...).
    Sequences are padded on the left, the layout the decode contract takes
    for prompts of different lengths (the state then holds only real
    tokens, and every row's next token is at the last column).

    Calling it (as `fit` does on string data) packs each string as
    ``[start] tokens [end]`` into ``sequence_length + 1`` ids and returns
    ``(x, y, sample_weight)``: ``x = {"token_ids", "padding_mask"}`` the
    first `sequence_length` ids, ``y`` the next id at each position, and a
    sample weight of 1 where both the input token and its target are real
    (with left padding, the first real token is the target of a padding
    position, which must not count).

    `generate_preprocess` packs prompts without an end token, left-padded to
    the longest prompt of the batch; `generate_postprocess` drops padding and
    special tokens and detokenizes.

    Args:
        tokenizer: a keras-hub tokenizer.
        sequence_length: length of the packed training sequences (and the
            default `max_length` of `LinearCausalLM.generate` on strings).
        add_start_token: put the tokenizer's start token first.
        add_end_token: put its end token last (training).
        **kwargs: `keras.layers.Layer` arguments.

    Example:

    >>> vocab = {c: i for i, c in enumerate(["<|endoftext|>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "Ġa"])}
    >>> tokenizer = keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocab, merges=["Ġ a"])
    >>> pre = LinearCausalLMPreprocessor(tokenizer, sequence_length=8)
    >>> x, y, w = pre(["abc"])
    >>> x["token_ids"].numpy().tolist(), w.numpy().astype(int).tolist()
    ([[0, 0, 0, 0, 0, 1, 2, 3]], [[0, 0, 0, 0, 1, 1, 1, 1]])
    """

    tokenizer_cls = keras_hub.tokenizers.Tokenizer

    def __init__(self, tokenizer, sequence_length=1024, add_start_token=True, add_end_token=True, **kwargs):
        _validation.check_positive_int("sequence_length", sequence_length)
        super().__init__(
            tokenizer,
            sequence_length=sequence_length,
            add_start_token=add_start_token,
            add_end_token=add_end_token,
            **kwargs,
        )

    def build(self, input_shape):
        pad = self.tokenizer.pad_token_id
        self.packer = keras_hub.layers.StartEndPacker(
            start_value=self.tokenizer.start_token_id,
            end_value=self.tokenizer.end_token_id,
            pad_value=0 if pad is None else pad,
            sequence_length=self.sequence_length,
            return_padding_mask=True,
            padding_side="left",
        )
        self.built = True

    def call(self, x, y=None, sample_weight=None, sequence_length=None):
        if not self.built:
            self.build(None)
        sequence_length = sequence_length or self.sequence_length
        token_ids, padding_mask = self.packer(
            self.tokenizer(x),
            sequence_length=sequence_length + 1,
            add_start_value=self.add_start_token,
            add_end_value=self.add_end_token,
        )
        inputs = {"token_ids": token_ids[..., :-1], "padding_mask": padding_mask[..., :-1]}
        labels = token_ids[..., 1:]
        weight = ops.logical_and(ops.cast(padding_mask[..., 1:], "bool"), ops.cast(padding_mask[..., :-1], "bool"))
        return keras.utils.pack_x_y_sample_weight(inputs, labels, weight)

    def generate_preprocess(self, x, sequence_length=None):
        """Prompts -> ``{"token_ids": [B, P], "padding_mask": [B, P]}``, left-padded to the longest one.

        Args:
            x: a list of strings.
            sequence_length: optional cap on P (longer prompts keep their
                last tokens).

        Raises:
            ValueError: for a prompt with no token at all.
        """
        if not self.built:
            self.build(None)
        tokens = self.tokenizer(x)
        rows = tokens.to_list() if hasattr(tokens, "to_list") else [list(np.asarray(r)) for r in tokens]
        start = (
            [self.tokenizer.start_token_id]
            if self.add_start_token and self.tokenizer.start_token_id is not None
            else []
        )
        rows = [start + [int(t) for t in row] for row in rows]
        if sequence_length is not None:
            rows = [row[-sequence_length:] for row in rows]
        if any(len(row) == 0 for row in rows):
            raise ValueError(f"Every prompt needs at least one token. Received: x={x!r}")
        width = max(len(row) for row in rows)
        pad = self.tokenizer.pad_token_id or 0
        token_ids = np.full((len(rows), width), pad, "int32")
        padding_mask = np.zeros((len(rows), width), bool)
        for i, row in enumerate(rows):
            token_ids[i, width - len(row) :] = row
            padding_mask[i, width - len(row) :] = True
        return {"token_ids": token_ids, "padding_mask": padding_mask}
