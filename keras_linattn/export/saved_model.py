"""SavedModel export in the TF Serving layout ``base_dir/<version>/``."""

import json
import os
import uuid

import keras

from keras_linattn import _atomic, _compat
from keras_linattn.export import _float_compute, _specs
from keras_linattn.export import warmup as warmup_lib

__all__ = ["check_integrity", "export_saved_model", "latest_version_dir", "read_description"]

_DESCRIPTION_FILE = "keras_linattn.json"
# The description file lists every other file of the version with its size and sha256.
_DESCRIPTION_PATH = "assets.extra/" + _DESCRIPTION_FILE


def _check_base_dir(base_dir):
    base_dir = os.fspath(base_dir)
    if os.path.exists(base_dir) and not os.path.isdir(base_dir):
        raise ValueError(
            "`base_dir` must be a directory (the model's base path for TF Serving); a file "
            f"exists at that path. Received: base_dir={base_dir!r}"
        )
    return base_dir


def _existing_versions(base_dir):
    """Sorted integer versions present in `base_dir` (what TF Serving would load).

    Staging directories of exports in progress or killed (``.tmp-*``) are
    never versions.
    """
    if not os.path.isdir(base_dir):
        return []
    return sorted(
        int(d) for d in os.listdir(base_dir) if d.isdigit() and d.isascii() and os.path.isdir(os.path.join(base_dir, d))
    )


def _resolve_version(base_dir, version):
    if version is None:
        versions = _existing_versions(base_dir)
        return (versions[-1] + 1) if versions else 1
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(
            f"`version` must be a non-negative integer (TF Serving version). Received: version={version!r}"
        )
    if os.path.exists(os.path.join(base_dir, str(version))):
        raise ValueError(
            f"Version {version} already exists in {base_dir!r}; TF Serving versions are "
            "immutable. Pass another `version` or leave it as None for the next one. "
            f"Received: version={version!r}"
        )
    return version


def _track(archive, model):
    """Tracks a model's layers (for lookup tables and variable lists).

    A subclassed model is not tracked itself: on write-out TF traces every
    `tf.function` attribute of a tracked object, including Keras' default
    save signature, which assumes a single float input of the model's build
    shape (wrong for a token-id model built with `build(None)`). Its layers
    are tracked instead; endpoint variables are collected in any case.
    """
    if _compat.is_functional(model):
        archive.track(model)
        return
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            _track(archive, layer)
        elif layer.built:
            archive.track(layer)


def _build_archive(specs, include_generate=True):
    """A `keras.export.ExportArchive` with every signature of the model."""
    archive = keras.export.ExportArchive()
    _track(archive, specs.model)
    archive.add_endpoint(_specs.SERVING_DEFAULT, specs.serving_fn(), input_signature=specs.input_specs)
    if specs.causal_lm:
        archive.add_endpoint(_specs.STEP, specs.step_fn(), input_signature=specs.step_signature())
        if include_generate:
            for name, sampled in ((_specs.GENERATE, False), (_specs.GENERATE_SAMPLED, True)):
                archive.add_endpoint(
                    name, specs.generate_fn(sampled), input_signature=specs.generate_signature(sampled)
                )
    return archive


def _one_copy_of_each_variable(archive):
    """Makes the archive's variable lists hold TensorFlow's variables, not Keras' wrappers.

    `ExportArchive.track` lists the Keras variables (``variables``,
    ``trainable_variables``, ``non_trainable_variables`` of the saved
    object), and the write-out lists the `tf.Variable` each endpoint reads
    (``_all_variables``). A Keras variable is a checkpointable object of its
    own that saves its `tf.Variable`'s value, so every weight was written
    twice (GPT-2 base: 1.03 GB of variables for 0.50 GB of weights). Listing
    the `tf.Variable` itself (``keras.Variable.value`` on TensorFlow) saves
    each weight once; a reloaded SavedModel's ``variables`` are the same
    `tf.Variable` objects as before.
    """
    import tensorflow as tf

    if keras.backend.backend() != "tensorflow":
        return
    trackable = _compat.export_archive_trackable(archive)
    for attr in ("variables", "trainable_variables", "non_trainable_variables"):
        listed = getattr(trackable, attr, None)
        if listed is None:
            continue
        unwrapped = [
            v.value if isinstance(v, keras.Variable) and isinstance(v.value, tf.Variable) else v for v in listed
        ]
        setattr(trackable, attr, unwrapped)


