"""keras-hub families loaded from local Hugging Face-format checkpoints (keras-hub's converter), linearized.

Each checkpoint directory has a published `config.json` (fewer layers, a
small width; every key kept) and random `safetensors` weights
(`tests/linearization/_hf_checkpoints.py`). With a softmax window that
covers the sequence the student computes the teacher's function: logits
within the error model's bound, greedy tokens equal.
"""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.models import LinearCausalLM
from tests.linearization import _hf_checkpoints as hf
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

T = 12  # prompt length of the logits check
NEW = 4  # greedy tokens generated after a prompt of PROMPT tokens
PROMPT = 5


def _ids(vocab, length=T, batch=2, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, (batch, length)).astype("int32")


def _teacher_logits(teacher, ids):
    return np.asarray(teacher({"token_ids": ids, "padding_mask": np.ones_like(ids)}), "float64")


def _teacher_greedy(teacher, prompt, max_length):
    """keras-hub's own greedy `generate` from unpadded prompts ``[B, P]``: ``[B, max_length]`` ids."""
    batch, length = prompt.shape
    token_ids = np.zeros((batch, max_length), "int32")
    token_ids[:, :length] = prompt
    mask = np.zeros((batch, max_length), "int32")
    mask[:, :length] = 1
    teacher.compile(sampler="greedy", jit_compile=False)  # XLA would only add compile time here
    out = teacher.generate({"token_ids": token_ids, "padding_mask": mask}, stop_token_ids=None)
    return np.asarray(out["token_ids"])


def _forward_greedy(model, prompt, max_length):
    """Greedy tokens from a model's forward pass (Gemma 3's keras-hub `generate` needs a preprocessor)."""
    tokens = prompt
    while tokens.shape[1] < max_length:
        logits = np.asarray(model({"token_ids": tokens, "padding_mask": np.ones_like(tokens)}))
        tokens = np.concatenate([tokens, np.argmax(logits[:, -1], axis=-1)[:, None].astype("int32")], axis=1)
    return tokens


def _student_greedy(student, prompt, max_length):
    """Greedy decoding through the student's decode path (`step`, eager: no compile): ``[B, max_length]`` ids."""
    state = student.get_initial_state(prompt.shape[0])
    tokens = [prompt[:, t] for t in range(prompt.shape[1])]
    for t in range(max_length - 1):
        logits, state = student.step(tokens[t], state)
        if t + 1 >= len(tokens):
            tokens.append(np.argmax(np.asarray(logits), axis=-1).astype("int32"))
    return np.stack(tokens, axis=1)


def _linearized(tmp_path_factory, name, causal_lm, config, **tensor_options):
    keras.utils.set_random_seed(0)
    directory = tmp_path_factory.mktemp(name.replace(".", "_"))
    hf.write_checkpoint(directory, config, hf.llama_layout_tensors(config, **tensor_options))
    teacher = hf.load(causal_lm, str(directory))
    student = keras_linattn.linearize(teacher, window_size=16)
    return teacher, student


def _check_exact_and_greedy(teacher, student, config, greedy=None):
    """The family's two claims: logits within the bound, greedy tokens equal to keras-hub's generate.

    `greedy`: the teacher's greedy decoding (default `_teacher_greedy`, keras-hub's `generate`).
    """
    assert type(student) is LinearCausalLM
    ids = _ids(config["vocab_size"])
    # Two float32 blocks at width hidden_size: the error model with the width as reduction length
    # (as tests/linearization/test_keras_hub_teachers.py).
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=config["hidden_size"])
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=1)
    want = (greedy or _teacher_greedy)(teacher, prompt, PROMPT + NEW)
    np.testing.assert_array_equal(_student_greedy(student, prompt, PROMPT + NEW), want)


# ------------------------------------------------------------------ Llama 3.2 (RoPE scaling)
@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    config = hf.small("Llama-3.2-1B")
    return (*_linearized(tmp_path_factory, "llama32", "Llama3CausalLM", config), config)


def test_llama_3_2_checkpoint_with_rope_scaling_linearizes_exactly(llama32):
    teacher, student, config = llama32
    scaling = config["rope_scaling"]
    assert teacher.backbone.get_config()["rope_frequency_adjustment_factor"] == scaling["factor"]
    attention = student.backbone.decoder_blocks[0].attention
    assert attention.rope_frequency_adjustment == (
        scaling["factor"],
        scaling["low_freq_factor"],
        scaling["high_freq_factor"],
        scaling["original_max_position_embeddings"],
    )
    _check_exact_and_greedy(teacher, student, config)


@pytest.mark.slow
def test_llama_3_2_student_generate_gives_the_teachers_greedy_tokens(llama32):
    teacher, student, config = llama32
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=2)
    got = student.generate(prompt, max_length=PROMPT + NEW, sampler="greedy", stop_token_ids=None)
    np.testing.assert_array_equal(np.asarray(got), _teacher_greedy(teacher, prompt, PROMPT + NEW))


