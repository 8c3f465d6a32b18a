"""LinearCausalLMPreprocessor with any keras-hub tokenizer, and `fit` on token ids through it."""

import keras
import keras_hub
import numpy as np
import pytest

from keras_linattn.models import LinearBackbone, LinearCausalLM, LinearCausalLMPreprocessor
from tests.models.test_keras_hub_shape import char_tokenizer

SMALL = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32)


def _lm(tokenizer, vocabulary_size, sequence_length=8):
    keras.utils.set_random_seed(0)
    backbone = LinearBackbone(vocabulary_size=vocabulary_size, **SMALL)
    return LinearCausalLM(backbone, preprocessor=LinearCausalLMPreprocessor(tokenizer, sequence_length))


def test_byte_tokenizer_without_special_tokens_generates_strings():
    """ByteTokenizer has no pad/start/end ids: padding uses 0, as keras-hub's own preprocessors do."""
    lm = _lm(keras_hub.tokenizers.ByteTokenizer(), 256)
    out = lm.generate(["ab", "abcd"], max_length=10)
    assert [s[:2] for s in out] == ["ab", "ab"] and out[1].startswith("abcd")
    x, y, w = lm.preprocessor(["abc"])
    # No start or end token: "abc" packs as 6 pads + 3 bytes; x is the first 8, y the last 8.
    np.testing.assert_array_equal(np.asarray(x["token_ids"])[0], [0, 0, 0, 0, 0, 0, 97, 98])
    np.testing.assert_array_equal(np.asarray(y)[0], [0, 0, 0, 0, 0, 97, 98, 99])
    np.testing.assert_array_equal(np.asarray(w)[0], [0, 0, 0, 0, 0, 0, 1, 1])


def _ids(batch=4, length=9):
    return np.random.default_rng(0).integers(1, 258, (batch, length)).astype("int32")


def test_fit_takes_token_ids_through_the_preprocessor_as_next_token_data():
    """Token ids (no labels) are tokenized text: the labels are the next ids, as for strings."""
    lm = _lm(char_tokenizer(), 258)
    ids = _ids()
    x, y, w = lm.preprocessor(ids)
    np.testing.assert_array_equal(np.asarray(x["token_ids"]), ids[:, :-1])
    np.testing.assert_array_equal(np.asarray(y), ids[:, 1:])
    assert np.asarray(w).all()
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # left padding of row 0
    x, y, w = lm.preprocessor({"token_ids": ids, "padding_mask": mask})
    np.testing.assert_array_equal(np.asarray(x["padding_mask"]), mask[:, :-1])
    np.testing.assert_array_equal(np.asarray(w), mask[:, :-1] & mask[:, 1:])
    # With labels, the inputs pass through unchanged.
    x, y = lm.preprocessor(ids, y=ids)
    np.testing.assert_array_equal(np.asarray(x), ids)
    np.testing.assert_array_equal(np.asarray(y), ids)
    history = lm.fit(ids, epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    history = lm.fit({"token_ids": ids, "padding_mask": mask}, epochs=1, batch_size=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_a_tokenizer_with_more_ids_than_the_embedding_is_refused():
    vocabulary = dict(char_tokenizer().vocabulary)
    for i in range(100):
        vocabulary[f"extra{i}"] = len(vocabulary)
    big = keras_hub.tokenizers.GPT2Tokenizer(vocabulary=vocabulary, merges=char_tokenizer().merges)
    assert big.vocabulary_size() == 358
    with pytest.raises(ValueError, match=r"358.*vocabulary_size=258"):
        _lm(big, 258)
