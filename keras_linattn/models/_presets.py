"""Digests and checks for the presets of `LinearBackbone` / `LinearCausalLM` / `LinearCausalLMPreprocessor`.

keras-hub's presets carry no checksum and its loader trusts what it finds:
a sharded save over an unsharded one leaves the old ``model.weights.h5``,
which the loader prefers; a flipped weight bit or an edited ``config.json``
loads silently. Here:

- every save (`saving`) writes into a staging copy beside the preset, from
  which the weight files an earlier save left (``model.weights.h5``,
  ``model.weights.json``, ``model_*.weights.h5``, ``task.weights.h5``) are
  left out, writes ``linattn_manifest.json`` there last (the sha256 and
  size of every preset file: the top-level ``.json`` / ``.h5`` files and
  everything under ``assets/``), then replaces the preset in one rename: a
  killed save leaves the previous preset whole;
- every load from a local directory (`verify`) checks those digests and
  refuses, naming the file, one that changed, is missing, is truncated, or
  a weight file the manifest does not list. A preset without a manifest
  (saved before this check existed, or written by keras-hub's own saver)
  loads with a warning, unless it is partial (no ``config.json``, no
  weights file, or one that cannot be read): that is refused as partial.
- `check_weights_consumed` makes a weights load into a model with fewer
  layers than the file loud (Keras ignores the file's extra entries).
- `check_tokenizer_fits` refuses a tokenizer with more ids than the
  embedding has rows.
"""

import contextlib
import contextvars
import json
import os
import shutil
import warnings

from keras_linattn import _atomic, _compat

__all__ = []

MANIFEST_FILE = "linattn_manifest.json"
_FORMAT = 1
_WEIGHT_SUFFIXES = (".weights.h5", ".weights.json")

_saving = contextvars.ContextVar("keras_linattn_preset_saving", default=False)
_verified = contextvars.ContextVar("keras_linattn_preset_verified", default=None)


def _is_local_dir(preset):
    return isinstance(preset, (str, os.PathLike)) and os.path.isdir(preset)


def _is_weights(relative):
    return relative.endswith(_WEIGHT_SUFFIXES)


def _preset_files(preset_dir):
    """Relative paths (``/``-separated) of the files a preset consists of, sorted."""
    out = []
    for name in os.listdir(preset_dir):
        if name != MANIFEST_FILE and name.endswith((".json", ".h5")) and os.path.isfile(os.path.join(preset_dir, name)):
            out.append(name)
    assets = os.path.join(preset_dir, "assets")
    for root, _, files in os.walk(assets):
        for name in files:
            out.append(os.path.relpath(os.path.join(root, name), preset_dir).replace(os.sep, "/"))
    return sorted(out)


