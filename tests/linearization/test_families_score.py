"""`LinearCausalLM.score` against the forward pass where keras-hub has no `score`; LoRA and transfer per family.

keras-hub 0.32's Phi-3, GPT-NeoX and Gemma 3 causal LMs have no `score`:
there the reference is the teacher's own forward pass (its logits, and the
per-token loss computed from them in float64). With a softmax window that
covers T the student's `score` equals it, in both modes, padded or not.

Then one smoke test per keras-hub family that no other test puts through
`enable_lora` / `merge_lora` and `attention_transfer` (GPT-2: test_lora.py,
test_transfer*.py; Gemma 2: test_gemma2.py; Gemma 3: test_families_hf.py):
tiny teachers (one layer, small width), a window shorter than the sequence
so that the linear part has something to learn.
"""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from keras_linattn.linearization import enable_lora, lora_variables, merge_lora
from tests.linearization import _hf_checkpoints as hf
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

T, VOCAB = 10, 97


def _phi3(tmp_path_factory=None, name=None, layers=2):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Phi3Backbone(
        vocabulary_size=VOCAB,
        num_layers=layers,
        hidden_dim=64,
        intermediate_dim=96,
        num_query_heads=4,
        num_key_value_heads=4,
        layer_norm_epsilon=1e-5,
        max_sequence_length=4096,
        pretraining_sequence_length=4096,
        rope_max_wavelength=10000,
    )
    return keras_hub.models.Phi3CausalLM(backbone, preprocessor=None)


def _gpt_neox(tmp_path_factory=None, name=None, layers=2):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPTNeoXBackbone(
        vocabulary_size=VOCAB,
        num_layers=layers,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=96,
        max_sequence_length=64,
    )
    return keras_hub.models.GPTNeoXCausalLM(backbone, preprocessor=None)


# Hugging Face-format checkpoints (tests/linearization/_hf_checkpoints.py): (published name, CausalLM, sizes, tensors).
HF = {
    "gemma3": (
        "gemma-3-1b-pt",
        "Gemma3CausalLM",
        # Six layers (five local, one global); a local window of 4 within T = 10.
        dict(num_hidden_layers=6, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=4),
        dict(qk_norm=True, sandwich_norms=True),
    ),
    "llama3": ("Llama-3.2-1B", "Llama3CausalLM", {}, {}),
    "mistral": ("Mistral-7B-v0.3", "MistralCausalLM", {}, {}),
    "qwen": ("Qwen2.5-0.5B", "QwenCausalLM", {}, dict(attention_bias=True)),
    "qwen3": ("Qwen3-0.6B", "Qwen3CausalLM", dict(head_dim=32), dict(qk_norm=True)),
    "smollm3": ("SmolLM3-3B", "SmolLM3CausalLM", {}, {}),
    "gemma": ("gemma-2b", "GemmaCausalLM", dict(num_key_value_heads=1, head_dim=32), {}),
}


def _hf_teacher(tmp_path_factory, name, layers=None):
    published, causal_lm, sizes, tensors = HF[name]
    sizes = dict(sizes) if layers is None else dict(sizes, num_hidden_layers=layers)
    config = hf.small(published, **sizes)
    keras.utils.set_random_seed(0)
    directory = tmp_path_factory.mktemp(name)
    hf.write_checkpoint(directory, config, hf.llama_layout_tensors(config, **tensors))
    return hf.load(causal_lm, str(directory))


# ------------------------------------------------------------------ score parity (no keras-hub `score`)
@pytest.fixture(scope="module", params=["phi3", "gpt_neox", "gemma3"])
def pair(request, tmp_path_factory):
    """``(teacher, student)``: the student's window (16) covers T, so it is exact."""
    build = {"phi3": _phi3, "gpt_neox": _gpt_neox, "gemma3": _hf_teacher}[request.param]
    teacher = build(tmp_path_factory, request.param)
    assert not hasattr(teacher, "score")  # keras-hub 0.32: the forward pass is the reference
    return teacher, keras_linattn.linearize(teacher, window_size=16)


