"""The decoding checks of `verify`: the step and generate graphs against Keras' `step` and `generate()`.

Over `steps` random tokens: the ``step`` signature and the ONNX step graph
against Keras `step`, logits per step, within the error model's bound; the
``generate`` / ``generate_sampled`` signatures and the ONNX generate graph
against Keras `generate()`, token for token (a greedy token may differ only
at a float32 tie of Keras' logits).
"""

import gc
import math
import os

import numpy as np

from keras_linattn import generation, samplers
from keras_linattn.export import _specs
from keras_linattn.export._verify_bounds import (
    _Bound,
    _compare,
    _recording_features,
    _reduction_length,
    quantized_reduction,
)
from keras_linattn.export._verify_report import _Check
from keras_linattn.export.onnx_generator import OnnxGenerator

# The sampler of the `generate_sampled` / ONNX generate check.
_SAMPLED = {"temperature": 0.8, "k": 8, "p": 0.9}


def _keras_step_trace(specs, tokens):
    """Keras `step` over `tokens [B, T]` from the initial state: logits per step."""
    model = specs.model
    state = model.get_initial_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        out, state = model.step(tokens[:, t].astype("int32"), state)
        logits.append(np.asarray(out))
    return np.stack(logits, axis=1)  # [B, T, V]


def _token_check(backend, signature, keras_ids, got_ids, keras_logits, bound, allow_ties):
    """Tokens against Keras': exact, except (`allow_ties`) a first difference at a float32 tie."""
    keras_ids, got_ids = np.asarray(keras_ids), np.asarray(got_ids)
    if keras_ids.shape != got_ids.shape:
        return _Check(
            backend,
            signature,
            keras_ids.shape,
            float("inf"),
            float("inf"),
            0,
            exact=True,
            detail=f"shape {got_ids.shape}",
        )
    mismatches = int(np.sum(keras_ids != got_ids))
    ties = 0
    if mismatches and allow_ties:
        ties_only = True
        for b in range(keras_ids.shape[0]):
            differ = np.flatnonzero(keras_ids[b] != got_ids[b])
            if not differ.size:
                continue
            t = int(differ[0])
            limit = bound.row(b)
            logits = keras_logits[b, t - 1]  # the logits that chose token t
            gap = abs(float(logits[keras_ids[b, t]]) - float(logits[got_ids[b, t]]))
            if t == 0 or limit is None or gap > 2 * limit * float(np.abs(logits).max()):
                ties_only = False
                break
            ties += 1
        if ties_only:
            return _Check(
                backend,
                signature,
                keras_ids.shape,
                mismatches,
                mismatches,
                0,
                exact=True,
                ok=True,
                detail=f"{ties} rows part at a float32 tie",
            )
    return _Check(backend, signature, keras_ids.shape, mismatches, mismatches, 0, exact=True)


def _onnx_tokens(gen, keras_ids, prompt, max_length, **kwargs):
    """`OnnxGenerator.generate`'s tokens; where it found non-finite logits, the -1 the graph returned.

    The generator raises `NonFiniteLogitsError` for a row without a token
    (the graph's -1 from a position on); verify reports that as a failed
    token check instead of stopping.
    """
    try:
        return gen.generate(prompt, max_length=max_length, **kwargs)
    except generation.NonFiniteLogitsError as e:
        tokens = np.array(keras_ids, copy=True)
        for row, position in zip(e.rows, e.positions, strict=True):
            tokens[row, position:] = -1
        return tokens


class _KerasDecoding:
    """Keras' decoding of random tokens, the reference of every decoding check, and the bounds it is held to."""

    def __init__(self, run, batch, steps, limit):
        specs = run.specs
        model = specs.model
        self.batch, self.steps = batch, steps
        rng = np.random.default_rng(run.seed)
        self.tokens = rng.integers(0, specs.vocabulary_size or 2, size=(batch, steps)).astype(np.int32)
        self.step_logits = _keras_step_trace(specs, self.tokens)  # [B, T, V]
        with _recording_features(model) as records:
            model(self.tokens, training=False)
        self.step_conditioning = run.row_conditioning(records, batch)
        self.step_n = _reduction_length(model, steps)
        self.quantized = quantized_reduction(model)

        self.prompt = self.tokens[:, : min(2, steps)]
        prompt_length = self.prompt.shape[1]
        self.max_length = prompt_length + steps if limit is None else min(prompt_length + steps, limit)
        self.sampler = samplers.get("top_p", **_SAMPLED)
        self.greedy_ids = np.asarray(model.generate(self.prompt, max_length=self.max_length, sampler="greedy"))
        self.sampled_ids = np.asarray(
            model.generate(self.prompt, max_length=self.max_length, sampler=self.sampler, seed=run.seed)
        )
        with _recording_features(model) as records:
            self.greedy_logits = np.asarray(model(self.greedy_ids, training=False))  # what chose each greedy token
        self.generate_bound = _Bound(
            _reduction_length(model, self.max_length), run.row_conditioning(records, batch), quantized=self.quantized
        )

    def check_steps(self, run, backend, got, fixed):
        """The row of a backend's step logits ``[B, T, V]`` against Keras `step`'s."""
        batch, steps = self.batch, self.steps
        bound = _Bound(self.step_n, self.step_conditioning, fixed, self.quantized)
        row = run.report.add(_compare(backend, f"{_specs.STEP}:logits", (batch, steps), got, self.step_logits, bound))
        run.say(f"{backend:12s} step {batch}x{steps}: rel {row.max_rel:.2e} (bound {row.tolerance:.1e}) {row.status}")

    def check_tokens(self, run, backend, greedy, sampled, names):
        """The rows of a backend's greedy and sampled tokens (None: not checked) against Keras `generate()`'s."""
        for name, keras_ids, got, ties in (
            (names[0], self.greedy_ids, greedy, True),
            (names[1], self.sampled_ids, sampled, False),
        ):
            if got is None:
                continue
            row = run.report.add(
                _token_check(backend, name, keras_ids, got, self.greedy_logits, self.generate_bound, ties)
            )
            count = int(row.max_abs) if math.isfinite(row.max_abs) else "shape"
            run.say(f"{backend:12s} {name} {self.batch}x{self.max_length}: {count} differing tokens {row.status}")


