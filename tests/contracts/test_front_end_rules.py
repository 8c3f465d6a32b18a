"""One rule set on every front end: max_sequence_length, padding masks, max_length, empty prompts, ids.

One tiny LM with a position limit (``max_sequence_length=15``), exported to a
SavedModel and to ONNX once per run (`tests._shared_exports.limited_export`,
which tests/export/test_verify.py reads too), and each rule is tried on every
front end that takes the input:

- Python front ends (Keras ``call`` / ``step`` / ``call_with_state`` /
  ``generate``, `OnnxGenerator.generate`) raise ``ValueError`` naming the
  argument.
- TensorFlow graphs (``tf.function``, ``fit``/``predict``, the SavedModel
  signatures run as TF Serving runs them) raise ``InvalidArgumentError``
  from a run-time assertion naming the argument.
- Graphs that cannot raise (the raw ONNX graphs; XLA drops assertions too)
  return what docs/export.md defines: NaN logits for a token past
  ``max_sequence_length`` or with a negative id, and ``output_ids`` full of
  -1 for a generate request that the other front ends refuse.

Each row: (rule, front end, call, expected) where expected is
``("raises", exception type, message fragment)`` or a check of the output.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import export
from tests import _shared_exports
from tests.tolerance import assert_close

pytestmark = pytest.mark.tf_only("SavedModel and ONNX exports")

V, LIMIT = _shared_exports.LIMITED_VOCAB, _shared_exports.LIMIT
N = 16  # the longest reduction of the tiny LM (its feed-forward width): the error model's n
IAE = tf.errors.InvalidArgumentError


class Env:
    def __init__(self):
        # Weights at scale 0.5 (logits well apart: exact token comparisons across runtimes). The SavedModel
        # has the default warmup (length 16 > LIMIT): the requests must stay within the model's limit.
        self.lm, self.version_dir, self.paths = _shared_exports.limited_export()
        self.runner = export.SavedModelRunner(self.version_dir)
        self.generator = export.OnnxGenerator(self.paths["step"], device="cpu")
        self.raw = {kind: export.OnnxPredictor(path, device="cpu") for kind, path in self.paths.items()}

    # ---- SavedModel
    def sm_generate(self, prompt, mask, max_length):
        feeds = {
            "prompt_ids": np.asarray(prompt, "int32"),
            "padding_mask": np.asarray(mask, "int32"),
            "max_length": np.int32(max_length),
        }
        return self.runner.run("generate", feeds)["output_ids"]

    def sm_generate_sampled(self, prompt, mask, max_length):
        feeds = {
            "prompt_ids": np.asarray(prompt, "int32"),
            "padding_mask": np.asarray(mask, "int32"),
            "max_length": np.int32(max_length),
            "temperature": np.float32(0.7),
            "top_k": np.int32(0),
            "top_p": np.float32(1.0),
            "seed": np.int64(3),
        }
        return self.runner.run("generate_sampled", feeds)["output_ids"]

    def sm_step(self, token, state):
        feeds = {"token_t": np.asarray(token, "int32")}
        feeds.update({f"state_{i}": np.asarray(s) for i, s in enumerate(state)})
        return self.runner.run("step", feeds)["logits"]

    # ---- raw ONNX graphs
    def onnx_generate(self, prompt, mask, max_length):
        feeds = {
            "prompt_ids": np.asarray(prompt, "int32"),
            "padding_mask": np.asarray(mask, "int32"),
            "max_length": np.array(max_length, np.int32),
            "temperature": np.array(0, np.float32),
            "top_k": np.array(0, np.int32),
            "top_p": np.array(1, np.float32),
            "seed": np.array(0, np.int64),
        }
        return self.raw["generate"].predict(feeds)["output_ids"]

    def onnx_step(self, token, state):
        feeds = {"token_t": np.asarray(token, "int32")}
        feeds.update({f"state_{i}": np.asarray(s) for i, s in enumerate(state)})
        return self.raw["step"].predict(feeds)["logits"]

    # ---- Keras states
    def state_at(self, position, batch=1):
        state = [np.asarray(s) for s in self.lm.get_initial_state(batch)]
        state[-1] = np.full((batch,), position, "int32")
        return state


@pytest.fixture(scope="module")
def env():
    return Env()


def ids(batch, length, value=1):
    return np.full((batch, length), value, "int32")


def ones(batch, length):
    return np.ones((batch, length), "int32")


RIGHT_PADDED = np.array([[1, 1, 0]], "int32")
ALL_ZERO = np.zeros((1, 3), "int32")


def _graph_call(lm, x):
    """The LM's call traced with a dynamic length, as in fit/predict (no XLA)."""
    fn = tf.function(lambda t: lm(t), input_signature=[tf.TensorSpec((None, None), tf.int32)])
    return fn(x)


