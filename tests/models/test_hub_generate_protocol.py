"""keras-hub's generate protocol on `LinearCausalLM`: `generate_step`, `make_generate_function`, the cache entry.

keras-hub's own `CausalLM.generate` (called unbound on the model) must give
the tokens of `LinearCausalLM.generate`, greedy and sampled, with and
without a preprocessor; `call_with_cache` must chain like one pass.
"""

import inspect

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn import samplers
from keras_linattn.models import LinearBackbone, LinearCausalLM, LinearCausalLMPreprocessor
from tests.models.test_keras_hub_shape import char_tokenizer
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

PROMPTS = ["def f(x):", "import"]
hub_generate = keras_hub.models.CausalLM.generate


@pytest.fixture(scope="module")
def lm():
    keras.utils.set_random_seed(0)
    backbone = LinearBackbone(vocabulary_size=258, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32)
    model = LinearCausalLM(backbone, preprocessor=LinearCausalLMPreprocessor(char_tokenizer(), sequence_length=24))
    # Both paths run the same compiled functions; without XLA they compile faster (test_generate_compile
    # shows the tokens do not depend on the choice).
    model.generate_jit_compile = False
    return model


@pytest.fixture
def bare(lm):
    """The module's model without its preprocessor (token ids in and out), restored afterwards."""
    preprocessor = lm.preprocessor
    lm.preprocessor = None
    yield lm
    lm.preprocessor = preprocessor


def _frame(prompt, mask, length):
    """keras-hub's generate input without a preprocessor: the prompts, then `length - P` columns to fill."""
    room = length - prompt.shape[1]
    return {
        "token_ids": np.pad(prompt, ((0, 0), (0, room))),
        "padding_mask": np.pad(mask, ((0, 0), (0, room))),
    }


def _left_padded_prompts():
    prompt = np.random.default_rng(1).integers(1, 258, (3, 5)).astype("int32")
    mask = np.ones_like(prompt, bool)
    mask[0, :2] = False
    prompt[0, :2] = 0
    return prompt, mask


def test_make_generate_function_has_keras_hubs_signature_and_returns_generate_step(lm):
    hub = keras_hub.models.CausalLM
    assert inspect.signature(LinearCausalLM.make_generate_function) == inspect.signature(hub.make_generate_function)
    assert inspect.signature(LinearCausalLM.generate_step) == inspect.signature(
        keras_hub.models.GPT2CausalLM.generate_step
    )
    lm.compile(sampler="greedy")
    assert lm.make_generate_function() == lm.generate_step


@pytest.mark.parametrize("stop", [None, "auto"])
def test_keras_hub_generate_gives_generates_strings_greedy(lm, stop):
    lm.compile(sampler="greedy")
    want = lm.generate(PROMPTS, max_length=20, stop_token_ids=stop)
    assert hub_generate(lm, PROMPTS, max_length=20, stop_token_ids=stop) == want
    stripped = hub_generate(lm, PROMPTS, max_length=20, stop_token_ids=stop, strip_prompt=True)
    assert stripped == lm.generate(PROMPTS, max_length=20, stop_token_ids=stop, strip_prompt=True)
    assert [p + s for p, s in zip(PROMPTS, stripped, strict=True)] == want
    if stop == "auto":  # one string in, one string out (new shapes to compile: once is enough)
        assert hub_generate(lm, "import", max_length=12, stop_token_ids=stop) == lm.generate(
            "import", max_length=12, stop_token_ids=stop
        )


def test_keras_hub_generate_gives_generates_strings_sampled_with_either_sampler_kind(lm):
    # keras_linattn's samplers draw the seed from NumPy's generator on both paths.
    lm.compile(sampler=samplers.TopKSampler(k=5))
    keras.utils.set_random_seed(7)
    want = lm.generate(PROMPTS, max_length=20, stop_token_ids=None)
    keras.utils.set_random_seed(7)
    assert hub_generate(lm, PROMPTS, max_length=20, stop_token_ids=None) == want
    # keras-hub's samplers draw from their own seed generator: a fresh one per call.
    outputs = []
    for generate in (LinearCausalLM.generate, hub_generate):
        lm.compile(sampler=keras_hub.samplers.TopKSampler(k=5, seed=3))
        outputs.append(generate(lm, PROMPTS, max_length=20, stop_token_ids=None))
    assert outputs[0] == outputs[1]
    lm.compile(sampler="greedy")
    assert lm.generate(PROMPTS, max_length=20, stop_token_ids=None) != outputs[0]  # the sampler did sample


def test_keras_hub_generate_takes_a_dataset_of_strings_batch_by_batch(lm):
    lm.compile(sampler="greedy")
    prompts = ["ab", "import", "x", "def"]
    out = hub_generate(lm, tf.data.Dataset.from_tensor_slices(prompts).batch(2), max_length=12, stop_token_ids=None)
    want = lm.generate(prompts[:2], max_length=12, stop_token_ids=None)
    assert list(out) == want + lm.generate(prompts[2:], max_length=12, stop_token_ids=None)
    assert lm.preprocessor.generate_preprocess(tf.constant(prompts[:2]))["token_ids"].shape[0] == 2


