"""Mixture-of-experts families (Mixtral, Qwen MoE, Qwen 3 MoE) from local Hugging Face-format checkpoints.

Each checkpoint directory has the model card's `config.json` (typed in
`tests/linearization/_hf_checkpoints.py`, not downloaded) with two layers,
a small width, four experts and top-2 routing, and random `safetensors`
weights; keras-hub's own converter loads it. The student's feed-forwards
are `keras_linattn.layers.MixtureOfExperts` with the teacher's weights; with
a softmax window that covers the sequence it computes the teacher's
function.
"""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import MixtureOfExperts
from tests.linearization import _hf_checkpoints as hf
from tests.linearization.test_families_hf import (
    NEW,
    PROMPT,
    _check_exact_and_greedy,
    _ids,
    _teacher_greedy,
    _teacher_logits,
)
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric


def _linearized(tmp_path_factory, name, causal_lm, config, **tensor_options):
    keras.utils.set_random_seed(0)
    directory = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf.write_checkpoint(directory, config, hf.moe_tensors(config, **tensor_options))
    teacher = hf.load(causal_lm, str(directory))
    student = keras_linattn.linearize(teacher, window_size=16)
    return teacher, student


def _check_moe_blocks(student, config, shared=None):
    """Every block's feed-forward is a `MixtureOfExperts` of the config's experts and top-k."""
    experts = config.get("num_local_experts", config.get("num_experts"))
    for block in student.backbone.decoder_blocks:
        moe = block._moe
        assert isinstance(moe, MixtureOfExperts)
        assert (moe.num_experts, moe.top_k, moe.shared_expert_dim) == (experts, config["num_experts_per_tok"], shared)
        assert block._ffn_gate is None  # no dense feed-forward beside the experts


def _check_exact_greedy_and_flat_state(teacher, student, config):
    """Logits within the bound, greedy tokens equal to keras-hub's `generate`, and a declared, fixed-size state.

    The state is `state_spec`'s (per block, then the position) and keeps its
    shapes at every step of the greedy decoding: a decode step costs the
    same at every length.
    """
    backbone = student.backbone
    spec = backbone.state_spec()
    assert [entry.name.split("/")[0] for entry in spec[:-1]] == [
        block.name for block in backbone.decoder_blocks for _ in block.attention.state_spec()
    ]
    assert spec[-1].name == "position"
    ids = _ids(config["vocab_size"])
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=config["hidden_size"])
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=1)
    state = student.get_initial_state(prompt.shape[0])
    tokens = [prompt[:, t] for t in range(PROMPT)]
    for t in range(PROMPT + NEW - 1):
        logits, state = student.step(tokens[t], state)
        backbone.check_state(state, batch_size=prompt.shape[0])
        if t + 1 >= len(tokens):
            tokens.append(np.argmax(np.asarray(logits), axis=-1).astype("int32"))
    np.testing.assert_array_equal(np.asarray(state[-1]), PROMPT + NEW - 1)
    np.testing.assert_array_equal(np.stack(tokens, axis=1), _teacher_greedy(teacher, prompt, PROMPT + NEW))


# ------------------------------------------------------------------ Mixtral
@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = hf.small_moe("Mixtral-8x7B-v0.1")
    return (*_linearized(tmp_path_factory, "mixtral", "MixtralCausalLM", config), config)


def test_mixtral_8x7b_checkpoint_linearizes_exactly(mixtral):
    teacher, student, config = mixtral
    _check_moe_blocks(student, config)
    assert student.backbone.decoder_blocks[0]._moe.normalize_top_k
    assert not student.backbone.tie_embeddings
    _check_exact_greedy_and_flat_state(teacher, student, config)


