"""The error model behind every numeric bound: the test suite's and `export.verify`'s.

The test suite imports it as ``tests.tolerance`` (docs/dev/testing.md);
`keras_linattn.export.verify` bounds export-vs-Keras differences with it.

A bound is ``C_ROUND * eps(dtype) * sqrt(n) * conditioning``:

- ``eps(dtype)`` is the machine epsilon of the precision the computation under
  test rounds in (float32: 2**-23, float16: 2**-10, bfloat16: 2**-7);
- ``n`` is the reduction length of the computation: the sum of the lengths of
  the reductions on the longest path from the inputs to the compared value
  (a projection over ``D`` inputs, attention over ``S`` keys and ``C``
  features, an output projection over ``H * M``...). Rounding errors of a sum
  of ``n`` terms grow like ``sqrt(n)`` (they are independent, zero-mean);
  errors of reductions in sequence add up, so their lengths add;
- ``conditioning`` is the normalizer's condition number where a denominator
  can be small (signed kernels: `normalizer_conditioning`), else 1;
- ``C_ROUND`` is one small constant for the whole suite.

Errors are measured as ``rel_err``: ``max|a - b| / max|b|``. Every comparison
against an oracle compares with a float64 oracle; a comparison of two
computations in the same precision (step against parallel, export against
Keras) uses ``paths=2``: each side carries its own rounding error.

Setting ``KLA_TOLERANCE_LOG=FILE`` appends ``test<TAB>error<TAB>bound`` for
every check, which is how the margin reported in docs/dev/testing.md is measured.
"""

import math
import os

import numpy as np

# The one constant. Rounding errors that behave like a random walk stay below
# ~3 sqrt(n) eps with overwhelming probability; 4 leaves room for the few
# elementwise roundings (exp, division, casts) that every path also has.
C_ROUND = 4.0

_EPS = {
    "float64": float(np.finfo(np.float64).eps),
    "float32": float(np.finfo(np.float32).eps),
    "float16": float(np.finfo(np.float16).eps),
    "bfloat16": 2.0**-7,  # 8 significand bits (7 stored)
}
# Mixed-precision policies round their matmuls in the compute dtype.
_EPS["mixed_float16"] = _EPS["float16"]
_EPS["mixed_bfloat16"] = _EPS["bfloat16"]

# A bound this large would pass an all-zero output (rel_err = 1): refuse it.
VACUOUS = 0.5


def eps(dtype):
    """Machine epsilon of ``dtype`` (a name, numpy dtype or mixed policy name)."""
    name = getattr(dtype, "name", None) or str(dtype)
    try:
        return _EPS[name]
    except KeyError:
        raise ValueError(f"no epsilon for dtype {dtype!r}") from None


def bound(dtype="float32", n=1, conditioning=1.0, paths=1):
    """The largest relative error the error model allows (see the module docstring)."""
    if n < 1:
        raise ValueError(f"reduction length must be >= 1, got n={n}")
    if not conditioning >= 1.0:
        raise ValueError(f"conditioning must be >= 1, got {conditioning}")
    b = paths * C_ROUND * eps(dtype) * math.sqrt(n) * conditioning
    if b >= VACUOUS:
        raise ValueError(
            f"bound {b:.3g} (dtype={dtype}, n={n}, conditioning={conditioning:.3g}) would pass an "
            "all-zero output: the comparison is not a test. Reduce n or the conditioning."
        )
    return b


