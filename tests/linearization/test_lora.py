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
    returns a new model), so it is built, compiled and fitted once.

    A module fixture is built before the first test's own `clear_session` (conftest's autouse
    fixture): without one here, its layers' generated names (`hedgehog_feature_map_1`, ...) would
    depend on what the test module run before this one left in the process."""
    keras.utils.clear_session(free_memory=False)
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


def _lora_lm(tokenizer=None):
    """A GPT-2 student (as `_student`) with rank-2 adapters (alpha 4), compiled, after 2 epochs of fit."""
    keras.utils.set_random_seed(0)
    preprocessor = None
    vocab = 40
    if tokenizer is not None:
        vocab = tokenizer.vocabulary_size()
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, 16)
    teacher = keras_hub.models.GPT2CausalLM(
        keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=32,
            dropout=0.0,  # the next-epoch losses compare exactly
        ),
        preprocessor=preprocessor,
    )
    student = keras_linattn.linearize(teacher, window_size=4)
    enable_lora(student, rank=2, alpha=4)
    student.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(True))
    ids = _ids()
    if tokenizer is None:
        student.fit(ids[:, :-1], ids[:, 1:], epochs=2, verbose=0)
    else:
        student.fit(["a short text", "another one", "and more text", "the end"], batch_size=4, epochs=2, verbose=0)
    return student, ids


def _lora_state(model):
    """Per projection: (rank, alpha, raw kernel, A, B), and the paths of the trainable variables."""
    from keras_linattn.layers import LinearAttention

    state = {}
    for layer in [x for x in model.backbone.decoder_blocks]:
        attention = layer.attention
        assert isinstance(attention, LinearAttention)
        for dense in (attention.query_dense, attention.key_dense, attention.value_dense, attention.output_dense):
            assert dense.lora_enabled, dense.path
            state[dense.path] = (
                dense.lora_rank,
                dense.lora_alpha,
                np.asarray(dense._kernel),
                np.asarray(dense.lora_kernel_a),
                np.asarray(dense.lora_kernel_b),
            )
    return state, sorted(v.path for v in model.trainable_variables)


def _assert_same_lora(loaded, student):
    (want, want_trainable), (got, got_trainable) = _lora_state(student), _lora_state(loaded)
    assert got_trainable == want_trainable  # only the adapters train (the frozen flags survived)
    assert sorted(got) == sorted(want)
    for path, (rank, alpha, kernel, a, b) in want.items():
        assert got[path][:2] == (rank, alpha), path
        for x, y in zip(got[path][2:], (kernel, a, b), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=path)


def test_keras_file_of_a_lora_student_keeps_adapters_flags_and_optimizer(tmp_path):
    student, ids = _lora_lm()
    path = str(tmp_path / "lora.keras")
    student.save(path)
    loaded = keras.saving.load_model(path)
    _assert_same_lora(loaded, student)
    assert int(loaded.optimizer.iterations) == int(student.optimizer.iterations) == 2
    # The next epoch from the file is the next epoch of the live model.
    want = student.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0).history["loss"]
    got = loaded.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_preset_of_a_lora_student_keeps_adapters_and_flags(tmp_path):
    from tests.models.test_keras_hub_shape import char_tokenizer

    student, _ = _lora_lm(char_tokenizer())
    student.save_to_preset(str(tmp_path / "p"))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path / "p"))
    _assert_same_lora(loaded, student)
    ids = _ids()
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(student(ids)))


def test_functional_lora_student_refuses_to_save_with_the_fix(tmp_path):
    inputs = keras.Input((8, 16))
    teacher = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 8)(inputs, inputs, use_causal_mask=True))
    student = keras_linattn.linearize(teacher, window_size=4)
    enable_lora(student, rank=2)
    with pytest.raises(ValueError, match="merge_lora"):
        student.save(str(tmp_path / "f.keras"))
    merged = merge_lora(student)  # the fix the message names works
    merged.save(str(tmp_path / "f.keras"))


def test_merged_model_trains_its_feature_maps(lora_trained):
    from keras_linattn.linearization import transfer_variables

    student = lora_trained[0]
    merged = merge_lora(student)
    # What a student fresh from `linearize` trains, the merged model trains (every weight, maps included).
    assert sorted(v.path for v in merged.trainable_variables) == sorted(v.path for v in _student().trainable_variables)
    maps = [v for block in merged.backbone.decoder_blocks for v in block.attention.feature_map.weights]
    assert maps and all(v.trainable for v in maps)
    teacher = keras_hub.models.GPT2CausalLM(
        keras_hub.models.GPT2Backbone(
            vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
        ),
        preprocessor=None,
    )
    before = [np.asarray(v).copy() for v in maps]
    ids = _ids()
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    keras_linattn.attention_transfer(merged, teacher, x, steps=2, batch_size=4, verbose=0)
    changed = [not np.array_equal(np.asarray(v), b) for v, b in zip(maps, before, strict=True)]
    assert all(changed)
    assert transfer_variables(merged.backbone.decoder_blocks[0].attention)


def test_merged_model_keeps_the_compile_settings(lora_trained):
    student = lora_trained[0]
    student.compile(
        optimizer=keras.optimizers.SGD(0.125),
        loss=keras.losses.SparseCategoricalCrossentropy(True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        sampler=keras_hub.samplers.TopKSampler(k=3),
    )
    merged = merge_lora(student)
    assert isinstance(merged.optimizer, keras.optimizers.SGD)
    assert float(merged.optimizer.learning_rate) == 0.125
    assert isinstance(merged.sampler, keras_hub.samplers.TopKSampler) and merged.sampler.k == 3
    assert merged.get_compile_config()["weighted_metrics"] == student.get_compile_config()["weighted_metrics"]


def test_merge_copies_every_weight_in_memory_with_the_preprocessor_shared(monkeypatch):
    """The weights reach the merged model layer by layer, with no file: at 1B parameters a
    `.weights.h5` written and read back cost ~12 GB more than the two models. Every weight but
    the projection kernels is copied exactly, each kernel is the live ``W + (alpha / r) A B``, and
    a keras-hub task's preprocessor is the same object in both."""
    from tests.models.test_keras_hub_shape import char_tokenizer

    student, _ = _lora_lm(char_tokenizer())

    def refuse(*args, **kwargs):
        raise AssertionError("merge_lora went through a weights file")

    monkeypatch.setattr(keras.Model, "save_weights", refuse)
    monkeypatch.setattr(keras.Model, "load_weights", refuse)
    merged = merge_lora(student)
    assert merged.preprocessor is student.preprocessor
    denses = [
        dense
        for layer in student.backbone.decoder_blocks
        for dense in (layer.attention.query_dense, layer.attention.key_dense)
        + (layer.attention.value_dense, layer.attention.output_dense)
    ]
    kernels = {dense.path + "/kernel": np.asarray(dense.kernel) for dense in denses}  # Keras merges W + s A B
    assert len(kernels) == 8
    assert any(not np.array_equal(np.asarray(d._kernel), kernels[d.path + "/kernel"]) for d in denses)  # A B != 0
    want = {v.path: np.asarray(v) for v in student.weights if not v.path.endswith(("lora_kernel_a", "lora_kernel_b"))}
    want.update(kernels)
    got = {v.path: np.asarray(v) for v in merged.weights}
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=path)