# ------------------------------------------------------------------ Qwen 2.5 (q/k/v biases)
@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    config = hf.small("Qwen2.5-0.5B")
    return (*_linearized(tmp_path_factory, "qwen25", "QwenCausalLM", config, attention_bias=True), config)


def test_qwen_2_5_checkpoint_with_qkv_biases_linearizes_exactly(qwen25):
    teacher, student, config = qwen25
    attention = student.backbone.decoder_blocks[0].attention
    np.testing.assert_array_equal(np.asarray(attention.output_dense.bias), 0.0)  # Qwen has no output bias
    teacher_bias = teacher.backbone.get_layer("transformer_layer_0")._self_attention_layer._query_dense.bias
    np.testing.assert_array_equal(np.asarray(attention.query_dense.bias), np.asarray(teacher_bias))
    _check_exact_and_greedy(teacher, student, config)


# ------------------------------------------------------------------ Mistral (global, and a local sliding window)
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    config = hf.small("Mistral-7B-v0.3")
    return (*_linearized(tmp_path_factory, "mistral", "MistralCausalLM", config), config)


def test_mistral_v0_3_checkpoint_linearizes_exactly(mistral):
    teacher, student, config = mistral
    assert not student.backbone.tie_embeddings  # Mistral's head is its own matrix
    _check_exact_and_greedy(teacher, student, config)


def test_mistral_sliding_window_within_the_students_stays_exact_softmax(tmp_path_factory):
    # Mistral-7B-v0.1 published sliding_window 4096; here a window of 4 tokens, shorter than the T = 12
    # of the check and than the student's 16, so the teacher's layers are local over the sequence.
    config = hf.small("Mistral-7B-v0.3", sliding_window=4)
    teacher, student = _linearized(tmp_path_factory, "mistral_local", "MistralCausalLM", config)
    recurrence = student.backbone.decoder_blocks[0].attention.recurrence
    assert (recurrence.window_size, recurrence.linear_weight) == (4, 0.0)
    _check_exact_and_greedy(teacher, student, config)


# ------------------------------------------------------------------ Qwen 3 (per-head q/k RMSNorm)
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # Qwen3-0.6B's head_dim (128) is not hidden_size / heads (64): keep that shape, smaller.
    config = hf.small("Qwen3-0.6B", head_dim=32)
    return (*_linearized(tmp_path_factory, "qwen3", "Qwen3CausalLM", config, qk_norm=True), config)


def test_qwen_3_checkpoint_with_qk_norms_linearizes_exactly(qwen3):
    teacher, student, config = qwen3
    attention = student.backbone.decoder_blocks[1].attention
    teacher_norm = teacher.backbone.get_layer("transformer_layer_1")._self_attention_layer._key_dense_layer_norm
    np.testing.assert_array_equal(np.asarray(attention.key_norm.scale), np.asarray(teacher_norm.scale))
    assert attention.key_dim == 32
    _check_exact_and_greedy(teacher, student, config)


@pytest.mark.slow
def test_qwen_3_student_generates_the_teachers_tokens_and_its_exports_verify(qwen3, tmp_path):
    from keras_linattn import export

    teacher, student, config = qwen3
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=2)
    got = student.generate(prompt, max_length=PROMPT + NEW, sampler="greedy", stop_token_ids=None)
    np.testing.assert_array_equal(np.asarray(got), _teacher_greedy(teacher, prompt, PROMPT + NEW))
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


# ------------------------------------------------------------------ SmolLM3 (no-RoPE layers)
@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    # Four layers: the published pattern turns RoPE off in every fourth layer (layer 3 here).
    config = hf.small("SmolLM3-3B", num_hidden_layers=4)
    return (*_linearized(tmp_path_factory, "smollm3", "SmolLM3CausalLM", config), config)


def test_smollm3_checkpoint_with_no_rope_layers_linearizes_exactly(smollm3):
    teacher, student, config = smollm3
    wavelengths = [block.attention.rope_max_wavelength for block in student.backbone.decoder_blocks]
    assert wavelengths == [5e6, 5e6, 5e6, None]
    _check_exact_and_greedy(teacher, student, config)


# ------------------------------------------------------------------ Gemma (embedding scale, (1 + scale), GeGLU, MQA)
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    # gemma-2b: multi-query (one key/value head); a head dim larger than width / heads, as Gemma 7B's.
    config = hf.small("gemma-2b", num_key_value_heads=1, head_dim=32)
    return (*_linearized(tmp_path_factory, "gemma", "GemmaCausalLM", config), config)


def test_gemma_checkpoint_linearizes_exactly(gemma):
    teacher, student, config = gemma
    assert student.backbone.embedding_scale == pytest.approx(np.sqrt(config["hidden_size"]))
    assert student.backbone.decoder_blocks[0].attention.num_key_value_heads == 1
    _check_exact_and_greedy(teacher, student, config)