def _write_out(archive, export_dir, verbose=False):
    """``archive.write_out(export_dir)``, with each endpoint traced once instead of twice.

    `ExportArchive.write_out` first lists the variables each endpoint uses
    (tracing it), then calls `tf.saved_model.save`, which traces it again: a
    function traced inside a save context is cached apart from one traced
    outside (the context's variable policy is part of TensorFlow's cache
    key). Listing the variables inside the same kind of save context lets
    the save reuse that trace (the limited test LM: 3.55 -> 2.43 s an
    export; same graphs). On another backend, or while a save is in
    progress, it writes out as is. The internals it uses are
    `keras_linattn._compat`'s (an error where they are missing).
    """
    import tensorflow as tf

    options = tf.saved_model.SaveOptions()
    _one_copy_of_each_variable(archive)
    if keras.backend.backend() == "tensorflow" and not _compat.in_tf_save_context():
        _compat.track_export_resources_once(archive, options)
    archive.write_out(export_dir, options=options, verbose=verbose)


def export_saved_model(
    model,
    base_dir,
    version=None,
    input_signature=None,
    include_generate=True,
    warmup=True,
    warmup_batch_size=1,
    warmup_length=16,
    model_name=None,
    verbose=False,
    progress=None,
):
    """Exports a Keras model as a SavedModel for TF Serving.

    Writes ``base_dir/<version>/`` with the signatures:

    - ``serving_default``: the model's call in inference mode; named inputs
      (the model's input names, ``token_ids`` for causal LMs) with dynamic
      batch and length dims, named outputs (``logits`` for causal LMs).
    - causal LMs (`keras_linattn.models.LinearCausalLM` or any model with
      ``step``/``call_with_state``/``get_initial_state``/``generate``):
      ``step`` (``token_t [B]`` + ``state_<i>`` -> ``logits [B, V]`` +
      ``new_state_<i>``: every layer's ``(S, z)`` explicit in and out),
      ``generate`` (greedy: ``prompt_ids [B, P]``, ``max_length []`` ->
      ``output_ids [B, max_length]``) and ``generate_sampled`` (adds
      ``temperature []`` and ``seed []``: same seed, same tokens).

    ``assets.extra/tf_serving_warmup_requests`` holds `PredictionLog`
    records for each signature (TF Serving replays them at load time), and
    ``assets.extra/keras_linattn.json`` describes inputs, outputs and state,
    and lists every other file of the version with its size and sha256
    (`check_integrity` compares them).

    Atomic: the version is written in full to a staging directory
    ``base_dir/.tmp-*`` (never a version: TF Serving only loads integer
    names), flushed, and renamed to ``base_dir/<version>`` in one step. A
    process killed at any moment leaves the versions that were there and,
    possibly, one complete new version; never a partial one. Staging
    directories of killed exports are removed by the next export into
    `base_dir`. Without `version`, the number is taken at the rename (one
    more than the largest present, under a lock on `base_dir`), so
    re-running, or exporting from two processes at once, gives the next
    numbers.

    Args:
        model: a built `keras.Model`.
        base_dir: the model's base path (holds the integer version dirs).
        version: integer version; default: one more than the largest present.
            An existing version is an error.
        input_signature: optional list of named `tf.TensorSpec` for
            subclassed models whose inputs cannot be read from the model.
        include_generate: whether causal LMs get the ``generate`` signatures.
        warmup: whether to write the warmup requests.
        warmup_batch_size, warmup_length: shape of the warmup requests.
        model_name: name written into the warmup requests' `model_spec`
            (defaults to the base dir's name).
        verbose: print the archive's variables.
        progress: optional ``callable(str)`` called before each long step
            (tracing and writing the signatures, the warmup requests); the
            CLI prints these lines.

    Returns:
        The path of the version directory.
    """
    _specs.require_tensorflow_backend()
    base_dir = _check_base_dir(base_dir)
    specs = _specs.ModelSpecs(model, input_signature=input_signature)
    if version is not None:
        _resolve_version(base_dir, version)  # fail early on a bad or taken version
    model_name = model_name or os.path.basename(os.path.normpath(os.path.abspath(base_dir)))
    say = progress or (lambda message: None)
    created_base = not os.path.exists(base_dir)
    try:
        with _atomic.staging_dir(base_dir) as tmp_dir:  # also removes what killed exports left
            export_dir = os.path.join(tmp_dir, "export")
            say(f"tracing and writing the signatures ({', '.join(_signature_names(specs, include_generate))})")
            with _float_compute.float32_compute(model):  # 16-bit weights, float32 computation
                archive = _build_archive(specs, include_generate=include_generate)
                _write_out(archive, export_dir, verbose=verbose)
            _atomic.fault_point("saved_model:written")
            extra = os.path.join(export_dir, "assets.extra")
            os.makedirs(extra, exist_ok=True)
            if warmup:
                say(f"writing TF Serving warmup requests ({warmup_lib._WARMUP_FILE})")
                warmup_lib.write_warmup_requests(
                    os.path.join(extra, warmup_lib._WARMUP_FILE),
                    specs,
                    model_name=model_name,
                    batch_size=warmup_batch_size,
                    length=warmup_length,
                    include_generate=include_generate,
                )
            _atomic.fault_point("saved_model:warmup_written")
            description = specs.describe()
            description["signatures"] = _signature_names(specs, include_generate)
            description["export_id"] = uuid.uuid4().hex
            description["files"] = _atomic.tree_digests(export_dir, exclude={_DESCRIPTION_PATH})
            with open(os.path.join(extra, _DESCRIPTION_FILE), "w") as f:
                json.dump(description, f, indent=2)
            _atomic.fault_point("saved_model:staged")
            _atomic.fsync_tree(export_dir)
            # The version is taken under the directory lock, at the moment of the rename:
            # concurrent exports into one base_dir get distinct versions.
            with _atomic.locked_dir(base_dir):
                version = _resolve_version(base_dir, version)
                final = os.path.join(base_dir, str(version))
                os.rename(export_dir, final)
            _atomic.fsync_dir(base_dir)
            _atomic.fault_point("saved_model:published")
    except BaseException:
        if created_base:
            try:
                os.rmdir(base_dir)  # only if nothing else was written there meanwhile
            except OSError:
                pass
        raise
    return final


