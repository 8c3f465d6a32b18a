"""Checks that exported artifacts compute what the Keras model computes."""

import os

import numpy as np

from keras_linattn.export import _specs

__all__ = ["VerificationError", "VerificationReport", "differences", "verify"]

_SAVED_MODEL_TOLERANCE = 1e-5
_ONNX_TOLERANCE = 1e-4
_DEFAULT_SHAPES = ((1, 7), (3, 13), (2, 70))


class VerificationError(RuntimeError):
    """Raised by `verify` when an export differs from Keras past tolerance."""

    def __init__(self, report):
        self.report = report
        failed = [r for r in report.rows if not r.ok]
        super().__init__(
            f"{len(failed)} of {len(report.rows)} checks exceed tolerance:\n" + report.table(failed)
        )


class _Check:
    """One comparison: a backend and signature on one input shape."""

    def __init__(self, backend, signature, shape, max_abs, max_rel, tolerance, exact=False):
        self.backend = backend
        self.signature = signature
        self.shape = shape
        self.max_abs = float(max_abs)
        self.max_rel = float(max_rel)
        self.tolerance = tolerance
        self.exact = exact
        self.ok = (self.max_abs == 0.0) if exact else bool(self.max_rel <= tolerance)

    def as_dict(self):
        return dict(vars(self))


