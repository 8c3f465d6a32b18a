"""Command line: ``keras-linattn export`` and ``keras-linattn verify``.

    keras-linattn export model.keras --out exported --name encoder
    keras-linattn verify exported

The arguments, the output and the errors are handled by the top-level
module `keras_linattn_cli` (the console script's entry point, which answers
``--help`` without importing TensorFlow); this module runs the commands.

`export` writes into one directory that can hold several models (it is the
directory TF Serving mounts):

    exported/
      manifest.json              what was exported, per model name
      keras/<name>.keras         copy of the source model (used by `verify`)
      <name>/<version>/          SavedModel, TF Serving layout (base_path: exported/<name>)
      onnx/<name>.onnx           ONNX graph of the model's call
      onnx/<name>_step.onnx      ONNX decode step (causal LMs)

Exporting a name again adds the next SavedModel version and replaces its
ONNX files; a format the new export does not write is removed (the
``<name>/`` folder, or the ONNX files the manifest recorded), so TF Serving
never serves the previous model beside a manifest that no longer lists it.
``--name`` is one path component (no separator, no leading ``.``, not
``keras`` or ``onnx``): every file stays inside ``--out``. Options are
checked before the model loads, and a failed export removes the SavedModel
version it published. `verify` also checks every folder TF Serving would
serve: each must be a name of the manifest whose highest version is the
recorded one.

Every file is published atomically (written in a ``.tmp-*`` staging
directory, then renamed), the ONNX model and step graph as a pair with one
export id, and ``manifest.json`` last: a killed export leaves the previous
state or the new one, plus a staging directory the next export removes.
`verify` checks the files against the sizes, sha256 and export ids recorded
at export before it runs anything, and reports a missing, truncated or
corrupted file, or a half-finished export, in one line with exit status 2.
Exit status of `verify`: 0 every check passed; 1 an artifact differs from
Keras; 2 damaged files or bad arguments; 3 nothing differs but a check
could not be verified (every row it ran too ill-conditioned for float32).
Every error of either command (bad arguments, a damaged or missing file, a
missing package, an unexpected failure) is one line, ``error: ...`` naming
the fix, with exit status 2; a failed `export` leaves no folder it created
empty behind, and stops before it loads anything when TF Serving's warmup
protos (tensorflow-serving-api) are missing (``--no-warmup`` skips them).
"""

import json
import os
import re
import shutil
import sys
import time
import zipfile

import keras_linattn  # noqa: F401 - registers the layers and models
from keras_linattn import _atomic, export
from keras_linattn.export import onnx_export
from keras_linattn.export._verify_report import _format_table
from keras_linattn_cli import CommandError, build_parser, check_name, main
from keras_linattn_cli import log as _log

__all__ = ["build_parser", "main", "run"]

_MANIFEST = "manifest.json"


def _size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _human(num_bytes):
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024


def _load_model(path):
    import keras

    if not os.path.isfile(path):
        raise ValueError(f"MODEL must be an existing .keras file. Received: MODEL={path!r}")
    # Keras reports a truncated zip as "File not found": name the damage instead.
    damaged = None
    if not zipfile.is_zipfile(path):
        damaged = "not a complete zip archive: truncated or corrupted"
    else:
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                damaged = f"member {bad!r} fails its CRC check: corrupted"
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            damaged = f"unreadable zip archive ({e})"
    if damaged:
        raise ValueError(f"MODEL is not a readable .keras file ({damaged}). Received: MODEL={path!r}")
    try:
        return keras.saving.load_model(path)
    except Exception as e:  # a corrupt zip, an unknown class, a refused lambda, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"MODEL could not be loaded as a Keras model ({reason}). Received: MODEL={path!r}") from e


def _read_manifest(path, missing_ok=False):
    """The parsed ``manifest.json``; ValueError naming it when it is unreadable."""
    if missing_ok and not os.path.exists(path):
        return {"models": {}}
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("models", {}), dict):
            raise ValueError("not a manifest object")
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{_MANIFEST} is unreadable ({type(e).__name__}: {reason}). Received: path={path!r}") from e
    return manifest


