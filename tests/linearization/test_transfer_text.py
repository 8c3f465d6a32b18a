"""`attention_transfer` takes text: the teacher's preprocessor tokenizes it, as `fit` and `generate` do."""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn

TEXTS = ["some text", "another line of text", "def f(x):", "import os"]


def _gpt2(with_preprocessor=True):
    tokens = ["<|endoftext|>", "Ġ", "ĠĠ", *map(chr, range(33, 127))]
    tokenizer = keras_hub.tokenizers.GPT2Tokenizer(vocabulary={t: i for i, t in enumerate(tokens)}, merges=["Ġ Ġ"])
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
        dropout=0.0,
    )
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, 16) if with_preprocessor else None
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=preprocessor)


def _transfer(teacher, data):
    keras.utils.set_random_seed(1)
    student = keras_linattn.linearize(teacher, window_size=4)
    _, history = keras_linattn.attention_transfer(student, teacher, data, steps=2, batch_size=2, verbose=0)
    return history.history["loss"]


def test_strings_go_through_the_teachers_preprocessor():
    teacher = _gpt2()
    x, _, _ = keras.utils.unpack_x_y_sample_weight(teacher.preprocessor(TEXTS))
    ids = {k: np.asarray(v) for k, v in x.items()}
    from_text = _transfer(teacher, TEXTS)
    assert np.isfinite(from_text).all()
    # The same batches as the tokenized arrays, so the same losses (one computation, twice).
    np.testing.assert_array_equal(from_text, _transfer(teacher, ids))


def test_strings_without_a_preprocessor_name_the_fix():
    teacher = _gpt2(with_preprocessor=False)
    student = keras_linattn.linearize(teacher, window_size=4)
    with pytest.raises(ValueError, match="neither the teacher nor the student has a preprocessor"):
        keras_linattn.attention_transfer(student, teacher, TEXTS, steps=1, batch_size=2, verbose=0)