def test_keras_hub_generate_without_a_preprocessor_gives_generates_token_ids(bare):
    prompt, mask = _left_padded_prompts()
    frame = _frame(prompt, mask, 14)
    for sampler in ("greedy", samplers.RandomSampler()):
        bare.compile(sampler=sampler)
        keras.utils.set_random_seed(5)
        want = bare.generate(prompt, max_length=14, padding_mask=mask, stop_token_ids=None)
        keras.utils.set_random_seed(5)
        out = hub_generate(bare, dict(frame), stop_token_ids=None)
        np.testing.assert_array_equal(out["token_ids"], want)
        np.testing.assert_array_equal(out["padding_mask"], np.pad(mask, ((0, 0), (0, 9)), constant_values=True))


def test_keras_hub_generate_stop_tokens_end_rows_as_generate_does(bare):
    """A row that emits a stop token: later columns get the pad id (0) and leave the mask, on both paths."""
    prompt, mask = _left_padded_prompts()
    frame = _frame(prompt, mask, 14)
    bare.compile(sampler="greedy")
    stop = int(bare.generate(prompt, max_length=6, padding_mask=mask, stop_token_ids=None)[1, 5])  # row 1's next
    want = bare.generate(prompt, max_length=14, padding_mask=mask, stop_token_ids=[stop])
    out = hub_generate(bare, dict(frame), stop_token_ids=[stop])
    np.testing.assert_array_equal(out["token_ids"], want)
    assert out["padding_mask"][1, 5] and not out["padding_mask"][1, 6:].any()
    assert (out["token_ids"][1, 6:] == 0).all()


def test_right_padded_frames_generate_each_row_after_its_own_prompt(bare):
    """keras-hub's layout: prompts from column 0; each row continues as it would alone."""
    bare.compile(sampler="greedy")
    ids = np.random.default_rng(2).integers(1, 258, (2, 12)).astype("int32")
    mask = np.zeros_like(ids, bool)
    mask[0, :3], mask[1, :6] = True, True
    out = bare.generate_step({"token_ids": ids, "padding_mask": mask})
    for row, length in enumerate((3, 6)):
        alone = bare.generate(ids[row : row + 1, :length], max_length=12, stop_token_ids=None)
        np.testing.assert_array_equal(out["token_ids"][row], alone[0])
    assert out["padding_mask"].all()


def test_generate_step_refuses_masks_that_are_not_one_run_per_row(bare):
    ids = np.ones((2, 6), "int32")
    gap = np.array([[1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], bool)
    with pytest.raises(ValueError, match=r"one run of ones.*padding_mask\[0\]"):
        bare.generate_step({"token_ids": ids, "padding_mask": gap})
    empty = np.array([[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    with pytest.raises(ValueError, match=r"padding_mask\[1\]"):
        bare.generate_step({"token_ids": ids, "padding_mask": empty})


def test_preprocessor_frame_holds_left_padded_prompts_then_room(lm):
    packed = lm.preprocessor.generate_preprocess(PROMPTS, sequence_length=16)
    short = lm.preprocessor.generate_preprocess(PROMPTS)
    width = short["token_ids"].shape[1]
    assert packed["token_ids"].shape == (2, 16)
    np.testing.assert_array_equal(packed["token_ids"][:, :width], short["token_ids"])
    np.testing.assert_array_equal(packed["padding_mask"][:, :width], short["padding_mask"])
    assert not packed["padding_mask"][:, width:].any()


@pytest.fixture(scope="module")
def student():
    """A linearized keras-hub Llama (RoPE, GQA) with a window shorter than the sequence: every state kind moves."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=60, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32
    )
    teacher = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    return keras_linattn.linearize(teacher, feature_map="hedgehog", window_size=3)


def test_call_with_cache_token_by_token_equals_one_pass(student):
    ids = np.random.default_rng(3).integers(0, 60, (2, 9)).astype("int32")
    cache = student.get_initial_state(2)
    whole, hidden, _ = student.call_with_cache(ids, cache, 0)
    assert tuple(hidden.shape) == (2, 9, 16)
    assert_close(np.asarray(whole), np.asarray(student(ids)), paths=2, n=32)
    for t in range(9):
        logits, hidden, cache = student.call_with_cache(ids[:, t : t + 1], cache, t)
        assert tuple(logits.shape) == (2, 1, 60) and tuple(hidden.shape) == (2, 1, 16)
        # Step against parallel: both float32, each with its own rounding (two layers, width 16).
        assert_close(np.asarray(logits[:, 0]), np.asarray(whole[:, t]), paths=8, n=32)
    # keras-hub's prefill, then the rest one token at a time, ends in the one pass's state.
    hidden, cache = student._build_cache(ids[:, :5])
    assert tuple(hidden.shape) == (2, 5, 16)
    for t in range(5, 9):
        logits, _, cache = student.call_with_cache(ids[:, t : t + 1], cache, t)
        assert_close(np.asarray(logits[:, 0]), np.asarray(whole[:, t]), paths=8, n=32)
    student.check_state(cache, batch_size=2)
