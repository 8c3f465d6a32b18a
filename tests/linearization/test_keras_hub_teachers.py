"""keras-hub teachers linearized: weights copied, exact with a window that covers the sequence."""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from keras_linattn.linearization._keras_hub import linearize_keras_hub
from keras_linattn.models import LinearBackbone, LinearCausalLM
from tests.tolerance import assert_close

T = 12


def _ids(vocab, batch=2, length=T, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype("int32")


def _gpt2():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=60, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
    )
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _teacher_logits(teacher, ids):
    return np.asarray(teacher({"token_ids": ids, "padding_mask": np.ones_like(ids)}), "float64")


def test_gpt2_with_a_covering_window_gives_the_teachers_logits():
    teacher = _gpt2()
    before = [np.asarray(w) for w in teacher.weights]
    student = linearize_keras_hub(teacher, feature_map="hedgehog", window_size=T)
    assert type(student) is LinearCausalLM
    ids = _ids(60)
    want = _teacher_logits(teacher, ids)
    # Two blocks of float32 attention + MLP on width 16: error model with the width as reduction length.
    assert_close(np.asarray(student(ids)), want, paths=8, n=32)
    for w, b in zip(teacher.weights, before, strict=True):
        np.testing.assert_array_equal(np.asarray(w), b)  # the teacher is unchanged


def test_gpt2_window_shorter_than_the_sequence_differs_from_the_teacher():
    teacher = _gpt2()
    student = linearize_keras_hub(teacher, feature_map="hedgehog", window_size=2)
    ids = _ids(60)
    assert np.abs(np.asarray(student(ids)) - _teacher_logits(teacher, ids)).max() > 1e-3


def test_gpt2_student_decodes_step_by_step_like_its_parallel_pass():
    student = linearize_keras_hub(_gpt2(), feature_map="hedgehog", window_size=4)
    ids = _ids(60, length=10)
    parallel = np.asarray(student(ids))
    state = student.get_initial_state(2)
    for t in range(10):
        logits, state = student.step(ids[:, t], state)
        assert_close(np.asarray(logits), parallel[:, t], paths=8, n=32)


def test_backbone_teacher_gives_a_linear_backbone():
    student = linearize_keras_hub(_gpt2().backbone, window_size=T)
    assert type(student) is LinearBackbone


def test_unsupported_family_is_named_with_the_reason():
    keras.utils.set_random_seed(0)
    gemma = keras_hub.models.GemmaBackbone(
        vocabulary_size=30,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
        use_post_ffw_norm=True,  # without Gemma 2's post-attention norm: the student has both or neither
    )
    with pytest.raises(TypeError, match="Gemma's post norms .*Received: use_post_attention_norm=False"):
        linearize_keras_hub(gemma)


def _llama():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=60, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def test_llama_with_a_covering_window_gives_the_teachers_logits():
    teacher = _llama()
    student = keras_linattn.linearize(teacher, window_size=T)
    assert type(student) is LinearCausalLM
    assert student.backbone.decoder_blocks[0].attention.num_key_value_heads == 2
    ids = _ids(60)
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=32)


def test_llama_student_step_equals_parallel_with_rope_and_gqa():
    student = keras_linattn.linearize(_llama(), window_size=3)
    ids = _ids(60, length=9)
    parallel = np.asarray(student(ids))
    state = student.get_initial_state(2)
    for t in range(9):
        logits, state = student.step(ids[:, t], state)
        assert_close(np.asarray(logits), parallel[:, t], paths=8, n=32)


def test_linearized_student_round_trips_through_a_preset(tmp_path):
    from tests.models.test_keras_hub_shape import char_tokenizer

    keras.utils.set_random_seed(0)
    tokenizer = char_tokenizer()
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=32,
    )
    teacher = keras_hub.models.GPT2CausalLM(backbone, keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, 16))
    student = keras_linattn.linearize(teacher, window_size=4)
    assert student.preprocessor.tokenizer is tokenizer
    student.save_to_preset(str(tmp_path / "p"))  # config, weights and the tokenizer's assets
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "p"))
    assert type(loaded) is LinearCausalLM
    ids = _ids(tokenizer.vocabulary_size())
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(student(ids)))


def test_own_lm_is_relinearized_with_another_attention():
    keras.utils.set_random_seed(0)
    teacher = LinearCausalLM(vocabulary_size=40, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32)
    student = keras_linattn.linearize(teacher, feature_map="hedgehog", window_size=T)
    assert student.backbone.decoder_blocks[0].attention.recurrence.registry_name == "window"
    np.testing.assert_array_equal(
        np.asarray(student.backbone.decoder_blocks[1]._ffn_output.kernel),
        np.asarray(teacher.backbone.decoder_blocks[1]._ffn_output.kernel),
    )


def test_llama_with_tied_embeddings_gives_the_teachers_logits():
    """Llama 3.2's own config ties the embeddings; keras-hub's `get_config` omits the flag."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=60,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        tie_word_embeddings=True,
    )
    teacher = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    student = keras_linattn.linearize(teacher, window_size=T)
    assert student.backbone.tie_embeddings
    ids = _ids(60)
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=32)


def test_hub_teacher_dtype_argument_sets_the_students_policy():
    student = keras_linattn.linearize(_gpt2(), window_size=T, dtype="mixed_bfloat16")
    assert student.backbone.dtype_policy.name == "mixed_bfloat16"
    assert student.backbone.decoder_blocks[0].attention.dtype_policy.name == "mixed_bfloat16"
