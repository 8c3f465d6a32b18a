"""One decode contract: Keras `generate`, the SavedModel signatures and the ONNX
generate graph give the same tokens, greedy and seeded, from the same weights.

The LM is the limited LM of tests/_shared_exports.py (elu: its export is built
once per run and shared with other files; the other maps: their own export of
the same architecture), weights at scale 0.5 so that logits are well apart.
"""

import ast
import os

import keras
import numpy as np
import pytest

from keras_linattn import export, generation, samplers
from keras_linattn.models import LinearCausalLM
from tests import _shared_exports
from tests._helpers import step_test_feature_map

VOCAB = 48  # of the LM that tests/contracts/test_jax_backend.py generates with on JAX
EXPORTED_VOCAB, LIMIT = _shared_exports.LIMITED_VOCAB, _shared_exports.LIMIT
FEATURE_MAPS = ["elu", "favor+", "oglu"]
SAMPLERS = [
    ("greedy", samplers.get("greedy")),
    ("top_k", samplers.get("top_k", k=5, temperature=0.9)),
    ("top_p", samplers.get("top_p", p=0.8, temperature=1.1)),
    ("random", samplers.get("random", temperature=0.7)),
]


def _lm(feature_map):
    lm = LinearCausalLM(
        vocabulary_size=VOCAB,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        feature_map=step_test_feature_map(feature_map),
    )
    # Logits spread well apart (the default init gives near-ties, which any
    # rounding difference can flip): deterministic weights of scale 0.5.
    rng = np.random.default_rng(7)
    for w in lm.trainable_weights:
        w.assign((rng.standard_normal(w.shape) * 0.5).astype(w.dtype))
    return lm


# elu in `make test` (the shared export); the random (favor+) and trainable (oglu) maps in
# `make test-slow` (the decode contract does not depend on the map: one export per map costs ~20 s).
@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=() if name == "elu" else pytest.mark.slow) for name in FEATURE_MAPS],
)
def exported(request, tmp_path_factory):
    if request.param == "elu":
        lm, version_dir, paths = _shared_exports.limited_export()
    else:
        lm = _shared_exports.built_limited_lm(step_test_feature_map(request.param))
        out = tmp_path_factory.mktemp(f"gen_{request.param.replace('+', 'p')}")
        version_dir = export.export_saved_model(lm, str(out / "sm"))
        paths = export.export_onnx(lm, str(out / "lm.onnx"))
    return lm, export.SavedModelRunner(version_dir), export.OnnxGenerator(paths["step"], device="cpu"), paths


def _prompts(vocab=EXPORTED_VOCAB):
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, vocab, size=(3, 5)).astype("int32")
    mask = np.ones_like(prompt)
    mask[1, :2] = 0  # a left-padded row
    prompt[1, :2] = 0
    return prompt, mask


def _saved_model_tokens(runner, prompt, mask, max_length, sampler, seed):
    feeds = {"prompt_ids": prompt, "padding_mask": mask, "max_length": np.int32(max_length)}
    if isinstance(sampler, samplers.GreedySampler):
        return runner.run("generate", feeds)["output_ids"]
    temperature, top_k, top_p = sampler.sampling_params()
    feeds.update(
        temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p), seed=np.int64(seed)
    )
    return runner.run("generate_sampled", feeds)["output_ids"]


@pytest.mark.parametrize("name,sampler", SAMPLERS, ids=[name for name, _ in SAMPLERS])
def test_keras_saved_model_and_onnx_give_identical_tokens(exported, name, sampler):
    lm, runner, generator, _ = exported
    prompt, mask = _prompts()
    for seed in (0, 11):
        keras_ids = lm.generate(prompt, max_length=LIMIT, sampler=sampler, seed=seed, padding_mask=mask)
        sm_ids = _saved_model_tokens(runner, prompt, mask, LIMIT, sampler, seed)
        onnx_ids = generator.generate(prompt, max_length=LIMIT, sampler=sampler, seed=seed, padding_mask=mask)
        np.testing.assert_array_equal(keras_ids[:, :5], prompt)
        np.testing.assert_array_equal(sm_ids, keras_ids, err_msg=f"SavedModel, seed {seed}")
        np.testing.assert_array_equal(onnx_ids, keras_ids, err_msg=f"ONNX, seed {seed}")
        if name == "greedy":
            break


def test_seeded_sampling_differs_between_seeds_and_repeats_for_one(exported):
    lm, _, generator, _ = exported
    prompt, mask = _prompts()
    sampler = samplers.get("random", temperature=1.5)
    a = generator.generate(prompt, LIMIT, sampler=sampler, seed=1, padding_mask=mask)
    b = generator.generate(prompt, LIMIT, sampler=sampler, seed=1, padding_mask=mask)
    c = generator.generate(prompt, LIMIT, sampler=sampler, seed=2, padding_mask=mask)
    np.testing.assert_array_equal(a, b)
    assert (a[:, 5:] != c[:, 5:]).any()


