"""Gemma 2 (keras-hub's `GemmaBackbone` with soft caps, post norms and sliding-window layers), linearized.

The teacher is a local Hugging Face-format gemma-2-2b checkpoint (published
`config.json`, two layers, small width; random `safetensors` weights) loaded
through keras-hub's own Gemma converter, which maps Gemma 2 configs
(``model_type: gemma2``). The soft caps are shrunk to the scale of the
random weights' scores and logits, so that ``tanh`` bends them (the
published 50 and 30 are linear at this scale: the test would not see them).
"""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from keras_linattn.models import LinearBackbone
from tests.linearization import _hf_checkpoints as hf
from tests.linearization.test_families_hf import (
    NEW,
    PROMPT,
    _check_exact_and_greedy,
    _ids,
    _student_greedy,
    _teacher_greedy,
    _teacher_logits,
)
from tests.tolerance import assert_close, bound

pytestmark = pytest.mark.numeric

ATTENTION_CAP, FINAL_CAP = 0.05, 1.0


def _config(**sizes):
    # One key/value head, head_dim 32 != width / heads (16), as gemma-2-2b's 256 != 2304 / 8. A local window of 4
    # tokens (the published 4096, shortened so that T = 12 reaches past it) within the student's 16.
    defaults = dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=4)
    defaults.update(attn_logit_softcapping=ATTENTION_CAP, final_logit_softcapping=FINAL_CAP)
    return hf.small("gemma-2-2b", **{**defaults, **sizes})


def _teacher(tmp_path_factory, name, config):
    keras.utils.set_random_seed(0)
    directory = tmp_path_factory.mktemp(name)
    hf.write_checkpoint(directory, config, hf.llama_layout_tensors(config, sandwich_norms=True))
    return hf.load("GemmaCausalLM", str(directory))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    config = _config()
    teacher = _teacher(tmp_path_factory, "gemma2", config)
    return teacher, keras_linattn.linearize(teacher, window_size=16), config


def test_gemma_2_checkpoint_with_soft_caps_and_local_layers_linearizes_exactly(gemma2):
    teacher, student, config = gemma2
    hub = teacher.backbone.get_config()
    assert (hub["attention_logit_soft_cap"], hub["final_logit_soft_cap"]) == (ATTENTION_CAP, FINAL_CAP)
    assert hub["use_sliding_window_attention"] and hub["use_post_attention_norm"] and hub["use_post_ffw_norm"]
    backbone = student.backbone
    assert backbone.final_logit_soft_cap == FINAL_CAP and backbone.post_norms
    blocks = backbone.decoder_blocks
    assert [b.attention.logit_soft_cap for b in blocks] == [ATTENTION_CAP] * 2
    # keras-hub makes even layers local: layer 0 keeps its 4-token window alone (exact softmax), layer 1 is global.
    assert [b.attention.recurrence.window_size for b in blocks] == [4, 16]
    assert [b.attention.recurrence.linear_weight for b in blocks] == [0.0, None]
    _check_exact_and_greedy(teacher, student, config)


def test_the_soft_caps_change_the_teachers_logits_beyond_the_bound(gemma2):
    # Without it, the exactness above would hold for a student that ignored the caps.
    teacher, _, config = gemma2
    ids = _ids(config["vocab_size"])
    capped = _teacher_logits(teacher, ids)
    layers, embedding = teacher.backbone.transformer_layers, teacher.backbone.token_embedding
    try:
        for layer in layers:
            layer.attention.logit_soft_cap = None
        no_attention_cap = _teacher_logits(teacher, ids)
        embedding.logit_soft_cap = None
        no_caps = _teacher_logits(teacher, ids)
    finally:
        for layer in layers:
            layer.attention.logit_soft_cap = ATTENTION_CAP
        embedding.logit_soft_cap = FINAL_CAP
    tolerance = bound(paths=8, n=config["hidden_size"]) * np.abs(capped).max()
    assert np.abs(no_attention_cap - capped).max() > 100 * tolerance
    assert np.abs(no_caps - no_attention_cap).max() > 100 * tolerance


def test_gemma_2_decode_state_is_declared_and_fixed_in_size(gemma2):
    _, student, config = gemma2
    backbone = student.backbone
    spec = backbone.state_spec()
    names = [entry.name for entry in spec]
    assert "decoder_block_0/window_k" in names and "decoder_block_1/S" in names
    shapes = {entry.name: (1, *entry.shape) for entry in spec}
    for length in (3, 20):  # past both windows: the state keeps its size
        ids = _ids(config["vocab_size"], length=length, batch=1)
        _, state = backbone.call_with_state(ids, backbone.get_initial_state(1))
        assert {entry.name: tuple(x.shape) for entry, x in zip(spec, state, strict=True)} == shapes


def test_gemma_2_student_config_round_trips_with_its_caps(gemma2):
    _, student, config = gemma2
    clone = LinearBackbone.from_config(student.backbone.get_config())
    clone.set_weights(student.backbone.get_weights())
    assert clone.final_logit_soft_cap == FINAL_CAP
    assert clone.decoder_blocks[1].attention.logit_soft_cap == ATTENTION_CAP
    ids = _ids(config["vocab_size"])
    head = lambda backbone: np.asarray(backbone.token_embedding(backbone(ids), reverse=True))  # noqa: E731
    np.testing.assert_array_equal(head(clone), head(student.backbone))