def _inputs(padding):
    ids = np.random.default_rng(0).integers(1, VOCAB, (3, T)).astype("int32")
    mask = np.ones_like(ids, bool)
    if padding == "right":
        mask[0, 6:], mask[1, 8:] = False, False
    ids[~mask] = 0
    return ids, mask, np.roll(ids, -1, axis=1)


def _per_token_loss(logits, targets):
    """float64 ``logsumexp(l) - l[target]`` of ``logits [B, T, V]``."""
    peak = logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
    return log_z - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


# Two float32 blocks of attention + feed-forward at width 64 (the error model's reduction length, as in
# tests/linearization/test_families_hf.py).
PATHS, N = 8, 64


@pytest.mark.parametrize("padding", ["none", "right"])
def test_score_logits_and_loss_equal_the_teachers_forward_pass(pair, padding):
    teacher, student = pair
    ids, mask, targets = _inputs(padding)
    want = np.asarray(teacher({"token_ids": ids, "padding_mask": mask.astype("int32")}), "float64")  # [B, T, V]
    got = np.asarray(student.score(ids, padding_mask=mask))
    assert got.shape == want.shape and got.dtype == np.float32
    # Padded positions' scores mean nothing on either side.
    assert_close(got[mask], want[mask], paths=PATHS, n=N, what="logits")
    want_loss = _per_token_loss(want, targets)
    got_loss = np.asarray(student.score(ids, padding_mask=mask, scoring_mode="loss", target_ids=targets))
    assert got_loss.shape == ids.shape
    # loss = logsumexp(l) - l[target]: each term moves by at most the largest logit error, so the loss error is
    # bounded by 2x the logits' bound, scaled from max|logits| to max|loss|.
    conditioning = max(1.0, np.abs(want[mask]).max() / np.abs(want_loss[mask]).max())
    assert_close(got_loss[mask], want_loss[mask], paths=2 * PATHS, n=N, conditioning=conditioning, what="loss")


# ------------------------------------------------------------------ LoRA and attention transfer run, per family
@pytest.fixture
def eager_functions():
    """`tf.function`s run eagerly: `fit`'s train step runs the same code without tracing it (a smoke test's cost)."""
    import tensorflow as tf

    tf.config.run_functions_eagerly(True)
    yield
    tf.config.run_functions_eagerly(False)


@pytest.mark.usefixtures("eager_functions")
@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen", "qwen3", "smollm3", "gemma", "phi3", "gpt_neox"])
def test_lora_and_attention_transfer_run(family, tmp_path_factory):
    build = {"phi3": _phi3, "gpt_neox": _gpt_neox}.get(family, _hf_teacher)
    teacher = build(tmp_path_factory, family, layers=1)
    student = keras_linattn.linearize(teacher, window_size=4)  # shorter than T: the linear part has work
    ids = np.random.default_rng(1).integers(1, VOCAB, (2, T)).astype("int32")
    feature_map = student.backbone.decoder_blocks[0].attention.feature_map
    before = [np.asarray(w) for w in feature_map.trainable_weights]
    keras_linattn.attention_transfer(
        student, teacher, {"token_ids": ids, "padding_mask": np.ones_like(ids)}, steps=2, batch_size=2, verbose=0
    )
    moved = [np.abs(np.asarray(w) - b).max() for w, b in zip(feature_map.trainable_weights, before, strict=True)]
    assert max(moved) > 0, family
    logits = np.asarray(student(ids))
    enable_lora(student, rank=2)
    assert len(lora_variables(student)) == 8  # A and B on q, k, v and o of the one block
    merged = merge_lora(student)  # LoRA's B starts at zero: merging it gives the same model
    assert not lora_variables(merged)
    assert_close(np.asarray(merged(ids)), logits, paths=PATHS, n=N)