# (rule, front end, call, expected)
RAISES = [
    # --- max_sequence_length: a row holds at most LIMIT tokens (state position + index in the piece)
    ("length > limit", "Keras call", lambda e: e.lm(ids(1, LIMIT + 1)), ValueError, f"max_sequence_length={LIMIT}"),
    (
        "length > limit",
        "Keras call traced (fit/predict)",
        lambda e: _graph_call(e.lm, ids(1, LIMIT + 1)),
        IAE,
        f"`token_ids` runs past max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "Keras step",
        lambda e: e.lm.step(ids(1, 1)[:, 0], e.state_at(LIMIT)),
        ValueError,
        f"`token_t` runs past max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "Keras call_with_state",
        lambda e: e.lm.call_with_state(ids(1, 3), e.state_at(LIMIT - 2)),
        ValueError,
        f"`token_ids` runs past max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "Keras generate",
        lambda e: e.lm.generate(ids(1, 2), LIMIT + 1),
        ValueError,
        f"max_length={LIMIT + 1}",
    ),
    (
        "length > limit",
        "SavedModel serving_default",
        lambda e: e.runner.run("serving_default", {"token_ids": ids(1, LIMIT + 1)}),
        IAE,
        f"`token_ids` runs past max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "SavedModel step",
        lambda e: e.sm_step([1], e.state_at(LIMIT)),
        IAE,
        f"`token_t` runs past max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 2), ones(1, 2), LIMIT + 1),
        IAE,
        f"`max_length` must be <= max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "SavedModel generate_sampled",
        lambda e: e.sm_generate_sampled(ids(1, 2), ones(1, 2), LIMIT + 1),
        IAE,
        f"`max_length` must be <= max_sequence_length={LIMIT}",
    ),
    (
        "length > limit",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 2), LIMIT + 1),
        ValueError,
        f"max_length={LIMIT + 1}",
    ),
    # --- padding_mask: left padding, at least one real token per row
    (
        "right-padded mask",
        "Keras generate",
        lambda e: e.lm.generate(ids(1, 3), 5, padding_mask=RIGHT_PADDED),
        ValueError,
        "padding_mask=[[1, 1, 0]]",
    ),
    (
        "right-padded mask",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 3), RIGHT_PADDED, 5),
        IAE,
        "`padding_mask` rows must be left-padded",
    ),
    (
        "right-padded mask",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 3), 5, padding_mask=RIGHT_PADDED),
        ValueError,
        "padding_mask=[[1, 1, 0]]",
    ),
    (
        "all-zero mask",
        "Keras generate",
        lambda e: e.lm.generate(ids(1, 3), 5, padding_mask=ALL_ZERO),
        ValueError,
        "padding_mask=[[0, 0, 0]]",
    ),
    (
        "all-zero mask",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 3), ALL_ZERO, 5),
        IAE,
        "at least one real token",
    ),
    (
        "all-zero mask",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 3), 5, padding_mask=ALL_ZERO),
        ValueError,
        "padding_mask=[[0, 0, 0]]",
    ),
    (
        "mask shape",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 3), ones(1, 4), 5),
        IAE,
        "`padding_mask` must have the shape of `prompt_ids`",
    ),
    # --- max_length >= prompt length
    ("max_length < P", "Keras generate", lambda e: e.lm.generate(ids(1, 3), 2), ValueError, "max_length=2"),
    (
        "max_length < P",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 3), ones(1, 3), 2),
        IAE,
        "`max_length` must be >= the prompt length",
    ),
    ("max_length < P", "OnnxGenerator", lambda e: e.generator.generate(ids(1, 3), 2), ValueError, "max_length=2"),
    # --- empty prompts
    ("empty prompt", "Keras generate", lambda e: e.lm.generate(ids(1, 0), 4), ValueError, "prompt_ids.shape=(1, 0)"),
    (
        "empty prompt",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 0), ones(1, 0), 4),
        IAE,
        "`prompt_ids` must be a non-empty",
    ),
    (
        "empty prompt",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 0), 4),
        ValueError,
        "prompt_ids.shape=(1, 0)",
    ),
    # --- ids in [0, V)
    ("id >= V", "Keras call", lambda e: e.lm(ids(1, 3, V)), ValueError, f"`token_ids` must be in [0, {V})"),
    (
        "id >= V",
        "Keras predict",
        lambda e: e.lm.predict(ids(2, 3, V), verbose=0),
        IAE,
        f"`token_ids` must be in [0, {V})",
    ),
    (
        "id < 0",
        "Keras call traced (fit/predict)",
        lambda e: _graph_call(e.lm, ids(1, 3, -1)),
        IAE,
        f"`token_ids` must be in [0, {V})",
    ),
    (
        "id >= V",
        "SavedModel serving_default",
        lambda e: e.runner.run("serving_default", {"token_ids": ids(1, 3, V)}),
        IAE,
        f"`token_ids` must be in [0, {V})",
    ),
    (
        "id >= V",
        "SavedModel generate",
        lambda e: e.sm_generate(ids(1, 3, V), ones(1, 3), 5),
        IAE,
        f"`prompt_ids` must be in [0, {V})",
    ),
    (
        "id >= V",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 3, V), 5),
        ValueError,
        "`prompt_ids` must be in",
    ),
    # --- seeds
    (
        "seed='a'",
        "Keras generate",
        lambda e: e.lm.generate(ids(1, 2), 4, sampler="random", seed="a"),
        ValueError,
        "seed='a'",
    ),
    (
        "seed='a'",
        "OnnxGenerator",
        lambda e: e.generator.generate(ids(1, 2), 4, sampler="random", seed="a"),
        ValueError,
        "seed='a'",
    ),
]