def test_query_scale_follows_the_teachers_layers(tmp_path_factory):
    # gemma-2-27b's query_pre_attn_scalar (144) is hidden_size / heads, not head_dim (128): the converter sets
    # query_head_dim_normalize=False. Here 16 (= 64 / 4) against head_dim 32.
    config = _config(query_pre_attn_scalar=16, sliding_window=32)
    teacher = _teacher(tmp_path_factory, "gemma2_scale", config)
    assert teacher.backbone.get_config()["query_head_dim_normalize"] is False
    ids = _ids(config["vocab_size"])
    # keras-hub 0.32's decoder block builds its attention with query_head_dim_normalize=True whatever the
    # backbone says: the student follows the layer (1 / sqrt(head_dim)).
    student = keras_linattn.linearize(teacher, window_size=16)
    # The teacher's local window (32) is longer than the student's: linearized like the global layer.
    assert [b.attention.recurrence.window_size for b in student.backbone.decoder_blocks] == [16, 16]
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=config["hidden_size"])
    # A layer that does scale by 1 / sqrt(hidden_dim / heads) gets that scale folded into the query kernel.
    for layer in teacher.backbone.transformer_layers:
        layer.attention.query_head_dim_normalize = False
    scaled = keras_linattn.linearize(teacher, window_size=16)
    kernel = lambda lm: np.asarray(lm.backbone.decoder_blocks[0].attention.query_dense.kernel)  # noqa: E731
    np.testing.assert_allclose(kernel(scaled), kernel(student) * np.sqrt(32 / 16), rtol=1e-6)
    assert_close(np.asarray(scaled(ids)), _teacher_logits(teacher, ids), paths=8, n=config["hidden_size"])


def test_one_post_norm_alone_is_named_in_the_error():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=30,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        head_dim=4,
        use_post_attention_norm=True,
    )
    with pytest.raises(TypeError, match="use_post_attention_norm=True, use_post_ffw_norm=False"):
        keras_linattn.linearize(backbone)


@pytest.fixture
def eager_functions():
    """`tf.function`s run eagerly: `fit`'s train step runs the same code without tracing it (a smoke test's cost)."""
    import tensorflow as tf

    tf.config.run_functions_eagerly(True)
    yield
    tf.config.run_functions_eagerly(False)


@pytest.mark.usefixtures("eager_functions")
def test_gemma_2_attention_transfer_and_lora_run(gemma2):
    from keras_linattn.linearization import enable_lora, merge_lora

    teacher, _, config = gemma2
    student = keras_linattn.linearize(teacher, window_size=8)  # the global layer's window is shorter than T
    ids = _ids(config["vocab_size"], length=16, batch=4)
    global_map = student.backbone.decoder_blocks[1].attention.feature_map
    before = [np.asarray(w) for w in global_map.trainable_weights]
    keras_linattn.attention_transfer(
        student, teacher, {"token_ids": ids, "padding_mask": np.ones_like(ids)}, steps=2, batch_size=2, verbose=0
    )
    assert any(np.abs(np.asarray(w) - b).max() > 0 for w, b in zip(global_map.trainable_weights, before, strict=True))
    logits = np.asarray(student(ids))
    enable_lora(student, rank=4)
    merge_lora(student)  # LoRA's B starts at zero: merging it gives the same model
    assert_close(np.asarray(student(ids)), logits, paths=8, n=config["hidden_size"])


@pytest.mark.slow
def test_gemma_2_student_generates_the_teachers_tokens_and_its_exports_verify(gemma2, tmp_path):
    from keras_linattn import export

    teacher, student, config = gemma2
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=2)
    want = _teacher_greedy(teacher, prompt, PROMPT + NEW)
    np.testing.assert_array_equal(_student_greedy(student, prompt, PROMPT + NEW), want)
    got = student.generate(prompt, max_length=PROMPT + NEW, sampler="greedy", stop_token_ids=None)
    np.testing.assert_array_equal(np.asarray(got), want)
    version_dir = export.export_saved_model(student, str(tmp_path / "sm"))
    paths = export.export_onnx(student, str(tmp_path / "lm.onnx"))
    report = export.verify(
        student,
        saved_model_dir=version_dir,
        onnx_path=paths["model"],
        onnx_step_path=paths["step"],
        onnx_generate_path=paths.get("generate"),
        shapes=[(1, 7), (2, 13)],
        decode_steps=8,
    )
    assert report.ok, report


def test_without_a_window_there_is_no_softmax_score_to_cap(gemma2):
    teacher, _, _ = gemma2
    student = keras_linattn.linearize(teacher, window_size=None)
    blocks = student.backbone.decoder_blocks
    assert [b.attention.logit_soft_cap for b in blocks] == [None, None]
    assert [type(b.attention.recurrence).__name__ for b in blocks] == ["AdditiveRecurrence"] * 2
    assert student.backbone.final_logit_soft_cap == FINAL_CAP  # the head's cap does not need a window


def test_a_final_logit_soft_cap_must_be_positive():
    with pytest.raises(ValueError, match="final_logit_soft_cap.*Received.*0"):
        LinearBackbone(
            vocabulary_size=8, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=8, final_logit_soft_cap=0
        )