def write_manifest(preset_dir):
    """Writes ``linattn_manifest.json``: sha256 and size of every preset file now in `preset_dir`."""
    files = {}
    for relative in _preset_files(preset_dir):
        path = os.path.join(preset_dir, relative)
        files[relative] = {"sha256": _atomic.file_sha256(path), "size": os.path.getsize(path)}
    with open(os.path.join(preset_dir, MANIFEST_FILE), "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=2, sort_keys=True)


def _seed(preset_dir, target, clean):
    """Fills the staging copy `target` with what `preset_dir` holds now, less what a save replaces.

    Files the save does not write stay (a preprocessor saved beside a
    model's files keeps them). With `clean`, the weight files of an earlier
    save and the manifest are left out; without, the weight files (which a
    preprocessor's save never writes) are hard links where possible.
    """
    if not os.path.exists(preset_dir):
        os.makedirs(target)
        return
    if not os.path.isdir(preset_dir):
        raise ValueError(f"`preset_dir` must be a directory, not a file. Received: preset_dir={str(preset_dir)!r}")

    def ignore(directory, names):
        if os.path.abspath(directory) != os.path.abspath(preset_dir):
            return []
        return [n for n in names if n == MANIFEST_FILE or (clean and _is_stale_weights(n))]

    def copy(src, dst):
        if not clean and _is_weights(os.path.basename(src)):
            try:
                return os.link(src, dst)
            except OSError:
                pass
        return shutil.copy2(src, dst)

    shutil.copytree(preset_dir, target, ignore=ignore, copy_function=copy)


def _is_stale_weights(name):
    return name in ("model.weights.h5", "model.weights.json", "task.weights.h5") or (
        name.startswith("model_") and name.endswith(".weights.h5")
    )


@contextlib.contextmanager
def saving(preset_dir, clean=True):
    """Around a `save_to_preset`: yields the directory to save into, a staging copy published whole.

    The save writes into ``<parent>/.tmp-<random>/<name>`` (seeded with the
    files of the existing preset that the save does not replace; stale
    weight files left out with `clean`), the manifest is written there last,
    and the directory then replaces `preset_dir` in one rename
    (`keras_linattn._atomic.replace_dir`). A save killed or failing at any
    point leaves the previous preset whole; its staging directory is removed
    by the next save into the same parent.

    Nested saves (a task saves its backbone and preprocessor) run inside the
    outermost one, into its staging directory.
    """
    if _saving.get():
        yield preset_dir
        return
    token = _saving.set(True)
    try:
        preset_dir = os.fspath(preset_dir)
        parent = os.path.dirname(os.path.abspath(preset_dir))
        with _atomic.staging_dir(parent) as tmp:
            target = os.path.join(tmp, os.path.basename(os.path.abspath(preset_dir)))
            _seed(preset_dir, target, clean)
            yield target
            _atomic.fault_point("preset:staged")
            write_manifest(target)
            _atomic.fault_point("preset:manifest_written")
            _atomic.replace_dir(target, preset_dir)
            _atomic.fault_point("preset:published")
    finally:
        _saving.reset(token)


def _partial(preset_dir, weights):
    """Why a preset without a manifest looks like an unfinished save or copy (None when it does not)."""
    if not weights:
        return None
    if not os.path.isfile(os.path.join(preset_dir, "config.json")):
        return "config.json is missing"
    files = [r for r in _preset_files(preset_dir) if _is_weights(r)]
    if not files:
        return "it has no weights file (model.weights.h5)"
    for relative in files:
        try:
            _stored_groups(os.path.join(preset_dir, relative))
        except Exception as e:  # h5py: "truncated file", "bad object header", ...; json: a cut file
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"{relative} cannot be read ({type(e).__name__}: {reason})"
    return None


def verify(preset, weights=True):
    """Checks a local preset directory against its manifest (see the module docstring).

    Args:
        preset: the `from_preset` argument; only local directories are
            checked (a Kaggle / Hugging Face handle is not).
        weights: also hash the weight files (False: configs and assets only).

    Raises:
        ValueError: naming the file that changed, is missing, or is a weight
            file the manifest does not list.
    """
    if not _is_local_dir(preset):
        return
    preset_dir = os.path.realpath(preset)
    if _verified.get() == preset_dir:
        return
    manifest_path = os.path.join(preset_dir, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        reason = _partial(preset_dir, weights)
        if reason is not None:
            raise ValueError(
                f"Preset {str(preset)!r} is partial: {reason}, and it has no {MANIFEST_FILE} (which a complete "
                "`save_to_preset` writes last): a save killed before it finished (saves before keras_linattn "
                "wrote presets atomically) or an interrupted copy. Save the preset again from the model, or copy "
                f"it again. Received: preset={str(preset)!r}"
            )
        warnings.warn(
            f"Preset {str(preset)!r} has no {MANIFEST_FILE} (saved before keras_linattn wrote digests, or by "
            "keras-hub's own saver): its files load unverified. Save it again with `save_to_preset` to add one.",
            stacklevel=3,
        )
        return
    try:
        with open(manifest_path) as f:
            listed = json.load(f)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"The preset's {MANIFEST_FILE} cannot be read ({e}). Received: preset={str(preset)!r}") from e
    for relative, entry in sorted(listed.items()):
        if _is_weights(relative) and not weights:
            continue
        path = os.path.join(preset_dir, relative)
        if not os.path.isfile(path):
            raise ValueError(
                f"Preset file {relative!r} listed in {MANIFEST_FILE} is missing. Received: preset={str(preset)!r}"
            )
        size = os.path.getsize(path)
        digest = _atomic.file_sha256(path) if size == entry["size"] else None
        if digest != entry["sha256"]:
            raise ValueError(
                f"Preset file {relative!r} changed since it was saved: its sha256 or size differs from "
                f"{MANIFEST_FILE} ({entry['size']} bytes, sha256 {entry['sha256'][:16]}... at save; now {size} "
                f"bytes). Restore it or save the preset again. Received: preset={str(preset)!r}"
            )
    stray = [r for r in _preset_files(preset_dir) if _is_weights(r) and r not in listed]
    if stray:
        raise ValueError(
            f"Preset weight files {stray} are not listed in {MANIFEST_FILE}: they were not written by the save "
            "that wrote the manifest (keras-hub's loader may prefer them). Remove them or save the preset again. "
            f"Received: preset={str(preset)!r}"
        )


@contextlib.contextmanager
def loading(preset, weights=True):
    """Around a `from_preset`: the preset verified once, up front; the loader's own hooks then skip it."""
    verify(preset, weights=weights)
    if not _is_local_dir(preset):
        yield
        return
    token = _verified.set(os.path.realpath(preset))
    try:
        yield
    finally:
        _verified.reset(token)


def verify_weights_path(filepath):
    """Before ``load_weights(filepath)``: a preset's weight file is checked with its whole preset."""
    if not isinstance(filepath, (str, os.PathLike)):
        return
    filepath = os.fspath(filepath)
    directory = os.path.dirname(filepath) or "."
    if os.path.basename(filepath) in ("model.weights.h5", "model.weights.json") and os.path.isfile(
        os.path.join(directory, "config.json")
    ):
        verify(directory, weights=True)


def _stored_groups(filepath):
    """Number of layers with variables a Keras weights file holds (``.weights.h5`` or sharded ``.weights.json``)."""
    if filepath.endswith(".weights.json"):
        with open(filepath) as f:
            return len(json.load(f)["weight_map"])
    import h5py

    groups = set()

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and "/vars/" in f"/{name}":
            groups.add(name.rsplit("/vars/", 1)[0])

    with h5py.File(filepath, "r") as f:
        f.visititems(visit)
    return len(groups)


def check_weights_consumed(model, filepath):
    """After ``load_weights``: refuses a file with more layers' weights than the model has (Keras skips them)."""
    if not isinstance(filepath, (str, os.PathLike)):
        return
    filepath = os.fspath(filepath)
    if not filepath.endswith(_WEIGHT_SUFFIXES) or not os.path.isfile(filepath):
        return
    owners = [layer for layer in _compat.flatten_layers(model, include_self=True) if _compat.own_variables(layer)]
    stored = _stored_groups(filepath)
    if stored > len(owners):
        raise ValueError(
            f"The weights file holds the weights of {stored} layers, the model has {len(owners)} layers with "
            "weights: it was saved from a larger model (e.g. more `num_layers`), and the rest would be dropped "
            f"silently. Build the model with the configuration it was saved with. Received: filepath={filepath!r}"
        )


def check_tokenizer_fits(preprocessor, backbone):
    """Refuses a preprocessor whose tokenizer has more ids than the backbone's embedding has rows."""
    tokenizer = getattr(preprocessor, "tokenizer", None)
    if tokenizer is None or backbone is None:
        return
    try:
        size = tokenizer.vocabulary_size()
    except (ValueError, AttributeError, TypeError):  # no vocabulary yet (a preset's assets load later)
        return
    if size is None:
        return
    rows = backbone.vocabulary_size
    if int(size) > int(rows):
        raise ValueError(
            f"The tokenizer has {size} ids but the model's embedding has {rows} rows (vocabulary_size={rows}): "
            "ids past the table would be read out of range. Use the tokenizer the model was trained with, or a "
            f"model with vocabulary_size >= {size}. Received: tokenizer vocabulary_size={size}"
        )