def test_mixtral_sliding_window_within_the_students_stays_exact_softmax(tmp_path_factory):
    # Mixtral-8x7B-v0.1 publishes sliding_window null; 4 tokens here, shorter than the T = 12 of the check and
    # than the student's 16, so the teacher's layers are local over the sequence.
    config = hf.small_moe("Mixtral-8x7B-v0.1", sliding_window=4)
    teacher, student = _linearized(tmp_path_factory, "mixtral_local", "MixtralCausalLM", config)
    recurrence = student.backbone.decoder_blocks[0].attention.recurrence
    assert (recurrence.window_size, recurrence.linear_weight) == (4, 0.0)
    _check_exact_and_greedy(teacher, student, config)


def test_mixtral_student_lora_adapts_the_attention_leaves_the_experts_and_merges(mixtral):
    from keras_linattn.linearization import enable_lora, merge_lora

    teacher, _, config = mixtral
    student = keras_linattn.linearize(teacher, window_size=16)
    ids = _ids(config["vocab_size"])
    logits = np.asarray(student(ids))
    adapters = enable_lora(student, rank=4)
    experts = student.backbone.decoder_blocks[0]._moe
    assert experts.weights and not experts.trainable_weights  # the experts and the router are frozen
    assert {id(v) for v in student.trainable_variables} == {id(v) for v in adapters}
    merge_lora(student)  # LoRA's B starts at zero: merging it gives the same model
    assert_close(np.asarray(student(ids)), logits, paths=8, n=config["hidden_size"])


@pytest.mark.slow  # tracing the trainer's step through two MoE models takes about 20 s on two cores
def test_mixtral_attention_transfer_trains_the_feature_maps(mixtral):
    teacher, _, config = mixtral
    student = keras_linattn.linearize(teacher, window_size=8)  # shorter than T: the feature maps have work to do
    ids = _ids(config["vocab_size"], length=12, batch=2)
    feature_map = student.backbone.decoder_blocks[0].attention.feature_map
    router = student.backbone.decoder_blocks[0]._moe.router_kernel
    before = [np.asarray(w) for w in feature_map.trainable_weights]
    router_before = np.asarray(router)
    keras_linattn.attention_transfer(
        student, teacher, {"token_ids": ids, "padding_mask": np.ones_like(ids)}, steps=1, batch_size=2, verbose=0
    )
    assert any(np.abs(np.asarray(w) - b).max() > 0 for w, b in zip(feature_map.trainable_weights, before, strict=True))
    np.testing.assert_array_equal(np.asarray(router), router_before)  # transfer trains the attention only


@pytest.mark.slow
def test_mixtral_student_exports_verify(mixtral, tmp_path):
    # The routing (softmax, top-k, one-hot) in the sequence graphs and the gathered experts in the step graphs.
    from keras_linattn import export

    _, student, _ = mixtral
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


# ------------------------------------------------------------------ Qwen1.5-MoE (shared expert, q/k/v biases)
@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    config = hf.small_moe("Qwen1.5-MoE-A2.7B")
    return (*_linearized(tmp_path_factory, "qwen_moe", "QwenMoeCausalLM", config, attention_bias=True), config)


def test_qwen1_5_moe_checkpoint_with_a_shared_expert_linearizes_exactly(qwen_moe):
    teacher, student, config = qwen_moe
    _check_moe_blocks(student, config, shared=config["shared_expert_intermediate_size"])
    moe = student.backbone.decoder_blocks[1]._moe
    assert not moe.normalize_top_k  # Qwen1.5-MoE's norm_topk_prob is false
    teacher_moe = teacher.backbone.get_layer("transformer_layer_1").mlp
    np.testing.assert_array_equal(
        np.asarray(moe.shared_weight_kernel), np.asarray(teacher_moe.shared_expert_gate_dense.kernel)
    )
    np.testing.assert_array_equal(np.asarray(student.backbone.decoder_blocks[0].attention.output_dense.bias), 0.0)
    _check_exact_greedy_and_flat_state(teacher, student, config)