def rel_err(actual, expected):
    """``max|a - b| / max|b|``, in float64."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {actual.shape} vs {expected.shape}")
    if expected.size == 0:
        return 0.0
    scale = max(float(np.abs(expected).max()), 1e-30)
    return float(np.abs(actual - expected).max() / scale)


def _log(err, b):
    path = os.environ.get("KLA_TOLERANCE_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        with open(path, "a") as f:
            f.write(f"{test}\t{err:.6g}\t{b:.6g}\n")


def assert_close(actual, expected, *, n, dtype="float32", conditioning=1.0, paths=1, what=""):
    """``rel_err(actual, expected) <= bound(dtype, n, conditioning, paths)``.

    ``actual`` must be finite wherever ``expected`` is: a NaN never passes.
    """
    b = bound(dtype, n, conditioning, paths)
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert np.isfinite(actual).all() or not np.isfinite(expected).all(), f"{what}: non-finite output"
    err = rel_err(actual, expected)
    _log(err, b)
    assert err <= b, (
        f"{what}: relative error {err:.3g} > bound {b:.3g} = {paths} * {C_ROUND} * eps({dtype}) * "
        f"sqrt({n}) * conditioning {conditioning:.3g}"
    )
    return err


def normalizer_conditioning(q_features, k_features, causal=False, key_mask=None, epsilon=1e-6, per_channel=False):
    """Condition number of ``out = A v / A 1`` for ``A = phi(q) phi(k)^T``.

    For each (batch, head, query) row with at least one key:
    ``sum_s |A_ts| / max(|sum_s A_ts|, guard)``, the magnitude of what enters
    the denominator over the denominator the layer divides by
    (replaced where degenerate, ``|sum_s A_ts| <= epsilon * sum_s |A_ts|``,
    by that guard, as the layer's relative guard does); 1 for positive
    kernels. The worst row is returned.

    ``per_channel=True`` counts every product ``|phi(q)_c phi(k_s)_c|``
    instead of ``|A_ts|``: the condition number of computing the dot
    products themselves in floating point, which is what separates two
    float32 evaluations (step and parallel). A signed kernel (favor_trig)
    can cancel inside one dot product, even with a single key. Features
    ``[B, T, H, C]`` / ``[B, S, H, C]``, computed in float64.
    """
    q = np.asarray(q_features, np.float64)
    k = np.asarray(k_features, np.float64)
    a = np.einsum("bthc,bshc->bhts", q, k)  # [B, H, T, S]
    if per_channel:
        magnitude = np.einsum("bthc,bshc->bhts", np.abs(q), np.abs(k))  # [B, H, T, S]
    else:
        magnitude = np.abs(a)
    allowed = np.ones(a.shape, bool)
    if causal:
        allowed &= np.tril(np.ones(a.shape[-2:], bool))
    if key_mask is not None:
        allowed &= np.asarray(key_mask, bool)[:, None, None, :]
    a = np.where(allowed, a, 0.0)
    magnitude = np.where(allowed, magnitude, 0.0)
    absolute = magnitude.sum(-1)  # [B, H, T]
    signed = np.maximum(np.abs(a.sum(-1)), epsilon * absolute)
    rows = allowed.any(-1)
    ratio = np.where(rows, absolute / np.maximum(signed, 1e-300), 1.0)
    return float(max(ratio.max(), 1.0))


def assert_rows_close(actual, expected, *, n, row_conditioning, dtype="float32", paths=1, what=""):
    """`assert_close` on each batch row (axis 0) with that row's conditioning.

    A row whose bound would be vacuous (its denominator cancels below what
    ``dtype`` resolves: the output there is fixed by rounding, see
    `normalizer_conditioning`) is not compared; it must still be finite. At
    least one row must be compared, or the check fails: it never passes
    without comparing anything. Returns the number of rows compared.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    compared = 0
    for row, conditioning in enumerate(row_conditioning):
        if paths * C_ROUND * eps(dtype) * math.sqrt(n) * conditioning >= VACUOUS:
            assert np.isfinite(actual[row]).all(), f"{what}: non-finite output in row {row}"
            continue
        assert_close(
            actual[row],
            expected[row],
            n=n,
            dtype=dtype,
            conditioning=conditioning,
            paths=paths,
            what=f"{what} row {row}",
        )
        compared += 1
    assert compared, f"{what}: every row is too ill-conditioned for {dtype}: {list(row_conditioning)}"
    return compared


def summarize(path, top=10):
    """Lines of a ``KLA_TOLERANCE_LOG`` file -> (number of checks, worst error/bound, the `top` worst)."""
    worst = {}
    with open(path) as f:
        for line in f:
            test, err, b = line.rstrip("\n").split("\t")
            ratio = float(err) / float(b)
            if ratio > worst.get(test, (-1.0,))[0]:
                worst[test] = (ratio, float(err), float(b))
    ranked = sorted(worst.items(), key=lambda kv: -kv[1][0])
    return len(worst), (ranked[0][1][0] if ranked else 0.0), ranked[:top]