@pytest.mark.parametrize("thunk, exc, fragment", [r[2:] for r in RAISES], ids=[f"{r[0]}/{r[1]}" for r in RAISES])
def test_refused_everywhere_it_can_raise(env, thunk, exc, fragment):
    with pytest.raises(exc) as info:
        thunk(env)
    assert fragment in str(info.value), str(info.value)[:2000]


# ------------------------------------------------ graphs that cannot raise
def _expected_logits(env, token_ids):
    """Keras' logits for the first LIMIT tokens (the rows' valid part)."""
    return np.asarray(env.lm(token_ids[:, :LIMIT]))


def test_raw_onnx_model_gives_nan_logits_past_the_limit_and_keras_logits_before(env):
    x = np.random.default_rng(0).integers(0, V, (2, LIMIT + 3)).astype("int32")
    logits = env.raw["model"].predict({"token_ids": x})["logits"]
    assert logits.shape == (2, LIMIT + 3, V)
    assert np.isnan(logits[:, LIMIT:]).all()
    assert_close(logits[:, :LIMIT], _expected_logits(env, x), n=N, paths=2)


def test_raw_onnx_model_gives_nan_logits_for_a_negative_id(env):
    x = np.array([[3, -1, 4]], "int32")  # ONNX Gather would wrap -1 around to the last row
    logits = env.raw["model"].predict({"token_ids": x})["logits"]
    assert np.isnan(logits[0, 1]).all() and np.isfinite(logits[0, [0, 2]]).all()


def test_raw_onnx_step_gives_nan_logits_past_the_limit(env):
    token = np.array([1, 1], "int32")
    state = env.state_at(LIMIT - 1, batch=2)
    state[-1] = np.array([LIMIT - 1, LIMIT], "int32")  # row 0: the last position; row 1: past it
    logits = env.onnx_step(token, state)
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1]).all()
    keras_row0, _ = env.lm.step(token[:1], [s[:1] for s in state])
    assert_close(logits[0], np.asarray(keras_row0)[0], n=N, paths=2)