@pytest.mark.slow  # compiling `generate` (XLA where it can) takes about 30 s on two cores
def test_qwen1_5_moe_student_generate_gives_the_teachers_greedy_tokens(qwen_moe):
    teacher, student, config = qwen_moe
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=2)
    got = student.generate(prompt, max_length=PROMPT + NEW, sampler="greedy", stop_token_ids=None)
    np.testing.assert_array_equal(np.asarray(got), _teacher_greedy(teacher, prompt, PROMPT + NEW))


def test_qwen_moe_dense_layers_keep_a_dense_feed_forward():
    # The student follows the teacher's layers as built. keras-hub 0.32's Qwen MoE backbone passes no
    # `layer_index` to its decoders, so with decoder_sparse_step 2 every layer is dense (index 0 for all), and
    # its Hugging Face converter cannot load dense layers (it reads `decoder_layer._feedforward_intermediate_dense`,
    # which the decoder lacks): the backbone is built from its constructor.
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.QwenMoeBackbone(
        vocabulary_size=97,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=96,
        moe_intermediate_dim=48,
        shared_expert_intermediate_dim=80,
        num_experts=4,
        top_k=2,
        decoder_sparse_step=2,
    )
    teacher = keras_hub.models.QwenMoeCausalLM(backbone, preprocessor=None)
    student = keras_linattn.linearize(teacher, window_size=16)
    assert all(not hasattr(layer.mlp, "expert_bank") for layer in backbone.transformer_layers)
    for block in student.backbone.decoder_blocks:
        assert block._moe is None and tuple(block._ffn_gate.kernel.shape) == (64, 96)
        np.testing.assert_array_equal(np.asarray(block._ffn_gate.bias), 0.0)  # Qwen's feed-forward has no bias
    ids = _ids(97)
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=64)


# ------------------------------------------------------------------ Qwen 3 MoE (q/k norms, own head dim)
@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    # Qwen3-30B-A3B's head_dim (128) is not hidden_size / heads (64): keep that shape, smaller.
    config = hf.small_moe("Qwen3-30B-A3B", head_dim=32)
    return (*_linearized(tmp_path_factory, "qwen3_moe", "Qwen3MoeCausalLM", config, qk_norm=True), config)


def test_qwen3_30b_a3b_checkpoint_linearizes_exactly(qwen3_moe):
    teacher, student, config = qwen3_moe
    _check_moe_blocks(student, config)
    attention = student.backbone.decoder_blocks[1].attention
    assert attention.key_dim == 32
    teacher_norm = teacher.backbone.get_layer("transformer_layer_1")._self_attention_layer._key_dense_layer_norm
    np.testing.assert_array_equal(np.asarray(attention.key_norm.scale), np.asarray(teacher_norm.scale))
    _check_exact_greedy_and_flat_state(teacher, student, config)


def test_the_decode_step_with_gathered_experts_gives_the_forward_logits(qwen3_moe):
    # The step form gathers the top-k experts' kernels: the same function as the sequence form.
    _, student, config = qwen3_moe
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=4)
    logits = np.asarray(student(prompt))
    state = student.get_initial_state(2)
    for t in range(PROMPT):
        step_logits, state = student.step(prompt[:, t], state)
    assert_close(np.asarray(step_logits), logits[:, -1], paths=8, n=config["hidden_size"])


def test_qwen3_moe_sliding_window_within_the_students_stays_exact_softmax(tmp_path_factory):
    # keras-hub's Qwen 3 MoE attention applies `sliding_window` whenever it is set (Qwen3-30B-A3B publishes
    # null); 4 tokens here, shorter than the T = 12 of the check and than the student's 16.
    config = hf.small_moe("Qwen3-30B-A3B", head_dim=32, sliding_window=4)
    teacher, student = _linearized(tmp_path_factory, "qwen3_moe_local", "Qwen3MoeCausalLM", config, qk_norm=True)
    recurrence = student.backbone.decoder_blocks[0].attention.recurrence
    assert (recurrence.window_size, recurrence.linear_weight) == (4, 0.0)
    _check_exact_and_greedy(teacher, student, config)