def _update_manifest(out, name, entry):
    """Replaces `name`'s entry of ``out/manifest.json`` in one atomic rename (other names kept)."""

    path = os.path.join(out, _MANIFEST)
    with _atomic.staging_dir(out) as tmp:
        with _atomic.locked_dir(out):  # exports of other names into `out` may run at the same time
            manifest = _read_manifest(path, missing_ok=True)
            manifest.setdefault("models", {})[name] = entry
            staged = os.path.join(tmp, _MANIFEST)
            with open(staged, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
            _atomic.publish(staged, path)


def _cmd_export(args):
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out must be a directory. Received: --out={out!r} (a file)")
    name = args.name or re.sub(r"[^A-Za-z0-9_-]", "_", os.path.splitext(os.path.basename(args.model))[0])
    check_name(name)  # the default (the file stem) too: "keras.keras" would be the folder keras/
    if "onnx" in args.format:
        _check_opset(args.opset)
    if "saved_model" in args.format and not args.no_warmup:
        _check_warmup_writer()  # before anything is loaded or written
    manifest = _read_manifest(os.path.join(out, _MANIFEST), missing_ok=True)  # a damaged manifest stops here
    _check_onnx_names(name, manifest.get("models", {}))
    steps = 1 + len(args.format)
    t0 = time.perf_counter()
    _log(f"[1/{steps}] loading {args.model}")
    model = _load_model(args.model)
    # The folders this export creates; a failed export removes those it left empty.
    folders = (out, os.path.join(out, name), os.path.join(out, "onnx"), os.path.join(out, "keras"))
    created = [folder for folder in folders if not os.path.exists(folder)]
    done = {"version_dir": None, "manifest": False}
    try:
        return _export(args, model, out, name, steps, t0, done)
    except BaseException:
        if done["version_dir"] and not done["manifest"]:
            # The SavedModel version this export published, which no manifest records: TF Serving would
            # serve it (the highest version) while `verify` checks the previous one.
            shutil.rmtree(done["version_dir"], ignore_errors=True)
        if out in created and not os.path.exists(os.path.join(out, _MANIFEST)):
            # A folder this export created, where no export finished: what it holds (a SavedModel
            # version published before the ONNX step failed) is no export `verify` could check.
            shutil.rmtree(out, ignore_errors=True)
        for folder in reversed(created):  # the deepest first; a folder something was written to stays
            try:
                os.rmdir(folder)
            except OSError:
                pass
        raise


def _check_opset(opset):
    """An opset the ONNX converter cannot write stops `export` before anything is loaded or written."""
    try:
        from tf2onnx import schemas
    except ImportError:  # the conversion names the missing package
        return
    highest = schemas.get_max_supported_opset_version()
    if not 1 <= opset <= highest:
        raise ValueError(
            f"--opset must be an ONNX opset the converter supports (1 to {highest} with this tf2onnx and onnx). "
            f"Received: --opset={opset}"
        )


def _check_onnx_names(name, models):
    """Refuses a name whose ONNX files would be another model's (``a_step`` beside ``a``: ``onnx/a_step.onnx``)."""
    mine = {name, f"{name}_step", f"{name}_generate"}
    for other in sorted(models):
        if other != name and mine & {other, f"{other}_step", f"{other}_generate"}:
            raise ValueError(
                f"--name {name!r} would share an ONNX file with model {other!r} in onnx/ (a model's graphs are "
                f"<name>.onnx, <name>_step.onnx and <name>_generate.onnx): choose another name. "
                f"Received: --name={name!r}"
            )


def _remove_stale(out, name, old_entry, entry):
    """Removes what `name`'s previous export published in a format this export does not write.

    A ``--format onnx`` export after a SavedModel one would otherwise leave the old model's
    versions in ``<out>/<name>/``, which TF Serving serves; a ``--format saved_model`` (or
    ``--no-generate``) export, the old model's ONNX graphs. Only files the previous manifest
    entry records (inside ``<out>``) are removed, and the SavedModel folder of this name.
    """

    base = os.path.join(out, name)
    if "saved_model" not in entry and os.path.isdir(base):
        with _atomic.staging_dir(out) as tmp:  # one rename takes every version away at once
            os.rename(base, os.path.join(tmp, "stale"))
    if not isinstance(old_entry, dict):
        return
    kept = {rel.replace(os.sep, "/") for rel in list(entry.get("files", {})) + list(entry.get("onnx", {}).values())}
    recorded = list(old_entry.get("files", {})) + list(old_entry.get("onnx", {}).values())
    root = os.path.realpath(out)
    for rel in recorded:
        path = os.path.realpath(os.path.join(out, str(rel)))
        if str(rel).replace(os.sep, "/") in kept or os.path.commonpath([root, path]) != root:
            continue
        if os.path.isfile(path):
            os.remove(path)


def _check_warmup_writer():
    """A missing tensorflow-serving-api stops `export` before it starts, naming --no-warmup."""
    from keras_linattn.export import warmup

    try:
        warmup._serving_apis()
    except Exception as e:  # ImportError, or protos that do not load with this protobuf
        reason = " ".join(str(e.__cause__ or e).split()) or type(e).__name__
        raise CommandError(
            "writing TF Serving warmup requests needs the tensorflow-serving-api package "
            f"({reason}): pip install tensorflow-serving-api, or pass --no-warmup to export without them"
        ) from e


def _export(args, model, out, name, steps, t0, done):
    """The writing half of `export`, once the model is loaded.

    `done` records what was published (``version_dir``) and whether the manifest was (``manifest``).
    """

    os.makedirs(out, exist_ok=True)
    entry = {"source": os.path.abspath(args.model), "keras_model": os.path.join("keras", f"{name}.keras"), "files": {}}
    rows = []
    step = 1
    if "saved_model" in args.format:
        step += 1
        t = time.perf_counter()
        _log(f"[{step}/{steps}] SavedModel -> {os.path.join(out, name)}/<version>")
        version_dir = export.export_saved_model(
            model,
            os.path.join(out, name),
            version=args.version,
            warmup=not args.no_warmup,
            include_generate=not args.no_generate,
            model_name=name,
            progress=lambda message: _log(f"      {message}"),
        )
        done["version_dir"] = version_dir
        description = export.read_description(version_dir)
        entry["saved_model"] = os.path.relpath(version_dir, out)
        entry["saved_model_export_id"] = description["export_id"]
        entry["signatures"] = description["signatures"]
        rows.append(
            (
                "saved_model",
                version_dir,
                ",".join(description["signatures"]),
                _human(_size(version_dir)),
                f"{time.perf_counter() - t:.1f}",
            )
        )
        _log(f"      done in {time.perf_counter() - t:.1f} s")
    if "onnx" in args.format:
        step += 1
        t = time.perf_counter()
        onnx_path = os.path.join(out, "onnx", f"{name}.onnx")
        _log(f"[{step}/{steps}] ONNX (opset {args.opset}) -> {onnx_path}")
        # A new export into the same directory is a new SavedModel version and replaces the ONNX set.
        paths = export.export_onnx(
            model,
            onnx_path,
            opset=args.opset,
            include_step=not args.no_generate,
            overwrite=True,
            progress=lambda message: _log(f"      {message}"),
        )
        for data_path in paths.pop("data", []):  # external weights, shared by the graphs
            entry["files"][os.path.relpath(data_path, out).replace(os.sep, "/")] = _atomic.file_digest(data_path)
        entry["onnx"] = {k: os.path.relpath(v, out) for k, v in paths.items()}
        entry["onnx_export_id"] = export.onnx_export._read_metadata(paths["model"])["export_id"]
        entry["opset"] = args.opset
        for kind, path in paths.items():
            entry["files"][os.path.relpath(path, out).replace(os.sep, "/")] = _atomic.file_digest(path)
            rows.append(
                (
                    f"onnx:{kind}",
                    path,
                    "",
                    _human(_size(path)),
                    f"{time.perf_counter() - t:.1f}" if kind == "model" else "",
                )
            )
        _log(f"      done in {time.perf_counter() - t:.1f} s")
    os.makedirs(os.path.join(out, "keras"), exist_ok=True)
    _atomic.copy_atomic(args.model, os.path.join(out, entry["keras_model"]))
    _atomic.fault_point("cli:keras_copied")
    _remove_stale(out, name, _read_manifest(os.path.join(out, _MANIFEST), missing_ok=True)["models"].get(name), entry)
    _update_manifest(out, name, entry)  # last: the manifest is what `verify` trusts
    done["manifest"] = True
    _atomic.fault_point("cli:manifest_published")
    _log("")
    _log(_format_table(rows, ("format", "path", "signatures", "size", "seconds")))
    _log(f"\nexported in {time.perf_counter() - t0:.1f} s; check with: keras-linattn verify {out}")
    return 0


def _check_file(path, rel, entry, what):
    """The file exists and matches the size and sha256 the manifest recorded (when it did)."""

    if not os.path.isfile(path):
        raise ValueError(
            f"{what} {rel} is missing (a killed export, or deleted): export again. Received: path={path!r}"
        )
    expected = entry.get("files", {}).get(rel.replace(os.sep, "/"))
    if expected is not None:
        _atomic.check_digest(path, expected, what=f"{what} {rel}")


def _check_onnx(out_dir, entry):
    """(model path, step path) of an entry, after checking export ids, sizes, sha256 and the pair."""

    onnx = entry.get("onnx", {})
    if "model" not in onnx:
        return None, None
    expected_id = entry.get("onnx_export_id")
    paths = {}
    for kind, what in (("model", "ONNX model"), ("step", "ONNX step graph"), ("generate", "ONNX generate graph")):
        if kind not in onnx:
            continue
        rel = onnx[kind]
        path = os.path.join(out_dir, rel)
        try:
            _check_file(path, rel, entry, what)
        except ValueError as damaged:
            if not os.path.isfile(path):
                raise
            try:  # a complete file from an export that stopped before the manifest?
                found = onnx_export._read_metadata(path).get("export_id")
            except ValueError:
                raise damaged from None
            if expected_id and found != expected_id:
                raise ValueError(
                    f"{what} {rel} was written by an export that did not finish (export id {found}; "
                    f"{_MANIFEST} records {expected_id}): export again. Received: path={path!r}"
                ) from None
            raise
        paths[kind] = path
    onnx_export.check_pair(paths["model"], paths.get("step"))
    if expected_id and not entry.get("files"):  # manifests without digests: check the id alone
        found = onnx_export._read_metadata(paths["model"]).get("export_id")
        if found != expected_id:
            raise ValueError(
                f"ONNX model {onnx['model']} was written by an export that did not finish (export id {found}; "
                f"{_MANIFEST} records {expected_id}): export again. Received: path={paths['model']!r}"
            )
    return paths["model"], paths.get("step")


def _check_saved_model(out_dir, entry):
    if "saved_model" not in entry:
        return None
    path = os.path.join(out_dir, entry["saved_model"])
    if not os.path.isdir(path):
        raise ValueError(f"SavedModel version {entry['saved_model']} is missing. Received: path={path!r}")
    description = export.check_integrity(path)
    expected = entry.get("saved_model_export_id")
    if expected and description.get("export_id") != expected:
        raise ValueError(
            f"SavedModel version {entry['saved_model']} holds another export (export id "
            f"{description.get('export_id')}; {_MANIFEST} records {expected}). Received: path={path!r}"
        )
    return path


def _check_model_directories(out_dir, models):
    """Every folder of `out_dir` that TF Serving would serve holds what the manifest records.

    A folder with SavedModel versions (numbered folders) must be a name of
    the manifest with a SavedModel entry, and its highest version (the one
    TF Serving serves) the version the manifest records.

    Raises:
        ValueError: naming the folder, for the first one that breaks this.
    """
    from keras_linattn.export import saved_model

    for folder in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, folder)
        if folder in ("keras", "onnx") or _atomic.is_temporary(folder) or not os.path.isdir(path):
            continue
        versions = saved_model._existing_versions(path)
        if not versions:
            continue
        entry = models.get(folder)
        recorded = entry.get("saved_model") if isinstance(entry, dict) else None
        if recorded is None:
            what = "is not a model" if entry is None else "has no SavedModel"
            raise ValueError(
                f"{folder}/ holds SavedModel versions {versions} (TF Serving serves version {versions[-1]}), but "
                f"{folder!r} {what} in {_MANIFEST}: a failed or older export; remove the folder or export "
                f"that name again. Received: path={path!r}"
            )
        served = os.path.join(folder, str(versions[-1]))
        if os.path.normpath(recorded) != served:
            raise ValueError(
                f"TF Serving serves {served} (the highest version), but {_MANIFEST} records {recorded}: an export "
                f"that did not finish, or a version numbered below an older one; remove {served} or export "
                f"again. Received: path={path!r}"
            )


