"""Checks that exported artifacts compute what the Keras model computes."""

import contextlib
import gc
import math
import os

import numpy as np

from keras_linattn import _compat, _tolerance
from keras_linattn.export import _specs, _verify_weights

__all__ = ["VerificationError", "VerificationReport", "differences", "verify"]

# Lengths of the default shapes (7 and 13 are not multiples of any chunk; 70
# is longer than the default chunk of 64). Models with a position table get
# lengths clipped to `max_sequence_length` and one shape of that full length.
_DEFAULT_SHAPES = ((1, 7), (3, 13), (2, 70))
_DEFAULT_DECODE_STEPS = 5
# The default `decode_steps` of a model with a position limit: the limit, at most this.
DEFAULT_MAX_DECODE_STEPS = 64
# The sampler of the `generate_sampled` / ONNX generate check.
_SAMPLED = {"temperature": 0.8, "k": 8, "p": 0.9}


class VerificationError(RuntimeError):
    """Raised by `verify` when an export differs from Keras past tolerance, or a check could not be verified."""

    def __init__(self, report):
        self.report = report
        total = len(report.rows)
        parts = []
        if report.failed:
            parts.append(f"{len(report.failed)} of {total} checks exceed tolerance")
        if report.unverified:
            parts.append(
                f"{len(report.unverified)} of {total} checks could not be verified (no row well-conditioned "
                "enough to compare in float32)"
            )
        bad = [r for r in report.rows if not r.ok]
        super().__init__("; ".join(parts) + ":\n" + report.table(bad))


class _Check:
    """One comparison: a backend and signature on one input shape.

    ``exact`` checks count mismatches (tokens, weights): `max_abs` holds the
    count and the check passes at 0. Others pass when ``max_rel <=
    tolerance``; `tolerance` is the error model's bound (or a fixed one).
    A check that could compare nothing (every row's bound vacuous) has
    ``verified=False``: it neither passes nor fails, its `status` is
    ``"not verified"``.
    """

    def __init__(
        self, backend, signature, shape, max_abs, max_rel, tolerance, exact=False, ok=None, detail="", verified=True
    ):
        self.backend = backend
        self.signature = signature
        self.shape = tuple(shape)
        self.max_abs = float(max_abs)
        self.max_rel = float(max_rel)
        self.tolerance = tolerance
        self.exact = exact
        self.detail = detail
        self.verified = bool(verified)
        if ok is None:
            ok = (self.max_abs == 0.0) if exact else bool(self.max_rel <= tolerance)
        self.ok = bool(ok) and self.verified

    @property
    def status(self):
        """``"ok"``, ``"FAIL"`` (differs past tolerance, or not finite) or ``"not verified"``."""
        if not self.verified:
            return "not verified"
        return "ok" if self.ok else "FAIL"

    def as_dict(self):
        return {**vars(self), "status": self.status}