# A request the other front ends refuse: output_ids [B, max(max_length, 0)] of -1.
ERROR_OUTPUT = [
    ("length > limit", lambda e: e.onnx_generate(ids(2, 2), ones(2, 2), LIMIT + 1), (2, LIMIT + 1)),
    ("right-padded mask", lambda e: e.onnx_generate(ids(1, 3), RIGHT_PADDED, 5), (1, 5)),
    ("all-zero mask", lambda e: e.onnx_generate(ids(1, 3), ALL_ZERO, 5), (1, 5)),
    ("max_length < P", lambda e: e.onnx_generate(ids(2, 3), ones(2, 3), 2), (2, 2)),
    ("negative max_length", lambda e: e.onnx_generate(ids(2, 3), ones(2, 3), -4), (2, 0)),
    ("empty prompt", lambda e: e.onnx_generate(ids(2, 0), ones(2, 0), 4), (2, 4)),
    ("id >= V", lambda e: e.onnx_generate(ids(1, 3, V), ones(1, 3), 5), (1, 5)),
    ("id < 0", lambda e: e.onnx_generate(ids(1, 3, -2), ones(1, 3), 5), (1, 5)),
    ("mask shape", lambda e: e.onnx_generate(ids(1, 3), ones(1, 4), 5), (1, 5)),
]


@pytest.mark.parametrize("thunk, shape", [r[1:] for r in ERROR_OUTPUT], ids=[r[0] for r in ERROR_OUTPUT])
def test_raw_onnx_generate_answers_a_refused_request_with_minus_one(env, thunk, shape):
    out = thunk(env)
    assert out.shape == shape
    assert (out == -1).all()


def test_valid_requests_still_agree_across_front_ends(env):
    """The checks change nothing for a valid request: a left-padded batch up to the limit."""
    prompt = np.array([[0, 0, 5, 6], [1, 2, 3, 4]], "int32")
    mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], "int32")
    keras_ids = env.lm.generate(prompt, LIMIT, padding_mask=mask)
    np.testing.assert_array_equal(env.sm_generate(prompt, mask, LIMIT), keras_ids)
    np.testing.assert_array_equal(env.onnx_generate(prompt, mask, LIMIT), keras_ids)
    np.testing.assert_array_equal(env.generator.generate(prompt, LIMIT, padding_mask=mask), keras_ids)
    full = np.random.default_rng(1).integers(0, V, (2, LIMIT)).astype("int32")
    expected = np.asarray(env.lm(full))
    assert_close(env.runner.run("serving_default", {"token_ids": full})["logits"], expected, n=N, paths=2)
    assert_close(np.asarray(_graph_call(env.lm, full)), expected, n=N, paths=2)


def test_xla_drops_the_assertion_and_gives_the_graph_answer(env):
    """Under XLA (jit_compile) the assertion is gone: NaN logits past the limit, as in ONNX."""
    fn = tf.function(lambda t: env.lm(t), jit_compile=True, input_signature=[tf.TensorSpec((None, None), tf.int32)])
    x = np.random.default_rng(2).integers(0, V, (1, LIMIT + 2)).astype("int32")
    logits = np.asarray(fn(x))
    assert np.isnan(logits[:, LIMIT:]).all()
    assert_close(logits[:, :LIMIT], _expected_logits(env, x), n=N, paths=2)


def test_warmup_requests_stay_within_the_limit_and_replay(env):
    """TF Serving replays the warmup requests at load: one the signatures refuse would fail the load."""
    path = os.path.join(env.version_dir, "assets.extra", "tf_serving_warmup_requests")
    requests = export.read_warmup_requests(path)
    assert [name for name, _ in requests] == ["serving_default", "step", "generate", "generate_sampled"]
    for name, inputs in requests:
        env.runner.run(name, inputs)  # raises InvalidArgumentError past the limit
    assert requests[0][1]["token_ids"].shape[1] == LIMIT