def _signature_names(specs, include_generate=True):
    names = [_specs.SERVING_DEFAULT]
    if specs.causal_lm:
        names.append(_specs.STEP)
        if include_generate:
            names += [_specs.GENERATE, _specs.GENERATE_SAMPLED]
    return names


def check_integrity(export_dir):
    """Checks every file of an exported version against the sizes and sha256 recorded at export.

    Versions written before the digests were recorded are only checked for
    a readable description.

    Raises:
        ValueError: naming the first missing, truncated or altered file.
    """
    description = read_description(export_dir)
    for rel, expected in sorted(description.get("files", {}).items()):
        path = os.path.join(export_dir, *rel.split("/"))
        _atomic.check_digest(path, expected, what=f"SavedModel file {rel}")
    return description


def read_description(export_dir):
    """The JSON description written by `export_saved_model`."""
    path = os.path.join(export_dir, "assets.extra", _DESCRIPTION_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"`export_dir` has no readable assets.extra/{_DESCRIPTION_FILE} (missing, truncated, or not "
            f"written by `export_saved_model`): {e}. Received: export_dir={export_dir!r}"
        ) from e


def latest_version_dir(base_dir):
    """``base_dir/<largest version>``, or `base_dir` itself if it is a SavedModel."""
    if os.path.exists(os.path.join(base_dir, "saved_model.pb")):
        return base_dir
    versions = _existing_versions(base_dir)
    if not versions:
        raise ValueError(f"No SavedModel version found. Received: base_dir={base_dir!r}")
    return os.path.join(base_dir, str(versions[-1]))