def test_max_length_and_prompt_rules_agree(exported):
    lm, runner, generator, _ = exported
    prompt, mask = _prompts()
    # max_length == P: the prompt itself, everywhere.
    np.testing.assert_array_equal(lm.generate(prompt, max_length=5, padding_mask=mask), prompt)
    np.testing.assert_array_equal(generator.generate(prompt, max_length=5, padding_mask=mask), prompt)
    np.testing.assert_array_equal(_saved_model_tokens(runner, prompt, mask, 5, samplers.get("greedy"), 0), prompt)
    # max_length < P: refused everywhere (ValueError in Python, an assertion in the SavedModel).
    with pytest.raises(ValueError, match="max_length"):
        lm.generate(prompt, max_length=4)
    with pytest.raises(ValueError, match="max_length"):
        generator.generate(prompt, max_length=4)
    with pytest.raises(Exception, match="`max_length` must be >= the prompt length"):
        _saved_model_tokens(runner, prompt, mask, 4, samplers.get("greedy"), 0)
    # Right padding is refused by both Python front ends.
    bad = np.ones_like(mask)
    bad[0, -1] = 0
    for fn in (lm.generate, generator.generate):
        with pytest.raises(ValueError, match="left-padded"):
            fn(prompt, max_length=8, padding_mask=bad)


def test_onnx_generator_refuses_custom_samplers_and_mixed_arguments(exported):
    _, _, generator, _ = exported
    prompt, _ = _prompts()

    class Custom(samplers.Sampler):
        def get_next_token(self, logits, seed):
            return keras.ops.argmax(logits, axis=-1)

    with pytest.raises(ValueError, match="custom sampler"):
        generator.generate(prompt, 8, sampler=Custom())
    with pytest.raises(ValueError, match="not both"):
        generator.generate(prompt, 8, sampler="greedy", temperature=0.5)


def test_state_spec_describes_the_state(exported):
    lm = exported[0]
    spec = lm.state_spec()
    state = lm.get_initial_state(3)
    assert [s.name for s in spec][-1] == "position"
    # per layer: S and z, then conv_q, conv_k, conv_v where the attention has a short convolution
    per_layer = [2 + (3 if block.attention.conv_size else 0) for block in lm.backbone.decoder_blocks]
    assert len(per_layer) == lm.num_layers
    assert len(spec) == len(state) == sum(per_layer) + 1
    for s, x in zip(spec, state, strict=True):
        assert tuple(x.shape) == (3,) + tuple(s.shape) and keras.backend.standardize_dtype(x.dtype) == s.dtype
    with pytest.raises(ValueError, match=r"state\[1\]"):
        generation.check_state(spec, [state[0], state[0]] + state[2:], batch_size=3)