def test_merge_in_place_equals_the_new_model_and_leaves_no_adapter(tmp_path):
    """``in_place=True`` merges into the argument (no second model: what fits at 1B): the same weights
    as the default's new model, no adapter variable or config record, every weight trainable, the
    compile settings kept with a fresh optimizer; saved and loaded it computes the same, and LoRA can
    be enabled on it again."""
    student, ids = _lora_lm()
    student.compile(
        optimizer=keras.optimizers.SGD(0.25),
        loss=keras.losses.SparseCategoricalCrossentropy(True),
        sampler=keras_hub.samplers.TopKSampler(k=3),
    )
    new = merge_lora(student)
    merged = merge_lora(student, in_place=True)
    assert merged is student
    assert lora_variables(merged) == [] and merged.backbone.get_config().get("lora") is None
    for dense in (merged.backbone.decoder_blocks[0].attention.query_dense,):
        assert not dense.lora_enabled and not hasattr(dense, "lora_kernel_a")
    assert sorted(v.path for v in merged.weights) == sorted(v.path for v in new.weights)
    want = {v.path: np.asarray(v) for v in new.weights}
    for v in merged.weights:
        np.testing.assert_array_equal(np.asarray(v), want[v.path], err_msg=v.path)
    assert sorted(v.path for v in merged.trainable_variables) == sorted(v.path for v in new.trainable_variables)
    assert isinstance(merged.optimizer, keras.optimizers.SGD) and float(merged.optimizer.learning_rate) == 0.25
    assert int(merged.optimizer.iterations) == 0  # a fresh optimizer: the old state belonged to the adapters
    for model in (merged, new):  # no slots until it trains (Adam's would be 2 copies of every weight)
        assert not model.optimizer.built
    assert isinstance(merged.sampler, keras_hub.samplers.TopKSampler)
    logits = np.asarray(merged(ids))
    np.testing.assert_array_equal(logits, np.asarray(new(ids)))
    path = str(tmp_path / "merged.keras")
    merged.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(ids)), logits)
    assert not lora_variables(loaded)
    merged.fit(ids[:, :-1], ids[:, 1:], epochs=1, verbose=0)  # trains every weight, maps included
    assert merged.optimizer.built
    assert len(enable_lora(merged, rank=2)) == 2 * 2 * 4


def test_merge_in_place_refuses_a_non_bool():
    student, _ = _lora_lm()
    with pytest.raises(ValueError, match="in_place"):
        merge_lora(student, in_place="yes")
    assert lora_variables(student)  # nothing was merged


@pytest.mark.parametrize("in_place", [False, True])
def test_a_merged_functional_student_trains_every_weight(in_place):
    """A functional student's config records its frozen layers, and on the TensorFlow backend
    ``layer.trainable = True`` is skipped for a layer that already is: the merged model must still
    train every weight the student trained before `enable_lora` (the kernels and biases included)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    teacher = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 8)(inputs, inputs, use_causal_mask=True))
    student = keras_linattn.linearize(teacher, window_size=4)
    want = sorted((v.name, tuple(v.shape)) for v in student.trainable_variables)  # paths differ in a new model
    enable_lora(student, rank=2)
    merged = merge_lora(student, in_place=in_place)
    assert sorted((v.name, tuple(v.shape)) for v in merged.trainable_variables) == want
    assert len(merged.trainable_variables) == len(merged.weights)
