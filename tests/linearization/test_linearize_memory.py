"""`linearize` holds a keras-hub teacher's weights once, not twice (issue 58: the 1B flow fits in memory)."""

import gc
import weakref

import keras
import numpy as np
import pytest

import keras_linattn

keras_hub = pytest.importorskip("keras_hub")

pytestmark = pytest.mark.tf_only("reads TensorFlow tensors' buffers")


def _teacher():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=50, num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=16, intermediate_dim=32
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def _buffer(variable):
    return variable.value.read_value()._numpy()  # TensorFlow: a view of the tensor's buffer, no copy


@pytest.fixture(scope="module")
def pair():
    teacher = _teacher()
    return teacher, keras_linattn.linearize(teacher, window_size=4)


def _copied(pair):
    teacher, student = pair
    return [
        (student.backbone.token_embedding.embeddings, teacher.backbone.token_embedding.embeddings),
        (
            student.backbone.decoder_blocks[0]._ffn_gate.kernel,
            teacher.backbone.transformer_layers[0]._feedforward_gate_dense.kernel,
        ),
    ]


def test_copied_weights_share_the_teachers_buffers(pair):
    for ours, theirs in _copied(pair):
        assert np.shares_memory(_buffer(ours), _buffer(theirs)), ours.path


def test_a_write_to_either_model_leaves_the_other_unchanged(pair):
    (ours, theirs), (ours2, theirs2) = _copied(pair)
    before = np.array(_buffer(theirs))
    ours.assign_add(np.ones(ours.shape, "float32"))
    np.testing.assert_array_equal(_buffer(theirs), before)
    np.testing.assert_array_equal(_buffer(ours), before + 1)
    student_before = np.array(_buffer(ours2))
    theirs2.assign(np.zeros(theirs2.shape, "float32"))
    np.testing.assert_array_equal(_buffer(ours2), student_before)


def test_the_student_keeps_no_reference_to_the_teacher():
    teacher = _teacher()
    refs = [weakref.ref(v) for v in teacher.weights] + [weakref.ref(teacher)]
    student = keras_linattn.linearize(teacher, window_size=4)
    del teacher
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert student.backbone.token_embedding.embeddings.shape == (50, 16)


def test_copied_weights_are_never_filled_by_their_initializer(monkeypatch):
    from keras.src import backend
    from keras.src.backend.common import global_state

    teacher = _teacher()
    initialized = []
    original = backend.Variable._initialize_with_initializer

    def spy(self, initializer):
        initialized.append(self.path)
        return original(self, initializer)

    monkeypatch.setattr(backend.Variable, "_initialize_with_initializer", spy)
    pending_before = len(global_state.get_global_attribute("uninitialized_variables", []) or [])
    student = keras_linattn.linearize(teacher, window_size=4)
    copied = {"token_embedding/embeddings", "decoder_block_0/feedforward_gate_dense/kernel"}
    assert copied <= {w.path for w in student.backbone.weights}
    assert not copied & set(initialized)  # the teacher's values are their first values
    assert initialized  # weights of the new attention (the feature maps) kept their initializer
    # Nothing is left in Keras' list of variables awaiting initialization.
    assert len(global_state.get_global_attribute("uninitialized_variables", []) or []) == pending_before
    for ours, theirs in _copied((teacher, student)):
        np.testing.assert_array_equal(_buffer(ours), _buffer(theirs))