# ------------------------------------------------------------------ Phi-3 (no HF converter in keras-hub 0.32)
# Phi-3-mini-4k-instruct's published config.json, as Phi3Backbone arguments (keras-hub 0.32 has no Hugging Face
# converter for Phi-3): hidden_size 3072, intermediate_size 8192, 32 heads (32 key/value heads), rms_norm_eps 1e-5,
# rope_theta 10000, max_position_embeddings 4096, rope_scaling null, vocab_size 32064; two layers, small width here.
@pytest.fixture(scope="module")
def phi3():
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Phi3Backbone(
        vocabulary_size=97,
        num_layers=2,
        hidden_dim=64,
        intermediate_dim=96,
        num_query_heads=4,
        num_key_value_heads=4,
        layer_norm_epsilon=1e-5,
        max_sequence_length=4096,
        pretraining_sequence_length=4096,
        rope_max_wavelength=10000,
    )
    teacher = keras_hub.models.Phi3CausalLM(backbone, preprocessor=None)
    return teacher, keras_linattn.linearize(teacher, window_size=16), {"vocab_size": 97, "hidden_size": 64}


def test_phi3_linearizes_exactly(phi3):
    teacher, student, config = phi3
    assert not student.backbone.tie_embeddings
    _check_exact_and_greedy(teacher, student, config)


# ------------------------------------------------------------------ Gemma 3 (local/global, q/k norm, post norms)
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # Six layers: keras-hub makes layers 0-4 local and layer 5 global. A local window of 4 tokens (the published
    # 512, shortened so that T = 12 reaches past it) within the student's 16 stays exact softmax.
    config = hf.small(
        "gemma-3-1b-pt",
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=4,
    )
    return (
        *_linearized(tmp_path_factory, "gemma3", "Gemma3CausalLM", config, qk_norm=True, sandwich_norms=True),
        config,
    )


def test_gemma_3_checkpoint_linearizes_exactly_with_exact_local_layers(gemma3):
    teacher, student, config = gemma3
    blocks = student.backbone.decoder_blocks
    assert [b.attention.rope_max_wavelength for b in blocks] == [1e4] * 5 + [1e6]
    assert [b.attention.recurrence.window_size for b in blocks] == [4] * 5 + [16]
    assert [b.attention.recurrence.linear_weight for b in blocks] == [0.0] * 5 + [None]
    ids = _ids(config["vocab_size"])
    assert_close(np.asarray(student(ids)), _teacher_logits(teacher, ids), paths=8, n=config["hidden_size"])
    prompt = _ids(config["vocab_size"], length=PROMPT, seed=1)
    np.testing.assert_array_equal(
        _student_greedy(student, prompt, PROMPT + NEW), _forward_greedy(teacher, prompt, PROMPT + NEW)
    )


# ------------------------------------------------------------------ GPT-NeoX (no HF converter in keras-hub 0.32)
# Pythia-style defaults of GPTNeoXBackbone (rotary_percentage 0.25, base 10000, LayerNorm eps 1e-5), built from its
# constructor (keras-hub 0.32 has no Hugging Face converter for GPT-NeoX); two layers, head dim 16 (4 rotated).
@pytest.fixture(scope="module")
def gpt_neox():
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=97, num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=96, max_sequence_length=64
    )
    teacher = keras_hub.models.GPTNeoXCausalLM(backbone, preprocessor=None)
    return teacher, keras_linattn.linearize(teacher, window_size=16), {"vocab_size": 97, "hidden_size": 64}


def test_gpt_neox_parallel_residual_and_partial_rotary_linearize_exactly(gpt_neox):
    teacher, student, config = gpt_neox
    block = student.backbone.decoder_blocks[0]
    assert block.parallel_residual and block.attention.rope_rotary_dim == 4
    # keras-hub 0.32's GPT-NeoX `generate` disagrees with its own forward pass: its cached attention rotates the
    # new query as position 0 (`rotary_embedding_layer(query_rot)`, no start index). The forward pass is the
    # reference.
    _check_exact_and_greedy(teacher, student, config, greedy=_forward_greedy)


def test_attention_transfer_pairs_a_keras_hub_familys_own_attention_layers_and_lora_merges(gemma3):
    from keras_linattn.linearization import attention_pairs, enable_lora, merge_lora

    teacher, _, config = gemma3
    student = keras_linattn.linearize(teacher, window_size=8)  # the global layer's window is shorter than T
    pairs = attention_pairs(teacher, student)
    # Gemma 3's attention is its own layer class (not a MultiHeadAttention): the family names its attribute.
    assert [type(t).__name__ for t, _ in pairs] == ["CachedGemma3Attention"] * 6
    ids = _ids(config["vocab_size"], length=16, batch=4)
    global_map = student.backbone.decoder_blocks[5].attention.feature_map
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
def test_gemma_3_student_exports_verify_with_local_and_global_layers(gemma3, tmp_path):
    # Per-layer state (five window-alone layers, one global), post norms and the embedding scale in the graphs.
    from keras_linattn import export

    _, student, _ = gemma3
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
