"""LoRA on a linearized model's attention projections, merged before export."""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from keras_linattn.linearization import enable_lora, lora_variables, merge_lora
from tests.tolerance import assert_close


def _student():
    keras.utils.set_random_seed(0)
    teacher = keras_hub.models.GPT2CausalLM(
        keras_hub.models.GPT2Backbone(
            vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
        ),
        preprocessor=None,
    )
    return keras_linattn.linearize(teacher, window_size=4)


def _ids(length=10):
    return np.random.default_rng(0).integers(0, 40, (4, length)).astype("int32")


@pytest.fixture(scope="module")
def lora_trained():
    """A student with rank-2 adapters after 2 epochs of fit: ``(student, weights before, adapters,
    trainable variables right after enable_lora, ids)``. The tests below only read it (merge_lora
    returns a new model), so it is built, compiled and fitted once."""
    student = _student()
    before = {v.path: np.asarray(v) for v in student.weights}
    adapters = enable_lora(student, rank=2, alpha=4)
    trainable = list(student.trainable_variables)
    student.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))
    ids = _ids()
    student.fit(ids[:, :-1], ids[:, 1:], epochs=2, verbose=0)
    return student, before, adapters, trainable, ids


def test_only_the_adapters_train_and_the_kernel_is_w_plus_scaled_ab(lora_trained):
    student, before, adapters, trainable, _ = lora_trained
    assert len(adapters) == 2 * 2 * 4  # A and B, on q/k/v/o, in 2 blocks
    assert {id(v) for v in trainable} == {id(v) for v in adapters}
    lora_paths = {v.path for v in adapters}
    for v in student.weights:
        if v.path not in lora_paths:  # everything but the adapters is frozen (maps and gamma included)
            np.testing.assert_array_equal(np.asarray(v), before[v.path], err_msg=v.path)
    dense = student.backbone.decoder_blocks[0].attention.query_dense
    a, b = np.asarray(dense.lora_kernel_a, "float64"), np.asarray(dense.lora_kernel_b, "float64")
    assert np.abs(b).max() > 0  # B left zero-init: the adapters trained
    want = np.asarray(dense._kernel, "float64") + (4 / 2) * np.tensordot(a, b, axes=1)  # A [..., r] B [r, D]
    assert_close(np.asarray(dense.kernel), want, paths=2, n=2)


def test_merged_model_has_no_adapters_and_the_same_logits(lora_trained):
    student, _, _, _, ids = lora_trained
    merged = merge_lora(student)
    assert type(merged) is type(student)
    with pytest.raises(ValueError, match="no LinearAttention|no LoRA"):
        lora_variables(merged) or merge_lora(merged)
    # One more rounding of the merged kernel (W + s A B in float32), through 2 blocks.
    assert_close(np.asarray(merged(ids)), np.asarray(student(ids), "float64"), paths=8, n=32)
    assert all(not v.path.endswith(("lora_kernel_a", "lora_kernel_b")) for v in merged.weights)


def test_bad_arguments():
    student = _student()
    with pytest.raises(ValueError, match="rank"):
        enable_lora(student, rank=0)
    with pytest.raises(ValueError, match="alpha"):
        enable_lora(student, rank=2, alpha=-1)
    with pytest.raises(ValueError, match="no LinearAttention"):
        enable_lora(keras.Sequential([keras.layers.Dense(2)]), rank=2)
    enable_lora(student, rank=2)
    with pytest.raises(ValueError, match="already enabled"):
        enable_lora(student, rank=2)
