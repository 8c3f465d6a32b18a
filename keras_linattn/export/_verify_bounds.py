"""The error model of `verify`: the bound of each batch row, and the comparison of one output against Keras'.

An export and the Keras model are two float32 computations of one function
(other kernels, other summation orders): `keras_linattn._tolerance` with
paths=2, the reduction length n of the model and the normalizer's
conditioning on the very inputs compared, as in the test suite.
"""

import contextlib
import math

import numpy as np

from keras_linattn import _compat, _tolerance
from keras_linattn.export._verify_report import _Check


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


# Public through `keras_linattn.export.verify`, and named after it in reprs.
differences.__module__ = "keras_linattn.export.verify"


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


# The step of an abs-max integer grid relative to the row's abs max (Keras' `AbsMaxQuantizer`:
# int8 rounds to [-127, 127], int4 to [-8, 7] with the max at 7). The quantization error model
# (docs/dev/testing.md) treats it as the epsilon of the quantized format.
QUANTIZED_EPS = {"int8": 1.0 / 127.0, "int4": 1.0 / 7.0}


def quantized_reduction(model):
    """``(n_q, eps_q)``: the contracted length of the model's quantized products and their step.

    ``n_q`` sums the fan-in of every integer kernel (the reductions whose
    inputs are rounded to an integer grid; a layer of several products
    gives them by its ``quantized_reductions()``), ``eps_q`` is the coarsest step
    among their modes (`QUANTIZED_EPS`). ``(0, 0.0)`` for a model without
    quantized layers.
    """
    n_q, eps_q = 0, 0.0
    for layer in _leaf_layers(model):
        mode = getattr(layer, "quantization_mode", None)
        if mode not in QUANTIZED_EPS:
            continue
        eps_q = max(eps_q, QUANTIZED_EPS[mode])
        if callable(getattr(layer, "quantized_reductions", None)):  # a layer of several products (MixtureOfExperts)
            n_q += sum(int(n) for n in layer.quantized_reductions())
        elif isinstance(getattr(layer, "equation", None), str) and hasattr(layer, "_kernel_reduced_axes"):
            shape = getattr(layer, "original_kernel_shape", None) or _compat.unmerged_kernel(layer).shape
            n_q += int(np.prod([int(shape[a]) for a in layer._kernel_reduced_axes]))
        elif hasattr(layer, "output_dim"):  # an embedding: its tied output projection sums over the width
            n_q += int(layer.output_dim)
        else:  # Dense: the kernel's input dim ([in, out], or int4's packed [in, out / 2])
            n_q += int(_compat.unmerged_kernel(layer).shape[0])
    return n_q, eps_q


def quantized_term(float_bound, n_q, eps_q):
    """The bound on two evaluations of one quantized model beyond their float rounding.

    Each evaluation rounds the inputs of its quantized products to the grid
    of their row (step ``eps_q`` relative to the row's abs max). Inputs that
    differ by the float bound relative to the row's max land on different
    grid points only where a grid boundary lies between them: with
    probability at most ``float_bound / eps_q`` per element, and then one
    step apart. Over the ``n_q`` rounded elements that is at most
    ``F = n_q * float_bound / eps_q`` such steps expected (and at least one
    must be allowed: a single one is possible at any F > 0), independent
    in sign: a random walk of ``max(1, F)`` steps of relative size
    ``eps_q``, held to ``C_ROUND`` standard deviations as the float model is.

    Args:
        float_bound: the float model's relative bound for the same comparison.
        n_q: `quantized_reduction`'s length (0: no quantized product).
        eps_q: `quantized_reduction`'s step.

    Returns:
        ``C_ROUND * eps_q * sqrt(max(1, F))``, or 0.0 when ``n_q`` is 0.
    """
    if not n_q:
        return 0.0
    steps = max(1.0, n_q * float_bound / eps_q)
    return _tolerance.C_ROUND * eps_q * math.sqrt(steps)


class _Bound:
    """The error model's bound per batch row, or one fixed tolerance for every row.

    ``quantized``: `quantized_reduction`'s ``(n_q, eps_q)`` of a quantized
    model, whose bound adds `quantized_term` to the float one.
    """

    def __init__(self, n, conditioning, fixed=None, quantized=(0, 0.0)):
        self.n, self.conditioning, self.fixed = n, np.asarray(conditioning, np.float64), fixed
        self.quantized = quantized

    def row(self, b):
        """Row b's bound; None where it would pass an all-zero output (not a test)."""
        if self.fixed is not None:
            return float(self.fixed)
        value = 2 * _tolerance.C_ROUND * _tolerance.eps("float32") * math.sqrt(self.n) * self.conditioning[b]
        value += quantized_term(value, *self.quantized)
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
