"""`attention_transfer` checks every batch's token ids and lengths, not only the first, under XLA too.

Before: an out-of-range id in a later batch trained silently under XLA (the gather clamps it to the
last row: id 1040 trained as id 39) and failed with TF's raw "indices[...] is not in [0, 40)" without;
a row longer than the teacher's ``max_sequence_length`` in a later batch failed with "Expected size[0]
in [0, 16], but got 20".
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn

V, LIMIT = 40, 16


@pytest.fixture(scope="module")
def models():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=LIMIT
    )
    teacher = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    return teacher, keras_linattn.linearize(teacher, window_size=4)


@pytest.fixture(scope="module")
def small_models():
    """An embedding and one causal attention layer (XLA compiles its training step in seconds)."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(V, 8)(ids)
    teacher = keras.Model(ids, keras.layers.MultiHeadAttention(1, 4, name="attention")(x, x, use_causal_mask=True))
    teacher.vocabulary_size = V  # what the batch check reads (keras-hub backbones have it)
    return teacher, keras_linattn.linearize(teacher, window_size=2)


def _batches(*arrays):
    """A dataset of one batch per array (rows of different lengths allowed)."""
    dataset = None
    for ids in arrays:
        part = tf.data.Dataset.from_tensor_slices({"token_ids": ids, "padding_mask": np.ones_like(ids)})
        part = part.batch(len(ids))
        dataset = part if dataset is None else dataset.concatenate(part)
    return dataset


def _ids(seed, shape, dtype="int32"):
    return np.random.default_rng(seed).integers(0, V, shape).astype(dtype)


@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "xla"])
def test_an_id_outside_the_vocabulary_in_a_later_batch_is_refused(small_models, jit_compile):
    # The check runs in the input pipeline, outside the compiled step: the same with and without XLA.
    teacher, student = small_models
    bad = _ids(2, (4, 8), "int64")
    bad[1, 5] = 1040
    data = tf.data.Dataset.from_tensor_slices(np.concatenate([_ids(0, (4, 8), "int64"), bad])).batch(4)
    pattern = r"`data` batch 1 \(counted from 0\) holds token ids outside .*vocabulary_size=40.*max 1040"
    with pytest.raises(ValueError, match=pattern):
        keras_linattn.attention_transfer(student, teacher, data, steps=2, verbose=0, jit_compile=jit_compile)


def test_a_row_longer_than_the_teachers_limit_in_a_later_batch_is_refused(models):
    teacher, student = models
    data = _batches(_ids(0, (4, 12)), _ids(1, (4, 20)))
    with pytest.raises(ValueError, match=r"`data` batch 1 .*max_sequence_length=16.*Received: rows of 20 tokens"):
        keras_linattn.attention_transfer(student, teacher, data, steps=2, verbose=0)


@pytest.mark.slow
def test_validation_batches_are_checked_too(models):
    teacher, student = models
    bad = _ids(1, (4, 8))
    bad[0, 0] = -1
    with pytest.raises(ValueError, match=r"`validation_data` batch 0 .*min -1"):
        keras_linattn.attention_transfer(
            student, teacher, _batches(_ids(0, (4, 8))), steps=1, validation_data=_batches(bad), verbose=0
        )
