"""LinearCausalLMPreprocessor: any keras-hub tokenizer, left padding, next-token labels."""

import keras
import keras_hub
import numpy as np
from keras import ops

from keras_linattn import _validation
from keras_linattn.models import _presets

__all__ = ["LinearCausalLMPreprocessor"]


def _is_token_ids(x):
    """Whether `x` is already tokenized: an integer array / tensor, or keras-hub's ``{"token_ids", ...}`` dict."""
    if isinstance(x, dict):
        return "token_ids" in x
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    try:
        dtype = keras.backend.standardize_dtype(dtype)
    except ValueError:
        return False
    return dtype.startswith(("int", "uint"))


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

    Already-tokenized input passes through (so `fit` on a model with a
    preprocessor takes token ids too): an integer array ``[B, T]`` or a
    ``{"token_ids", "padding_mask"}`` dict, given with labels, is returned
    unchanged; without labels it becomes next-token data like strings do
    (``x`` the first ``T - 1`` ids, ``y`` the last ``T - 1``, weights 1 where
    both are real).

    Any keras-hub tokenizer works: a tokenizer without a padding, start or
    end token (`ByteTokenizer`) pads with id 0 and packs without the
    missing special tokens, as keras-hub's own preprocessors do.

    `generate_preprocess` packs prompts without an end token, left-padded to
    the longest prompt of the batch (with a `sequence_length`, followed by
    the columns keras-hub's `CausalLM.generate` fills); `generate_postprocess`
    drops padding and special tokens and detokenizes.

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

    # Presets: a manifest of digests written at save, checked at load (`keras_linattn.models._presets`).
    def save_to_preset(self, preset_dir):
        with _presets.saving(preset_dir, clean=False) as target:  # beside a model's files: they stay
            super().save_to_preset(target)

    @classmethod
    def from_preset(cls, preset, *args, **kwargs):
        with _presets.loading(preset, weights=False):
            return super().from_preset(preset, *args, **kwargs)

    def load_preset_assets(self, preset):
        _presets.verify(preset, weights=False)
        super().load_preset_assets(preset)

    def _special_id(self, name):
        """The tokenizer's ``<name>_token_id``, or None for a tokenizer without one (e.g. `ByteTokenizer`)."""
        return getattr(self.tokenizer, f"{name}_token_id", None)

    def build(self, input_shape):
        pad = self._special_id("pad")
        self.packer = keras_hub.layers.StartEndPacker(
            start_value=self._special_id("start"),
            end_value=self._special_id("end"),
            pad_value=0 if pad is None else pad,
            sequence_length=self.sequence_length,
            return_padding_mask=True,
            padding_side="left",
        )
        self.built = True

    def call(self, x, y=None, sample_weight=None, sequence_length=None):
        if not self.built:
            self.build(None)
        if _is_token_ids(x):
            return self._token_ids_call(x, y, sample_weight)
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

    def _token_ids_call(self, x, y, sample_weight):
        """Already-tokenized input: with labels unchanged, without them next-token data as for strings."""
        if y is not None:
            return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        token_ids = ops.convert_to_tensor(x["token_ids"] if isinstance(x, dict) else x)
        padding_mask = x.get("padding_mask") if isinstance(x, dict) else None
        padding_mask = ops.ones_like(token_ids, "bool") if padding_mask is None else ops.convert_to_tensor(padding_mask)
        padding_mask = ops.cast(padding_mask, "bool")
        inputs = {"token_ids": token_ids[..., :-1], "padding_mask": padding_mask[..., :-1]}
        weight = ops.logical_and(padding_mask[..., 1:], padding_mask[..., :-1])
        return keras.utils.pack_x_y_sample_weight(inputs, token_ids[..., 1:], weight)

    def generate_preprocess(self, x, sequence_length=None):
        """Prompts -> ``{"token_ids", "padding_mask"}``, left-padded to the longest one (P tokens).

        Without `sequence_length`: ``[B, P]``, the prompts alone (what
        `LinearCausalLM.generate` takes). With it (keras-hub's
        `CausalLM.generate` passes its ``max_length``): a ``[B,
        sequence_length]`` frame, the prompts (longer ones keep their last
        `sequence_length` tokens) followed by columns of the pad id with
        mask 0, which `LinearCausalLM.generate_step` fills.

        Args:
            x: a string, or a list, array or tensor of strings.
            sequence_length: optional frame length.

        Raises:
            ValueError: for a prompt with no token at all.
        """
        if not self.built:
            self.build(None)
        if isinstance(x, (str, bytes)):
            x = [x]
        # A string array or tensor (a `tf.data` batch in keras-hub's `generate`): the tokenizers take lists.
        x = [v.decode("utf-8") if isinstance(v, bytes) else v for v in np.asarray(x, dtype=object).reshape(-1)]
        tokens = self.tokenizer(x)
        rows = tokens.to_list() if hasattr(tokens, "to_list") else [list(np.asarray(r)) for r in tokens]
        start = [self._special_id("start")] if self.add_start_token and self._special_id("start") is not None else []
        rows = [start + [int(t) for t in row] for row in rows]
        if sequence_length is not None:
            rows = [row[-sequence_length:] for row in rows]
        if any(len(row) == 0 for row in rows):
            raise ValueError(f"Every prompt needs at least one token. Received: x={x!r}")
        width = max(len(row) for row in rows)
        pad = self._special_id("pad") or 0
        token_ids = np.full((len(rows), sequence_length or width), pad, "int32")
        padding_mask = np.zeros(token_ids.shape, bool)
        for i, row in enumerate(rows):
            token_ids[i, width - len(row) : width] = row
            padding_mask[i, width - len(row) : width] = True
        return {"token_ids": token_ids, "padding_mask": padding_mask}
