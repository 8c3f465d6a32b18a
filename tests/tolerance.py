"""The error model behind every numeric bound in the suite (docs/dev/testing.md).

It lives in the package, `keras_linattn._tolerance`, so that
`keras_linattn.export.verify` bounds export-vs-Keras differences with the
same model as the tests; this module re-exports it unchanged. A bound is
``paths * C_ROUND * eps(dtype) * sqrt(n) * conditioning`` (see the
package module's docstring).

    python -m tests.tolerance LOG [TOP]   # summarize a KLA_TOLERANCE_LOG file
"""

from keras_linattn._tolerance import (  # noqa: F401 - the suite's API
    _EPS,
    C_ROUND,
    VACUOUS,
    _log,
    assert_close,
    assert_rows_close,
    bound,
    eps,
    normalizer_conditioning,
    rel_err,
    summarize,
)

if __name__ == "__main__":  # python -m tests.tolerance LOG [TOP]
    import sys

    count, worst_ratio, ranked = summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
    print(f"{count} tests with bounded checks; worst error/bound = {worst_ratio:.3f}")
    for test, (ratio, err, b) in ranked:
        print(f"{ratio:6.3f}  err {err:.3g}  bound {b:.3g}  {test}")