class _CheckStatus:
    """Where `verify` is while it runs, without printing its results twice (the table gives them once).

    Default: one line per check as it completes, naming the check (its
    result is in the table). ``--verbose``: every check's full line.
    ``--quiet``: nothing until the table.
    """

    def __init__(self, verbose, quiet=False):
        self.verbose = verbose
        self.quiet = quiet and not verbose
        self.count = 0

    def show(self, line):
        self.count += 1
        if self.verbose:
            _log("  " + line)
        elif not self.quiet:
            _log(f"  check {self.count} done: {line.split(': ')[0].strip()}")


def _cmd_verify(args):
    manifest_path = os.path.join(args.dir, _MANIFEST)
    if not os.path.isfile(manifest_path):
        raise ValueError(
            f"DIR must be a directory written by `keras-linattn export` (no {_MANIFEST}). Received: DIR={args.dir!r}"
        )
    models = _read_manifest(manifest_path).get("models", {})
    names = [args.name] if args.name else sorted(models)
    unknown = [n for n in names if n not in models]
    if unknown or not names:
        raise ValueError(f"Unknown model name. Received: --name={args.name!r}. Exported: {sorted(models)}")
    _check_model_directories(args.dir, models)
    any_failed = any_unverified = False
    for name in names:
        entry = models[name]
        if not isinstance(entry, dict) or "keras_model" not in entry:
            raise ValueError(f"{_MANIFEST} has no valid entry for {name!r}. Received: path={manifest_path!r}")
        # Files first: a damaged or half-written export is named before anything runs.
        saved_model_dir = _check_saved_model(args.dir, entry)
        onnx_path, step_path = _check_onnx(args.dir, entry)
        generate_path = entry.get("onnx", {}).get("generate") if onnx_path else None
        generate_path = os.path.join(args.dir, generate_path) if generate_path else None
        model = _load_model(os.path.join(args.dir, entry["keras_model"]))
        _log(
            f"verifying {name!r}: saved_model={saved_model_dir}, onnx={onnx_path}, step={step_path}, "
            f"generate={generate_path}"
        )
        status = _CheckStatus(args.verbose, getattr(args, "quiet", False))
        try:
            report = export.verify(
                model,
                saved_model_dir=saved_model_dir,
                onnx_path=onnx_path,
                onnx_step_path=step_path,
                onnx_generate_path=generate_path,
                shapes=args.shapes,
                decode_steps=args.decode_steps,
                saved_model_tolerance=args.saved_model_tolerance,
                onnx_tolerance=args.onnx_tolerance,
                raise_on_failure=False,
                onnx_device=args.device,
                progress=status.show,
            )
        except (RuntimeError, OSError) as e:  # a runtime refusing a graph that passed the checks above
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{name!r} could not be run ({type(e).__name__}: {reason}). Received: DIR={args.dir!r}"
            ) from e
        _log("")
        _log(report.table())
        passed = sum(r.ok for r in report.rows)
        unverified = f", {len(report.unverified)} not verified" if report.unverified else ""
        _log(f"\n{name}: {passed}/{len(report.rows)} checks passed{unverified}\n")
        any_failed = any_failed or bool(report.failed)
        any_unverified = any_unverified or bool(report.unverified)
    # 1: an artifact differs from Keras; 3: nothing differs, but a check could compare no row
    # (every row too ill-conditioned for float32); 2 (in `main`): damaged files or bad arguments.
    return 1 if any_failed else (3 if any_unverified else 0)


def run(args):
    """Runs the command parsed by `build_parser`; returns the exit status (errors raise)."""
    return {"export": _cmd_export, "verify": _cmd_verify}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