def _is_while_loop_call(node):
    """True for a call ``while_loop(...)`` or ``<anything>.while_loop(...)``."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "while_loop") or (
        isinstance(func, ast.Attribute) and func.attr == "while_loop"
    )


def test_one_decode_loop_in_the_package():
    """A while loop over decoding steps exists only in keras_linattn/generation.py.

    The scan parses each module (`ast`) and finds the calls to a
    ``while_loop`` (``tf.while_loop``, ``keras.ops.while_loop``); docstrings
    that name one do not count. Excluded by name: ops/delta.py, whose loop
    runs over the chunks of a training sequence (the delta rule's state must
    pass from chunk to chunk), and ops/_sparse_selection.py (split out of
    ops/sparse_cache.py), whose loop runs over the tokens of a training
    sequence in the sparse cache's parallel form (each cache decision
    depends on the state before it); neither loops over decoding steps. Each
    excluded module must still make such a call: an exclusion does not
    outlive its loop.
    """
    root = os.path.join(os.path.dirname(__file__), "..", "..", "keras_linattn")
    training_loops = (os.path.join("ops", "delta.py"), os.path.join("ops", "_sparse_selection.py"))
    hits, excluded = [], []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as handle:
                    tree = ast.parse(handle.read(), filename=path)
                rel = os.path.relpath(path, root)
                if any(_is_while_loop_call(node) for node in ast.walk(tree)):
                    (excluded if rel in training_loops else hits).append(rel)
    assert hits == ["generation.py"], hits
    assert sorted(excluded) == sorted(training_loops), excluded


# JAX's `generate` against TensorFlow's tokens for `_lm("elu")`:
# tests/contracts/test_jax_backend.py::test_jax_backend_generates_tensorflows_tokens (its JAX
# subprocess runs both checks: one JAX start instead of two).


# -------------------------------------------------------- non-finite logits
@pytest.fixture(scope="module")
def nan_exported(tmp_path_factory):
    """An LM with NaN input embeddings for one or two tokens (tests/models/test_causal_lm.py), exported.

    Returns ``(lm, SavedModelRunner, onnx paths, expected)``: ``expected[sampler name]`` is the clean
    model's output with -1 from each row's first position without a token (some rows meet a NaN
    token mid-generation, some never).
    """
    from tests.models.test_causal_lm import (
        NAN_LENGTH,
        NAN_PROMPT,
        NAN_SAMPLERS,
        _first_without_token,
        _pick_nan_tokens,
        _set_nan_embeddings,
        _spread_lm,
    )

    lm = _spread_lm()
    cleans = {
        name: lm.generate(NAN_PROMPT, max_length=NAN_LENGTH, sampler=sampler, seed=seed)
        for name, (sampler, seed) in NAN_SAMPLERS.items()
    }
    tokens = _pick_nan_tokens(*cleans.values())
    _set_nan_embeddings(lm, tokens)
    expected = {}
    for name, clean in cleans.items():
        expected[name] = clean.copy()
        for row, position in enumerate(_first_without_token(clean, tokens)):
            if position is not None:
                expected[name][row, position:] = -1
        assert (expected[name] == -1).any() and (expected[name] != -1).all(axis=1).any(), expected[name]
    out = tmp_path_factory.mktemp("nan_lm")
    version_dir = export.export_saved_model(lm, str(out / "sm"), warmup=False)
    paths = export.export_onnx(lm, str(out / "lm.onnx"))
    return lm, export.SavedModelRunner(version_dir), paths, expected


def _nan_feeds(name):
    from tests.models.test_causal_lm import NAN_LENGTH, NAN_PROMPT, NAN_SAMPLERS

    sampler, seed = NAN_SAMPLERS[name]
    return NAN_PROMPT, NAN_LENGTH, sampler, seed


@pytest.mark.parametrize("name", ["greedy", "top_k"])
def test_saved_model_generate_returns_the_sentinel_for_nonfinite_logits(nan_exported, name):
    _, runner, _, expected = nan_exported
    prompt, length, sampler, seed = _nan_feeds(name)
    out = _saved_model_tokens(runner, prompt, np.ones_like(prompt), length, sampler, seed)
    np.testing.assert_array_equal(out, expected[name])


@pytest.mark.parametrize("name", ["greedy", "top_k"])
def test_onnx_generate_graph_returns_the_sentinel_and_onnx_generator_raises(nan_exported, name):
    from keras_linattn.export.onnx_predictor import OnnxPredictor

    _, _, paths, expected = nan_exported
    prompt, length, sampler, seed = _nan_feeds(name)
    temperature, top_k, top_p = (0.0, 0, 1.0) if name == "greedy" else sampler.sampling_params()
    feeds = {
        "prompt_ids": prompt,
        "padding_mask": np.ones_like(prompt),
        "max_length": np.array(length, np.int32),
        "temperature": np.array(temperature, np.float32),
        "top_k": np.array(top_k, np.int32),
        "top_p": np.array(top_p, np.float32),
        "seed": np.array(seed, np.int64),
    }
    raw = OnnxPredictor(paths["generate"], device="cpu").predict(feeds)["output_ids"]
    np.testing.assert_array_equal(raw, expected[name])
    rows = [r for r in range(len(prompt)) if (expected[name][r] == -1).any()]
    positions = [int(np.argmax(expected[name][r] == -1)) for r in rows]
    generator = export.OnnxGenerator(paths["step"], device="cpu")
    with pytest.raises(generation.NonFiniteLogitsError) as info:
        generator.generate(prompt, max_length=length, sampler=sampler, seed=seed)
    assert f"OnnxGenerator.generate: non-finite logits at row {rows[0]}, position {positions[0]}" in str(info.value)
    assert info.value.rows == rows and info.value.positions == positions


def test_keras_generate_raises_where_the_exports_return_the_sentinel(nan_exported):
    lm, _, _, expected = nan_exported
    prompt, length, sampler, seed = _nan_feeds("top_k")
    rows = [r for r in range(len(prompt)) if (expected["top_k"][r] == -1).any()]
    with pytest.raises(generation.NonFiniteLogitsError) as info:
        lm.generate(prompt, max_length=length, sampler=sampler, seed=seed)
    assert info.value.rows == rows
    assert info.value.positions == [int(np.argmax(expected["top_k"][r] == -1)) for r in rows]
