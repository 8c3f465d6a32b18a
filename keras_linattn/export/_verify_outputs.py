"""The output checks of `verify`: each backend's outputs against the Keras call, shape by shape."""

import numpy as np

from keras_linattn.export import _specs
from keras_linattn.export._verify_bounds import (
    _Bound,
    _compare,
    _recording_features,
    _reduction_length,
    quantized_reduction,
)


def _keras_outputs(specs, feeds, row_conditioning):
    """The Keras call's outputs by name, and the conditioning of each batch row."""
    args = [feeds[s.name] for s in specs.input_specs]
    with _recording_features(specs.model) as records:
        outputs = specs.model(specs.pack_inputs(args), training=False)
    named = specs.name_outputs(outputs)
    batch = next(iter(feeds.values())).shape[0] if feeds else 1
    return {k: np.asarray(v) for k, v in named.items()}, row_conditioning(records, batch)


def check_outputs(run, inputs, shapes, runner, predictor, saved_model_tolerance, onnx_tolerance):
    """One row per backend, output and shape: ``serving_default`` and the ONNX model against Keras.

    Args:
        run: the `_verify_report._Run` of the call.
        inputs: the model's input descriptions (``describe()["inputs"]``).
        shapes: ``(batch, length)`` pairs.
        runner: a `SavedModelRunner`, or None.
        predictor: an `OnnxPredictor`, or None.
        saved_model_tolerance, onnx_tolerance: None (the error model) or a
            fixed max relative difference.
    """
    specs = run.specs
    for k, (batch, length) in enumerate(shapes):
        feeds = _specs.example_inputs(inputs, batch, length, specs.vocabulary_size, seed=run.seed + k)
        expected, conditioning = _keras_outputs(specs, feeds, run.row_conditioning)
        n = _reduction_length(specs.model, length)
        quantized = quantized_reduction(specs.model)
        for backend, predict, fixed in (
            ("saved_model", runner and (lambda f: runner.run(_specs.SERVING_DEFAULT, f)), saved_model_tolerance),
            ("onnx", predictor and (lambda f: predictor.predict(f)), onnx_tolerance),
        ):
            if not predict:
                continue
            got = predict(feeds)
            for name, ref in expected.items():
                signature = f"{_specs.SERVING_DEFAULT}:{name}"
                row = run.report.add(
                    _compare(
                        backend, signature, (batch, length), got[name], ref, _Bound(n, conditioning, fixed, quantized)
                    )
                )
                run.say(
                    f"{backend:12s} {row.signature} {batch}x{length}: rel {row.max_rel:.2e} "
                    f"(bound {row.tolerance:.1e}) {row.status}"
                )