def _format_table(rows, header):
    """Left-aligned text table: the header, a rule of dashes, then one line per row."""
    lines = [tuple(header)] + [tuple(row) for row in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class VerificationReport:
    """The rows of a `verify` run; `table()` formats them for a terminal."""

    def __init__(self):
        self.rows = []

    @property
    def ok(self):
        return all(r.ok for r in self.rows)

    def add(self, row):
        self.rows.append(row)
        return row

    def table(self, rows=None):
        rows = self.rows if rows is None else rows
        header = ("backend", "signature", "shape", "max abs diff", "max rel diff", "tolerance", "status")
        lines = [header]
        for r in rows:
            lines.append(
                (
                    r.backend,
                    r.signature,
                    "x".join(str(d) for d in r.shape),
                    f"{r.max_abs:.2e}",
                    f"{r.max_rel:.2e}",
                    "exact" if r.exact else f"{r.tolerance:.0e}",
                    "ok" if r.ok else "FAIL",
                )
            )
        return _format_table(lines[1:], header)


def differences(actual, expected):
    """(max |a - b|, max |a - b| / max |b|) in float64."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"Output shapes differ. Received: actual.shape={a.shape}, expected.shape={b.shape}")
    diff = float(np.abs(a - b).max()) if a.size else 0.0
    scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-30)
    return diff, diff / scale


def _keras_outputs(specs, feeds):
    args = [feeds[s.name] for s in specs.input_specs]
    outputs = specs.model(specs.pack_inputs(args), training=False)
    named = specs.name_outputs(outputs)
    return {k: np.asarray(v) for k, v in named.items()}


def _keras_step_trace(specs, tokens):
    """Keras `step` over `tokens [B, T]` from the initial state: logits per step."""
    model = specs.model
    state = model.get_initial_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        out, state = model.step(tokens[:, t].astype("int32"), state)
        logits.append(np.asarray(out))
    return np.stack(logits, axis=1)  # [B, T, V]


def verify(
    model,
    saved_model_dir=None,
    onnx_path=None,
    onnx_step_path=None,
    shapes=_DEFAULT_SHAPES,
    saved_model_tolerance=_SAVED_MODEL_TOLERANCE,
    onnx_tolerance=_ONNX_TOLERANCE,
    decode_steps=5,
    seed=0,
    raise_on_failure=True,
    onnx_device="cpu",
    progress=None,
):
    """Runs the same inputs through Keras and the exports and compares.

    The SavedModel is run through `SavedModelRunner` (the TF1 loader +
    Session path of TF Serving and `saved_model_cli run`), the ONNX file
    through `OnnxPredictor`. For each ``(batch, length)`` in `shapes` the
    max absolute and relative (``max|a-b| / max|b|``) differences are
    recorded per backend; relative differences above the tolerances fail.
    For causal LMs, the ``step`` signature and the ONNX step graph are
    compared with Keras `step` over `decode_steps` tokens, and the greedy
    ``generate`` signature must return exactly Keras' `generate()` tokens.

    Before running anything, a SavedModel written by `export_saved_model`
    is checked file by file against the sizes and sha256 it recorded
    (`check_integrity`), and an ONNX model and step graph must come from
    the same export (`check_pair`): a damaged or half-written export raises
    ValueError naming the file.

    Args:
        model: the Keras model that was exported.
        saved_model_dir: a SavedModel version dir (or None to skip).
        onnx_path: an ONNX file (or None to skip).
        onnx_step_path: the ONNX step graph of a causal LM (or None).
        shapes: ``(batch, length)`` pairs to test.
        saved_model_tolerance: max relative difference (default 1e-5).
        onnx_tolerance: max relative difference (default 1e-4).
        decode_steps: tokens compared for step / generate.
        seed: seed of the random inputs.
        raise_on_failure: raise `VerificationError` past tolerance.
        onnx_device: device of the ONNX checks (``"cpu"``, ``"auto"``...).
        progress: optional callable receiving one line per check.

    Returns:
        A `VerificationReport`.
    """
    from keras_linattn.export import onnx_export, saved_model
    from keras_linattn.export.saved_model_runner import SavedModelRunner

    # Damaged or mismatched files are named before anything runs.
    if saved_model_dir is not None and os.path.isfile(
        os.path.join(saved_model_dir, "assets.extra", saved_model._DESCRIPTION_FILE)
    ):
        saved_model.check_integrity(saved_model_dir)
    if onnx_path is not None and onnx_step_path is not None:
        onnx_export.check_pair(onnx_path, onnx_step_path)
    specs = _specs.ModelSpecs(model)
    desc = specs.describe()
    report = VerificationReport()
    say = progress or (lambda line: None)
    runner = SavedModelRunner(saved_model_dir) if saved_model_dir is not None else None
    predictor = None
    if onnx_path is not None:
        from keras_linattn.export.onnx_predictor import OnnxPredictor

        predictor = OnnxPredictor(onnx_path, device=onnx_device)
    try:
        for k, (batch, length) in enumerate(shapes):
            feeds = _specs.example_inputs(desc["inputs"], batch, length, specs.vocabulary_size, seed=seed + k)
            expected = _keras_outputs(specs, feeds)
            for backend, run, tol in (
                ("saved_model", runner and (lambda f: runner.run(_specs.SERVING_DEFAULT, f)), saved_model_tolerance),
                ("onnx", predictor and (lambda f: predictor.predict(f)), onnx_tolerance),
            ):
                if not run:
                    continue
                got = run(feeds)
                for name, ref in expected.items():
                    abs_d, rel_d = differences(got[name], ref)
                    signature = f"{_specs.SERVING_DEFAULT}:{name}"
                    row = report.add(_Check(backend, signature, (batch, length), abs_d, rel_d, tol))
                    say(f"{backend:12s} {row.signature} {batch}x{length}: rel {rel_d:.2e} {'ok' if row.ok else 'FAIL'}")
        if specs.causal_lm:
            _verify_decoding(
                specs,
                report,
                runner,
                onnx_step_path,
                shapes,
                saved_model_tolerance,
                onnx_tolerance,
                decode_steps,
                seed,
                onnx_device,
                say,
            )
    finally:
        if runner is not None:
            runner.close()
    if raise_on_failure and not report.ok:
        raise VerificationError(report)
    return report


def _verify_decoding(specs, report, runner, onnx_step_path, shapes, sm_tol, onnx_tol, steps, seed, onnx_device, say):
    model = specs.model
    batch = max(b for b, _ in shapes)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, specs.vocabulary_size or 2, size=(batch, steps)).astype(np.int32)
    expected = _keras_step_trace(specs, tokens)  # [B, T, V]
    if runner is not None:
        state = specs.initial_state(batch)
        got = []
        for t in range(steps):
            feeds = {_specs.TOKEN_T: tokens[:, t]}
            feeds.update({_specs.state_name(i): s for i, s in enumerate(state)})
            out = runner.run(_specs.STEP, feeds)
            got.append(out[_specs.LOGITS])
            state = [out[_specs.new_state_name(i)] for i in range(len(state))]
        abs_d, rel_d = differences(np.stack(got, axis=1), expected)
        row = report.add(_Check("saved_model", f"{_specs.STEP}:logits", (batch, steps), abs_d, rel_d, sm_tol))
        say(f"saved_model  step {batch}x{steps}: rel {rel_d:.2e} {'ok' if row.ok else 'FAIL'}")
        if _specs.GENERATE in runner.signature_names:
            prompt = tokens[:, :2]
            max_length = 2 + steps
            keras_ids = np.asarray(model.generate(prompt, max_length=max_length))
            feeds = {
                _specs.PROMPT_IDS: prompt,
                _specs.PADDING_MASK: np.ones_like(prompt),
                _specs.MAX_LENGTH: np.int32(max_length),
            }
            sm_ids = runner.run(_specs.GENERATE, feeds)[_specs.OUTPUT_IDS]
            mismatches = float(np.sum(keras_ids != sm_ids)) if keras_ids.shape == sm_ids.shape else float("inf")
            row = report.add(
                _Check(
                    "saved_model",
                    f"{_specs.GENERATE}:output_ids",
                    (batch, max_length),
                    mismatches,
                    mismatches,
                    0,
                    exact=True,
                )
            )
            count = int(mismatches) if np.isfinite(mismatches) else "shape"
            say(f"saved_model  generate {batch}x{max_length}: {count} mismatching tokens")
    if onnx_step_path is not None:
        from keras_linattn.export.onnx_generator import OnnxGenerator

        gen = OnnxGenerator(onnx_step_path, device=onnx_device)
        state = gen.initial_state(batch)
        got = []
        for t in range(steps):
            logits, state = gen.step(tokens[:, t], state)
            got.append(logits)
        abs_d, rel_d = differences(np.stack(got, axis=1), expected)
        row = report.add(_Check("onnx", f"{_specs.STEP}:logits", (batch, steps), abs_d, rel_d, onnx_tol))
        say(f"onnx         step {batch}x{steps}: rel {rel_d:.2e} {'ok' if row.ok else 'FAIL'}")
