"""Checks that exported artifacts compute what the Keras model computes.

`verify` is the entry point. Its checks, by concern: `_verify_weights` (the
stored weights), `_verify_outputs` (the model's outputs), `_verify_decoding`
(the step and generate graphs), with the error model they are held to in
`_verify_bounds` and their rows and table in `_verify_report`.
"""

import os

import numpy as np

from keras_linattn.export import (
    _float_compute,
    _specs,
    _verify_bounds,
    _verify_decoding,
    _verify_outputs,
    _verify_sessions,
    _verify_weights,
    onnx_export,
    saved_model,
)
from keras_linattn.export._verify_bounds import differences
from keras_linattn.export._verify_report import VerificationError, VerificationReport, _Run
from keras_linattn.export.onnx_predictor import OnnxPredictor
from keras_linattn.export.saved_model_runner import SavedModelRunner

__all__ = ["VerificationError", "VerificationReport", "differences", "verify"]

# Lengths of the default shapes (7 and 13 are not multiples of any chunk; 70
# is longer than the default chunk of 64). Models with a position table get
# lengths clipped to `max_sequence_length` and one shape of that full length.
_DEFAULT_SHAPES = ((1, 7), (3, 13), (2, 70))
_DEFAULT_DECODE_STEPS = 5
# The default `decode_steps` of a model with a position limit: the limit, at most this.
DEFAULT_MAX_DECODE_STEPS = 64


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


def _resolve_decode_steps(decode_steps, limit):
    if decode_steps is None:
        decode_steps = min(limit, DEFAULT_MAX_DECODE_STEPS) if limit is not None else _DEFAULT_DECODE_STEPS
    if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or decode_steps < 1:
        raise ValueError(f"`decode_steps` must be a positive int. Received: decode_steps={decode_steps!r}")
    if limit is not None:
        decode_steps = min(decode_steps, limit)
    return decode_steps


def _check_files(saved_model_dir, onnx_path, onnx_step_path, onnx_generate_path):
    """Names a damaged or mismatched file before anything runs; returns the ONNX step and generate paths."""
    if saved_model_dir is not None and os.path.isfile(
        os.path.join(saved_model_dir, "assets.extra", saved_model._DESCRIPTION_FILE)
    ):
        saved_model.check_integrity(saved_model_dir)
    if onnx_path is not None:
        # Ids, headers and sizes here: the weight-by-weight check below names a damaged weight.
        onnx_step_path = onnx_export.check_pair(onnx_path, onnx_step_path, verify="fast")
        if onnx_generate_path is None:
            linked = onnx_export._read_metadata(onnx_path).get("generate_file")
            if linked:
                onnx_generate_path = os.path.join(os.path.dirname(os.path.abspath(onnx_path)), *linked.split("/"))
    return onnx_step_path, onnx_generate_path


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
        check_weights: compare the stored weights with the model's. The
            ONNX sessions on the CPU then read each weight found equal, bit
            for bit and by name, from the model's own memory instead of a
            second copy from the file (sound only because of that check);
            a weight that differs, and every weight with
            ``check_weights=False``, is loaded from the file.

    Returns:
        A `VerificationReport`.

    Raises:
        ValueError: a damaged or mismatched file, or `shapes` past the
            model's limit.
        VerificationError: a check failed or could not be verified (with
            `raise_on_failure`).
    """
    limit = _model_limit(model, max_sequence_length)
    shapes = _resolve_shapes(shapes, limit)
    decode_steps = _resolve_decode_steps(decode_steps, limit)
    onnx_step_path, onnx_generate_path = _check_files(saved_model_dir, onnx_path, onnx_step_path, onnx_generate_path)
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    inputs = specs.describe()["inputs"]
    report = VerificationReport()
    run = _Run(specs, report, progress or (lambda line: None), seed, onnx_device, _verify_bounds._row_conditioning)
    runner = SavedModelRunner(saved_model_dir) if saved_model_dir is not None else None
    paths = (saved_model_dir, onnx_path, onnx_step_path, onnx_generate_path, check_weights)
    tolerances = (saved_model_tolerance, onnx_tolerance)
    # The exports of a 16-bit model compute in float32 on its weights (`_float_compute`): so does the reference.
    with _float_compute.float32_compute(model):
        _check_all(run, model, specs, inputs, shapes, runner, paths, decode_steps, limit, tolerances)
    if raise_on_failure and not report.ok:
        raise VerificationError(report)
    return report


def _check_all(run, model, specs, inputs, shapes, runner, paths, decode_steps, limit, tolerances):
    """`verify`'s checks: the stored weights, the outputs, then the step and generate graphs of a causal LM.

    At most one onnxruntime session is alive at a time: the model graph's
    session is made after the weight checks and this function holds its only
    reference, dropped before the step and generate graphs load theirs. On
    the CPU, the sessions read the weights the weight check proved equal
    from the model's own buffers (`_verify_sessions`): no second copy of the
    weights (a 1B model's are 4.6 GiB). Without `check_weights` they load
    the file's.
    """
    saved_model_dir, onnx_path, onnx_step_path, onnx_generate_path, check_weights = paths
    saved_model_tolerance, onnx_tolerance = tolerances
    same = {}
    try:
        if check_weights:
            same = _verify_weights.check_files(
                run, model, saved_model_dir, (onnx_path, onnx_step_path, onnx_generate_path)
            )
        predictor = None
        if onnx_path is not None:
            options, shared = _verify_sessions.session_options(model, same.get(onnx_path), run.onnx_device)
            predictor = OnnxPredictor(onnx_path, device=run.onnx_device, session_options=options)
        _verify_outputs.check_outputs(run, inputs, shapes, runner, predictor, saved_model_tolerance, onnx_tolerance)
        predictor = options = shared = None  # the only references: the session is freed here
        if specs.causal_lm:
            # The step and generate sessions share one set of options: the weights proven in both files.
            proven = [n for n in same.get(onnx_step_path, ()) if n in set(same.get(onnx_generate_path, ()))]
            if onnx_generate_path is None or not os.path.isfile(onnx_generate_path):
                proven = same.get(onnx_step_path)
            decoding_options, shared = _verify_sessions.session_options(model, proven, run.onnx_device)
            _verify_decoding.check_decoding(
                run,
                runner,
                onnx_step_path,
                onnx_generate_path,
                batch=max(b for b, _ in shapes),
                steps=decode_steps,
                limit=limit,
                sm_fixed=saved_model_tolerance,
                onnx_fixed=onnx_tolerance,
                session_options=decoding_options,
            )
    finally:
        if runner is not None:
            runner.close()