def _saved_model_steps(specs, runner, tokens):
    """The ``step`` signature's logits ``[B, T, V]`` over `tokens`, from the initial state."""
    state = specs.initial_state(tokens.shape[0])
    got = []
    for t in range(tokens.shape[1]):
        feeds = {_specs.TOKEN_T: tokens[:, t]}
        feeds.update({_specs.state_name(i): s for i, s in enumerate(state)})
        out = runner.run(_specs.STEP, feeds)
        got.append(out[_specs.LOGITS])
        state = [out[_specs.new_state_name(i)] for i in range(len(state))]
    return np.stack(got, axis=1)


def _check_saved_model(run, keras_decoding, runner, fixed):
    """The SavedModel's ``step``, ``generate`` and ``generate_sampled`` signatures (those it has)."""
    ref = keras_decoding
    ref.check_steps(run, "saved_model", _saved_model_steps(run.specs, runner, ref.tokens), fixed)
    feeds = {
        _specs.PROMPT_IDS: ref.prompt,
        _specs.PADDING_MASK: np.ones_like(ref.prompt),
        _specs.MAX_LENGTH: np.int32(ref.max_length),
    }
    greedy = sampled = None
    if _specs.GENERATE in runner.signature_names:
        greedy = runner.run(_specs.GENERATE, feeds)[_specs.OUTPUT_IDS]
    if _specs.GENERATE_SAMPLED in runner.signature_names:
        temperature, top_k, top_p = ref.sampler.sampling_params()
        sampled_feeds = dict(
            feeds,
            **{
                _specs.TEMPERATURE: np.float32(temperature),
                _specs.TOP_K: np.int32(top_k),
                _specs.TOP_P: np.float32(top_p),
                _specs.SEED: np.int64(run.seed),
            },
        )
        sampled = runner.run(_specs.GENERATE_SAMPLED, sampled_feeds)[_specs.OUTPUT_IDS]
    names = (f"{_specs.GENERATE}:output_ids", f"{_specs.GENERATE_SAMPLED}:output_ids")
    ref.check_tokens(run, "saved_model", greedy, sampled, names)


def _check_onnx(run, keras_decoding, step_path, generate_path, fixed, session_options):
    """The ONNX step graph, then (where it exists) the generate graph, greedy and sampled."""
    ref = keras_decoding
    # No prepacked weight copies: verify checks values, and a 1B model's sessions peaked 6 GiB higher with them.
    options = {"session_options": session_options} if session_options is not None else {"prepacking": False}
    gen = OnnxGenerator(step_path, generate_path=generate_path, device=run.onnx_device, **options)
    state = gen.initial_state(ref.batch)
    got = []
    for t in range(ref.steps):
        logits, state = gen.step(ref.tokens[:, t], state)
        got.append(logits)
    ref.check_steps(run, "onnx", np.stack(got, axis=1), fixed)
    # `generate` runs the generate graph alone: free the step session's weights first
    # (a 1B model's step and generate sessions together with Keras' model passed 24 GB).
    gen.predictor = None
    gc.collect()
    if gen.generate_path is not None and os.path.isfile(gen.generate_path):
        greedy = _onnx_tokens(gen, ref.greedy_ids, ref.prompt, ref.max_length, sampler="greedy")
        sampled = _onnx_tokens(gen, ref.sampled_ids, ref.prompt, ref.max_length, sampler=ref.sampler, seed=run.seed)
        graph = os.path.basename(gen.generate_path)
        ref.check_tokens(run, "onnx", greedy, sampled, (f"{graph}:greedy", f"{graph}:sampled"))


def check_decoding(
    run, runner, onnx_step_path, onnx_generate_path, batch, steps, limit, sm_fixed, onnx_fixed, session_options=None
):
    """The decoding rows of a causal LM: the SavedModel's signatures, then the ONNX step and generate graphs.

    Args:
        run: the `_verify_report._Run` of the call.
        runner: a `SavedModelRunner`, or None.
        onnx_step_path: the ONNX step graph, or None.
        onnx_generate_path: the ONNX generate graph, or None.
        batch, steps: the shape of the random tokens stepped through.
        limit: the model's max_sequence_length, or None.
        sm_fixed, onnx_fixed: None (the error model) or a fixed max
            relative difference of the step logits.
        session_options: the `onnxruntime.SessionOptions` of the step and
            generate sessions (`_verify_sessions`); None: `OnnxGenerator`'s
            without prepacking.
    """
    keras_decoding = _KerasDecoding(run, batch, steps, limit)
    if runner is not None:
        _check_saved_model(run, keras_decoding, runner, sm_fixed)
    if onnx_step_path is not None:
        _check_onnx(run, keras_decoding, onnx_step_path, onnx_generate_path, onnx_fixed, session_options)
