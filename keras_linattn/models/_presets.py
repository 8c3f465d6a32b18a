"""Digests and checks for the presets of `LinearBackbone` / `LinearCausalLM` / `LinearCausalLMPreprocessor`.

keras-hub's presets carry no checksum and its loader trusts what it finds:
a sharded save over an unsharded one leaves the old ``model.weights.h5``,
which the loader prefers; a flipped weight bit or an edited ``config.json``
loads silently. Here:

- every save (`saving`) first removes the weight files an earlier save left
  (``model.weights.h5``, ``model.weights.json``, ``model_*.weights.h5``,
  ``task.weights.h5``), then writes ``linattn_manifest.json``: the sha256 and
  size of every preset file (the top-level ``.json`` / ``.h5`` files and
  everything under ``assets/``);
- every load from a local directory (`verify`) checks those digests and
  refuses, naming the file, one that changed, is missing, or a weight file
  the manifest does not list. A preset without a manifest (saved before this
  check existed, or written by keras-hub's own saver) loads with a warning.
- `check_weights_consumed` makes a weights load into a model with fewer
  layers than the file loud (Keras ignores the file's extra entries).
- `check_tokenizer_fits` refuses a tokenizer with more ids than the
  embedding has rows.
"""

import contextlib
import contextvars
import glob
import hashlib
import json
import os
import warnings

from keras_linattn import _compat

__all__ = []

MANIFEST_FILE = "linattn_manifest.json"
_FORMAT = 1
_WEIGHT_SUFFIXES = (".weights.h5", ".weights.json")
_CHUNK = 1 << 24

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


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_stale_weights(preset_dir):
    stale = [os.path.join(preset_dir, name) for name in ("model.weights.h5", "model.weights.json", "task.weights.h5")]
    stale += glob.glob(os.path.join(preset_dir, "model_*.weights.h5"))
    stale.append(os.path.join(preset_dir, MANIFEST_FILE))
    for path in stale:
        if os.path.isfile(path):
            os.remove(path)


def write_manifest(preset_dir):
    """Writes ``linattn_manifest.json``: sha256 and size of every preset file now in `preset_dir`."""
    files = {}
    for relative in _preset_files(preset_dir):
        path = os.path.join(preset_dir, relative)
        files[relative] = {"sha256": _sha256(path), "size": os.path.getsize(path)}
    with open(os.path.join(preset_dir, MANIFEST_FILE), "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=2, sort_keys=True)


@contextlib.contextmanager
def saving(preset_dir, clean=True):
    """Around a `save_to_preset`: stale weight files removed first (`clean`), the manifest written last.

    Nested saves (a task saves its backbone and preprocessor) run inside the
    outermost one, which alone cleans and writes the manifest.
    """
    if _saving.get():
        yield
        return
    token = _saving.set(True)
    try:
        if clean and os.path.isdir(preset_dir):
            _remove_stale_weights(preset_dir)
        yield
        write_manifest(preset_dir)
    finally:
        _saving.reset(token)


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
        digest = _sha256(path) if size == entry["size"] else None
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
