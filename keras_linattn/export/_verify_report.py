"""The results of `verify`: one `_Check` per comparison, gathered in a `VerificationReport`, and their table.

`_Run` carries what the checks of one `verify` call share, the report they
add their rows to included.
"""

import math


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


# Public through `keras_linattn.export.verify`, and named after it in reprs, tracebacks and pickles.
VerificationError.__module__ = VerificationReport.__module__ = "keras_linattn.export.verify"


class _Run:
    """What the checks of one `verify` call share.

    Attributes:
        specs: the model's `_specs.ModelSpecs`.
        report: the `VerificationReport` each check adds its row to.
        say: called with one progress line per row.
        seed: seed of the random inputs and of the sampled generation.
        onnx_device: device of the ONNX sessions.
        row_conditioning: the error model's conditioning per batch row,
            ``(records, batch) -> [batch]``: the ``_row_conditioning`` that
            `keras_linattn.export.verify` holds when `verify` is called.
    """

    def __init__(self, specs, report, say, seed, onnx_device, row_conditioning):
        self.specs = specs
        self.report = report
        self.say = say
        self.seed = seed
        self.onnx_device = onnx_device
        self.row_conditioning = row_conditioning