def _format_table(rows, header):
    """Left-aligned text table: the header, a rule of dashes, then one line per row."""
    lines = [tuple(header)] + [tuple(row) for row in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


class VerificationReport:
    """The rows of a `verify` run; `table()` formats them for a terminal."""

    def __init__(self):
        self.rows = []

    @property
    def ok(self):
        """True if every check passed (none failed, none left unverified)."""
        return all(r.ok for r in self.rows)

    @property
    def failed(self):
        """The checks that differ past tolerance (or gave non-finite outputs)."""
        return [r for r in self.rows if r.verified and not r.ok]

    @property
    def unverified(self):
        """The checks that could compare nothing: neither passed nor failed."""
        return [r for r in self.rows if not r.verified]

    @property
    def status(self):
        """``"ok"``, ``"failed"`` (a check failed) or ``"not verified"`` (none failed, some compared nothing)."""
        if self.failed:
            return "failed"
        return "not verified" if self.unverified else "ok"

    def add(self, row):
        self.rows.append(row)
        return row

    def table(self, rows=None):
        rows = self.rows if rows is None else rows
        header = ("backend", "signature", "shape", "max abs diff", "max rel diff", "tolerance", "status")
        lines = []
        for r in rows:
            if r.exact:
                diffs = (f"{int(r.max_abs)} differ" if math.isfinite(r.max_abs) else "shape", "")
            else:
                diffs = (f"{r.max_abs:.2e}", f"{r.max_rel:.2e}")
            lines.append(
                (
                    r.backend,
                    r.signature,
                    "x".join(str(d) for d in r.shape),
                    *diffs,
                    "exact" if r.exact else f"{r.tolerance:.1e}",
                    r.status + (f" ({r.detail})" if r.detail else ""),
                )
            )
        return _format_table(lines, header)


def differences(actual, expected):
    """(max |a - b|, max |a - b| / max |b|) in float64; NaN or inf where `actual` is not finite."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"Output shapes differ. Received: actual.shape={a.shape}, expected.shape={b.shape}")
    if not a.size:
        return 0.0, 0.0
    diff = np.abs(a - b)
    diff = float("nan") if np.isnan(diff).any() else float(diff.max())
    scale = max(float(np.abs(b).max()), 1e-30)
    return diff, diff / scale


# ------------------------------------------------------------ error model
# An export and the Keras model are two float32 computations of one function
# (other kernels, other summation orders): `keras_linattn._tolerance` with
# paths=2, the reduction length n of the model and the normalizer's
# conditioning on the very inputs compared, as in the test suite.


def _leaf_layers(model):
    layers = _compat.flatten_layers(model, include_self=False)
    return [layer for layer in layers if not list(_compat.flatten_layers(layer, include_self=False))]


def _fan_in(layer, variable):
    """Length of the sums a weight enters: the contracted dims of a kernel (0 for biases and scales)."""
    import keras

    shape = tuple(int(d) for d in variable.shape)
    name = str(getattr(variable, "path", variable.name)).rsplit("/", 1)[-1]
    if len(shape) < 2 or name.startswith(("bias", "beta", "gamma")):
        return 0
    if isinstance(layer, keras.layers.Embedding):
        return shape[-1]  # a lookup sums nothing; a tied output projection sums over the width
    equation = getattr(layer, "equation", None)  # EinsumDense: the kernel's dims absent from the output
    if isinstance(equation, str) and "->" in equation and "," in equation:
        inputs, output = equation.split("->")
        kernel_axes = inputs.split(",")[1].strip()
        if len(kernel_axes) == len(shape):
            return int(np.prod([d for axis, d in zip(kernel_axes, shape, strict=True) if axis not in output] or [1]))
    if isinstance(layer, keras.layers.Dense):
        return int(np.prod(shape[:-1]))
    # Other weights (feature-map projections [H, m, D], ...): every dim but the largest, an upper bound.
    return int(np.prod(sorted(shape)[:-1]))


def _reduction_length(model, length):
    """``n`` of the error model: the reductions of every layer, summed.

    The kernels' contracted dims, two passes over the normalized axis per
    normalization layer, and per attention layer the ``length`` keys and
    ``C`` features. Summing every layer bounds the longest path's sum (the
    test suite counts that path by hand).
    """
    n = 0
    for layer in _leaf_layers(model):
        for variable in layer.weights:
            if "float" in str(variable.dtype):
                n += _fan_in(layer, variable)
        if "Normalization" in type(layer).__name__ and layer.weights:
            n += 2 * int(np.prod(layer.weights[0].shape))
    for layer in _attention_layers(model):
        fm = getattr(layer, "feature_map", None)
        key_dim = int(getattr(layer, "key_dim", 1) or 1)
        n += int(length) + (fm.feature_dim(key_dim) if fm is not None else key_dim)
    return max(n, 1)


def _attention_layers(model):
    return [
        layer
        for layer in _compat.flatten_layers(model, include_self=False)
        if callable(getattr(getattr(layer, "recurrence", None), "features", None)) and hasattr(layer, "epsilon")
    ]


@contextlib.contextmanager
def _recording_features(model):
    """Records ``(layer, phi(q), phi(k), causal, key_mask)`` of every linear-attention call inside."""
    records = []
    pending_by_layer = {}
    layers = _attention_layers(model)
    for layer in layers:
        recurrence = layer.recurrence
        original = recurrence.features

        # A recurrence maps the queries, then the keys of the same call: pair them (one dict per layer).
        def features(x, is_query, causal=True, training=None, key_mask=None, *, _original=original, _layer=layer):
            _pending = pending_by_layer.setdefault(id(_layer), {})
            out = _original(x, is_query, causal, training, key_mask)
            if is_query:
                _pending["q"] = out
            elif "q" in _pending:
                records.append((_layer, _pending.pop("q"), out, causal, key_mask))
            return out

        recurrence.features = features
    try:
        yield records
    finally:
        for layer in layers:
            if "features" in vars(layer.recurrence):
                del layer.recurrence.features


def _row_conditioning(records, batch):
    """Per batch row: the product over attention layers of the normalizer's condition number.

    Each layer's error is amplified by the later ones, hence the product
    (the test suite's ``lm_tolerance``). A record that is not a concrete
    tensor (a traced call) counts 1.
    """
    conditioning = np.ones(batch)
    for layer, qf, kf, causal, key_mask in records:
        try:
            q, k = np.asarray(qf, np.float64), np.asarray(kf, np.float64)
            mask = None if key_mask is None else np.asarray(key_mask)
        except (TypeError, ValueError, NotImplementedError):
            continue
        if q.ndim != 4 or q.shape[0] != batch:
            continue
        for b in range(batch):
            conditioning[b] *= _tolerance.normalizer_conditioning(
                q[b : b + 1],
                k[b : b + 1],
                causal=bool(causal),
                key_mask=None if mask is None else mask[b : b + 1],
                epsilon=float(layer.epsilon),
            )
    return conditioning


class _Bound:
    """The error model's bound per batch row, or one fixed tolerance for every row."""

    def __init__(self, n, conditioning, fixed=None):
        self.n, self.conditioning, self.fixed = n, np.asarray(conditioning, np.float64), fixed

    def row(self, b):
        """Row b's bound; None where it would pass an all-zero output (not a test)."""
        if self.fixed is not None:
            return float(self.fixed)
        value = 2 * _tolerance.C_ROUND * _tolerance.eps("float32") * math.sqrt(self.n) * self.conditioning[b]
        return None if value >= _tolerance.VACUOUS else value


def _compare(backend, signature, shape, got, expected, bound):
    """A `_Check` of `got` against `expected` ``[B, ...]``, each batch row against its own bound.

    Rows whose bound would be vacuous are not compared (they must be
    finite). A check that compares no row proves nothing: with finite
    outputs it is "not verified" (``verified=False``, not ok); with
    non-finite ones it fails.
    """
    abs_d, rel_d = differences(got, expected)
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    worst = None  # (err / bound, err, bound)
    skipped = 0
    finite = True
    for b in range(expected.shape[0]):
        limit = bound.row(b)
        finite = finite and bool(np.isfinite(got[b]).all())
        if limit is None:
            skipped += 1
            continue
        _, err = differences(got[b], expected[b])
        ratio = err / limit if math.isfinite(err) else float("inf")
        if worst is None or not ratio <= worst[0]:
            worst = (ratio, err, limit)
    if worst is None:
        least = float(np.min(bound.conditioning)) if bound.conditioning.size else float("nan")
        return _Check(
            backend,
            signature,
            shape,
            abs_d,
            rel_d,
            float("inf"),
            ok=False,
            verified=not finite,
            detail=f"no row compared: every row ill-conditioned for float32 (conditioning >= {least:.3g})"
            + ("" if finite else ", and not finite"),
        )
    ok = finite and worst[0] <= 1.0
    detail = f"{skipped} ill-conditioned rows not compared" if skipped else ""
    return _Check(backend, signature, shape, abs_d, worst[1], worst[2], ok=ok, detail=detail)


# ---------------------------------------------------------------- weights
def _check_weights(report, backend, what, check, say):
    """A report row for a `_verify_weights.WeightCheck`."""
    detail = check.detail()
    missing = len(check.missing)
    row = report.add(_Check(backend, f"{what}:weights", (check.total,), missing, missing, 0, exact=True, detail=detail))
    say(
        f"{backend:12s} {what} weights: {check.exact}/{check.total} stored exactly" + (f" ({detail})" if detail else "")
    )
    return row


def _check_onnx_weights(report, model, path, say):
    if _verify_weights.onnx_has_named_weights(path):
        check = _verify_weights.check_by_name(_verify_weights.model_weights(model, skip_constant=False), path)
    else:  # an older export: weights folded into constants, matched by value
        check = _verify_weights.check_by_value(
            _verify_weights.model_weights(model), _verify_weights.onnx_tensors(path), allow_folded=True
        )
    return _check_weights(report, "onnx", os.path.basename(path), check, say)


# ----------------------------------------------------------------- inputs
def _model_limit(model, max_sequence_length):
    if max_sequence_length is not None:
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(
                f"`max_sequence_length` must be a positive int or None. Received: "
                f"max_sequence_length={max_sequence_length!r}"
            )
        return max_sequence_length
    limit = getattr(model, "max_sequence_length", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _resolve_shapes(shapes, limit):
    """The ``(batch, length)`` pairs to run: within `limit`, and one of length `limit` (every position row)."""
    if shapes is None:
        shapes = [(b, min(t, limit)) if limit else (b, t) for b, t in _DEFAULT_SHAPES]
    shapes = [tuple(s) for s in shapes]
    for s in shapes:
        if len(s) != 2 or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in s):
            raise ValueError(f"`shapes` must be (batch, length) pairs of positive ints. Received: shapes={shapes}")
    if limit is not None:
        longer = [s for s in shapes if s[1] > limit]
        if longer:
            raise ValueError(
                f"`shapes` has lengths past the model's max_sequence_length={limit}: {longer}. "
                f"Received: shapes={shapes}"
            )
        if not any(t == limit for _, t in shapes):
            shapes.append((2, limit))  # reaches every row of the position table
    return [(int(b), int(t)) for b, t in shapes]


def _keras_outputs(specs, feeds):
    args = [feeds[s.name] for s in specs.input_specs]
    with _recording_features(specs.model) as records:
        outputs = specs.model(specs.pack_inputs(args), training=False)
    named = specs.name_outputs(outputs)
    batch = next(iter(feeds.values())).shape[0] if feeds else 1
    return {k: np.asarray(v) for k, v in named.items()}, _row_conditioning(records, batch)


def _keras_step_trace(specs, tokens):
    """Keras `step` over `tokens [B, T]` from the initial state: logits per step."""
    model = specs.model
    state = model.get_initial_state(tokens.shape[0])
    logits = []
    for t in range(tokens.shape[1]):
        out, state = model.step(tokens[:, t].astype("int32"), state)
        logits.append(np.asarray(out))
    return np.stack(logits, axis=1)  # [B, T, V]


# ----------------------------------------------------------------- verify
def verify(
    model,
    saved_model_dir=None,
    onnx_path=None,
    onnx_step_path=None,
    shapes=None,
    saved_model_tolerance=None,
    onnx_tolerance=None,
    decode_steps=None,
    seed=0,
    raise_on_failure=True,
    onnx_device="cpu",
    progress=None,
    input_signature=None,
    max_sequence_length=None,
    onnx_generate_path=None,
    check_weights=True,
):
    """Runs the same inputs through Keras and every exported graph and signature, and compares.

    The SavedModel is run through `SavedModelRunner` (the TF1 loader +
    Session path of TF Serving and `saved_model_cli run`), the ONNX files
    through onnxruntime. Checked, for every ``(batch, length)`` in
    `shapes`: ``serving_default`` and the ONNX model against the Keras
    call. For causal LMs, over `decode_steps` tokens: the ``step``
    signature and the ONNX step graph against Keras `step`; the greedy
    ``generate`` signature and the ONNX generate graph (greedy and sampled)
    against Keras `generate()`, token for token; ``generate_sampled``
    against Keras `generate()` with the same top-k/top-p sampler and seed.

    Weights: every non-constant float weight of the model must be stored,
    with exactly its values, in the SavedModel's variables and in every
    ONNX file (transposed or reshaped is fine), so a damaged weight anywhere
    fails even where no input reaches it.

    Positions: a model with ``max_sequence_length`` (or the argument of
    that name) is run at lengths up to that limit only, and at that limit
    (every row of the position table is reached by the parallel checks).
    The decoding checks step through `decode_steps` tokens: by default the
    limit, at most `DEFAULT_MAX_DECODE_STEPS` (64): stepping every position
    of GPT-2 base's 1,024 took 16 minutes on a 2-core CPU. Pass
    ``decode_steps=max_sequence_length`` to step through every position.

    Tolerance: the error model of the test suite (`keras_linattn._tolerance`):
    two float32 evaluations of one function differ by at most
    ``2 * 4 * eps(float32) * sqrt(n) * conditioning`` relative to the
    output's scale, with ``n`` the reduction lengths of the model's layers
    (kernels' contracted dims, normalizations, ``length`` keys and the
    features of each attention) and ``conditioning`` the product over
    attention layers of the normalizer's condition number on these very
    inputs (1 for positive feature maps; large for a signed kernel such as
    favor_trig with trained-scale weights), per batch row. A row whose
    bound would pass an all-zero output is not compared (and said so); a
    check with no comparable row is "not verified": it does not pass
    (`VerificationReport.ok` is False, `status` ``"not verified"``), and it
    is told apart from a check that failed (`VerificationReport.failed`,
    `VerificationReport.unverified`). Tokens: a greedy token may differ
    only where Keras' two candidate logits are within that bound (a tie in
    float32); sampled tokens must be equal.

    Before running anything, a SavedModel written by `export_saved_model`
    is checked file by file against the sizes and sha256 it recorded
    (`check_integrity`), and the ONNX model, step and generate graphs must
    come from the same export (`check_pair`): a damaged or half-written
    export raises ValueError naming the file.

    Args:
        model: the Keras model that was exported.
        saved_model_dir: a SavedModel version dir (or None to skip).
        onnx_path: an ONNX file (or None to skip).
        onnx_step_path: the ONNX step graph of a causal LM; default: the one
            the model file names.
        shapes: ``(batch, length)`` pairs to test; default ``(1, 7), (3,
            13), (2, 70)``, lengths clipped to the model's limit.
        saved_model_tolerance: None (default: the error model), or a fixed
            max relative difference.
        onnx_tolerance: likewise for onnxruntime.
        decode_steps: tokens compared for step / generate; default
            `max_sequence_length` capped at `DEFAULT_MAX_DECODE_STEPS`
            (64) when the model has one, else 5.
        seed: seed of the random inputs and of the sampled generation.
        raise_on_failure: raise `VerificationError` past tolerance.
        onnx_device: device of the ONNX checks (``"cpu"``, ``"auto"``...).
        progress: optional callable receiving one line per check.
        input_signature: list of named `tf.TensorSpec`, as given to the
            exporters, for models whose inputs cannot be read from
            ``model.inputs`` (subclassed models).
        max_sequence_length: the longest sequence the model takes; default:
            the model's ``max_sequence_length`` attribute, if any.
        onnx_generate_path: the ONNX generate graph; default: the one the
            model file names.
        check_weights: compare the stored weights with the model's.

    Returns:
        A `VerificationReport`.

    Raises:
        ValueError: a damaged or mismatched file, or `shapes` past the
            model's limit.
        VerificationError: a check failed or could not be verified (with
            `raise_on_failure`).
    """
    from keras_linattn.export import onnx_export, saved_model
    from keras_linattn.export.saved_model_runner import SavedModelRunner

    limit = _model_limit(model, max_sequence_length)
    shapes = _resolve_shapes(shapes, limit)
    if decode_steps is None:
        decode_steps = min(limit, DEFAULT_MAX_DECODE_STEPS) if limit is not None else _DEFAULT_DECODE_STEPS
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
        raise ValueError(f"`decode_steps` must be a positive int. Received: decode_steps={decode_steps!r}")
    if limit is not None:
        decode_steps = min(decode_steps, limit)
    # Damaged or mismatched files are named before anything runs.
    if saved_model_dir is not None and os.path.isfile(
        os.path.join(saved_model_dir, "assets.extra", saved_model._DESCRIPTION_FILE)
    ):
        saved_model.check_integrity(saved_model_dir)
    if onnx_path is not None:
        onnx_step_path = onnx_export.check_pair(onnx_path, onnx_step_path)
        if onnx_generate_path is None:
            linked = onnx_export._read_metadata(onnx_path).get("generate_file")
            if linked:
                onnx_generate_path = os.path.join(os.path.dirname(os.path.abspath(onnx_path)), *linked.split("/"))
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    desc = specs.describe()
    report = VerificationReport()
    say = progress or (lambda line: None)
    runner = SavedModelRunner(saved_model_dir) if saved_model_dir is not None else None
    predictor = None
    if onnx_path is not None:
        from keras_linattn.export.onnx_predictor import OnnxPredictor

        predictor = OnnxPredictor(onnx_path, device=onnx_device)
    try:
        if check_weights:
            if runner is not None:
                check = _verify_weights.check_by_value(
                    _verify_weights.model_weights(model), _verify_weights.saved_model_tensors(saved_model_dir)
                )
                _check_weights(report, "saved_model", "variables", check, say)
            for path in (onnx_path, onnx_step_path, onnx_generate_path):
                if path is not None:
                    _check_onnx_weights(report, model, path, say)
        for k, (batch, length) in enumerate(shapes):
            feeds = _specs.example_inputs(desc["inputs"], batch, length, specs.vocabulary_size, seed=seed + k)
            expected, conditioning = _keras_outputs(specs, feeds)
            n = _reduction_length(model, length)
            for backend, run, fixed in (
                ("saved_model", runner and (lambda f: runner.run(_specs.SERVING_DEFAULT, f)), saved_model_tolerance),
                ("onnx", predictor and (lambda f: predictor.predict(f)), onnx_tolerance),
            ):
                if not run:
                    continue
                got = run(feeds)
                for name, ref in expected.items():
                    signature = f"{_specs.SERVING_DEFAULT}:{name}"
                    row = report.add(
                        _compare(backend, signature, (batch, length), got[name], ref, _Bound(n, conditioning, fixed))
                    )
                    say(
                        f"{backend:12s} {row.signature} {batch}x{length}: rel {row.max_rel:.2e} "
                        f"(bound {row.tolerance:.1e}) {row.status}"
                    )
        # The model's session is done: free its copy of the weights before the step and generate sessions
        # load theirs (a 1B model's are 4.6 GB each).
        predictor = None
        if specs.causal_lm:
            _verify_decoding(
                specs,
                report,
                runner,
                onnx_step_path,
                onnx_generate_path,
                shapes,
                saved_model_tolerance,
                onnx_tolerance,
                decode_steps,
                limit,
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
    from keras_linattn.models import generation

    try:
        return gen.generate(prompt, max_length=max_length, **kwargs)
    except generation.NonFiniteLogitsError as e:
        tokens = np.array(keras_ids, copy=True)
        for row, position in zip(e.rows, e.positions, strict=True):
            tokens[row, position:] = -1
        return tokens


def _verify_decoding(
    specs,
    report,
    runner,
    onnx_step_path,
    onnx_generate_path,
    shapes,
    sm_fixed,
    onnx_fixed,
    steps,
    limit,
    seed,
    onnx_device,
    say,
):
    from keras_linattn import samplers

    model = specs.model
    batch = max(b for b, _ in shapes)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, specs.vocabulary_size or 2, size=(batch, steps)).astype(np.int32)
    expected = _keras_step_trace(specs, tokens)  # [B, T, V]
    with _recording_features(model) as records:
        model(tokens, training=False)
    step_conditioning = _row_conditioning(records, batch)
    n = _reduction_length(model, steps)

    def step_row(backend, got, fixed):
        row = report.add(
            _compare(
                backend, f"{_specs.STEP}:logits", (batch, steps), got, expected, _Bound(n, step_conditioning, fixed)
            )
        )
        say(f"{backend:12s} step {batch}x{steps}: rel {row.max_rel:.2e} (bound {row.tolerance:.1e}) {row.status}")

    prompt = tokens[:, : min(2, steps)]
    max_length = prompt.shape[1] + steps if limit is None else min(prompt.shape[1] + steps, limit)
    sampler = samplers.get("top_p", **_SAMPLED)
    greedy_ids = np.asarray(model.generate(prompt, max_length=max_length, sampler="greedy"))
    sampled_ids = np.asarray(model.generate(prompt, max_length=max_length, sampler=sampler, seed=seed))
    with _recording_features(model) as records:
        greedy_logits = np.asarray(model(greedy_ids, training=False))  # what chose each greedy token
    generate_bound = _Bound(_reduction_length(model, max_length), _row_conditioning(records, batch))
    temperature, top_k, top_p = sampler.sampling_params()

    def token_rows(backend, greedy, sampled, names):
        for name, keras_ids, got, ties in (
            (names[0], greedy_ids, greedy, True),
            (names[1], sampled_ids, sampled, False),
        ):
            if got is None:
                continue
            row = report.add(_token_check(backend, name, keras_ids, got, greedy_logits, generate_bound, ties))
            count = int(row.max_abs) if math.isfinite(row.max_abs) else "shape"
            say(f"{backend:12s} {name} {batch}x{max_length}: {count} differing tokens {row.status}")

    if runner is not None:
        state = specs.initial_state(batch)
        got = []
        for t in range(steps):
            feeds = {_specs.TOKEN_T: tokens[:, t]}
            feeds.update({_specs.state_name(i): s for i, s in enumerate(state)})
            out = runner.run(_specs.STEP, feeds)
            got.append(out[_specs.LOGITS])
            state = [out[_specs.new_state_name(i)] for i in range(len(state))]
        step_row("saved_model", np.stack(got, axis=1), sm_fixed)
        feeds = {
            _specs.PROMPT_IDS: prompt,
            _specs.PADDING_MASK: np.ones_like(prompt),
            _specs.MAX_LENGTH: np.int32(max_length),
        }
        greedy = sampled = None
        if _specs.GENERATE in runner.signature_names:
            greedy = runner.run(_specs.GENERATE, feeds)[_specs.OUTPUT_IDS]
        if _specs.GENERATE_SAMPLED in runner.signature_names:
            sampled_feeds = dict(
                feeds,
                **{
                    _specs.TEMPERATURE: np.float32(temperature),
                    _specs.TOP_K: np.int32(top_k),
                    _specs.TOP_P: np.float32(top_p),
                    _specs.SEED: np.int64(seed),
                },
            )
            sampled = runner.run(_specs.GENERATE_SAMPLED, sampled_feeds)[_specs.OUTPUT_IDS]
        token_rows(
            "saved_model", greedy, sampled, (f"{_specs.GENERATE}:output_ids", f"{_specs.GENERATE_SAMPLED}:output_ids")
        )
    if onnx_step_path is not None:
        from keras_linattn.export.onnx_generator import OnnxGenerator

        gen = OnnxGenerator(onnx_step_path, generate_path=onnx_generate_path, device=onnx_device)
        state = gen.initial_state(batch)
        got = []
        for t in range(steps):
            logits, state = gen.step(tokens[:, t], state)
            got.append(logits)
        step_row("onnx", np.stack(got, axis=1), onnx_fixed)
        # `generate` runs the generate graph alone: free the step session's weights first
        # (a 1B model's step and generate sessions together with Keras' model passed 24 GB).
        gen.predictor = None
        gc.collect()
        if gen.generate_path is not None and os.path.isfile(gen.generate_path):
            greedy = _onnx_tokens(gen, greedy_ids, prompt, max_length, sampler="greedy")
            sampled = _onnx_tokens(gen, sampled_ids, prompt, max_length, sampler=sampler, seed=seed)
            graph = os.path.basename(gen.generate_path)
            token_rows("onnx", greedy, sampled, (f"{graph}:greedy", f"{graph}:sampled"))
