"""Exports built once per pytest run and shared by every test file that only reads them.

Exporting the tiny causal LM (SavedModel with its step/generate signatures, ONNX
model, step and generate graphs) takes 10-30 s on a quiet 2-core machine, and eight
test files read the same one: `keras-linattn export` of `tests.export.test_export.tiny_lm()`
(seed 0), the layout users get (the Python export API on a freshly built LM is
exercised by tests/export/test_verify.py, tests/export/test_generate_parity.py,
tests/contracts/test_front_end_rules.py and tests/export/test_mechanisms_export.py).

`shared_dir(name, build)` builds a directory once per pytest run, across
pytest-xdist workers: the first worker to ask builds it under a file lock in the
run's common temporary folder (the parent of each worker's `basetemp`); the
others wait for the lock, then reuse it. Outside pytest (a test module run with
`python -m`), a temporary folder removed at exit.

The directories are read only: a test that damages a file copies the directory first.

The models are not shared: each caller builds its own from the same seed
(`built_lm`) and checks that its weights equal, bit for bit, those of the model
saved and exported (an .npz written beside the .keras file), so a test can never
compare an export against a model other than the one exported.
"""

import atexit
import functools
import json
import os
import shutil
import tempfile

import keras
import numpy as np
from filelock import FileLock

# Set by tests/conftest.py (a session fixture) to the folder that every worker of the run shares.
BASE = None


@functools.lru_cache(maxsize=None)
def _fallback_base():
    base = tempfile.mkdtemp(prefix="kla-shared-exports-")
    atexit.register(shutil.rmtree, base, True)
    return base


def shared_dir(name, build):
    """The folder ``<base>/<name>``, filled by ``build(path)`` once per pytest run.

    ``build`` runs under the float32 policy; a folder left half built by a crashed
    run (no ``.done`` marker) is built again.
    """
    base = str(BASE) if BASE is not None else _fallback_base()
    path = os.path.join(base, name)
    done = os.path.join(path, ".done")
    with FileLock(path + ".lock"):
        if not os.path.exists(done):
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            policy = keras.config.dtype_policy()
            keras.config.set_dtype_policy("float32")
            try:
                build(path)
            finally:
                keras.config.set_dtype_policy(policy)
            open(done, "w").close()
    return path


def built_lm(seed=0):
    """`tests.export.test_export.tiny_lm(seed=seed)`, built, under the float32 policy."""
    from tests.export.test_export import tiny_lm

    keras.config.set_dtype_policy("float32")
    model = tiny_lm(seed=seed)
    model(np.zeros((1, 4), "int32"))
    return model


def _save_weights(model, path):
    np.savez(path, *[np.asarray(w) for w in model.weights])


def check_same_weights(model, path):
    """Asserts that ``model``'s weights are, bit for bit, those saved at ``path`` (an .npz)."""
    with np.load(path) as saved:
        expected = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    got = [np.asarray(w) for w in model.weights]
    assert len(got) == len(expected), f"{len(got)} weights, the export has {len(expected)}"
    for w, a, b in zip(model.weights, got, expected, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{w.path}: not the exported weights")


NAME = "lm"


def _build_lm_export(root):
    """`keras-linattn export lm0.keras --out exported --name lm`, beside the .keras files of seeds 0 and 1."""
    from keras_linattn import cli

    for seed in (0, 1):
        model = built_lm(seed)
        model.save(os.path.join(root, f"lm{seed}.keras"))
        _save_weights(model, os.path.join(root, f"lm{seed}.npz"))
    out = os.path.join(root, "exported")
    code = cli.main(["export", os.path.join(root, "lm0.keras"), "--out", out, "--name", NAME])
    assert code == 0


def lm_export_root():
    """The folder holding ``lm0.keras``, ``lm1.keras`` and ``exported/`` (built once per run)."""
    return shared_dir("tiny_lm_export", _build_lm_export)


def lm_export():
    """The tiny LM (`built_lm(0)`) as `keras-linattn export` writes it: ``(model, version_dir, onnx_paths)``.

    ``version_dir`` is the SavedModel (``exported/lm/1``: `export.export_saved_model`),
    ``onnx_paths`` the ONNX files as `export.export_onnx` names them ("model",
    "step", "generate": ``exported/onnx/lm*.onnx``). ``model`` is a fresh build of
    the same seed whose weights were checked against the exported model's.
    """
    root = lm_export_root()
    out = os.path.join(root, "exported")
    with open(os.path.join(out, "manifest.json")) as f:
        entry = json.load(f)["models"][NAME]
    model = built_lm(0)
    check_same_weights(model, os.path.join(root, "lm0.npz"))
    version_dir = os.path.join(out, entry["saved_model"])
    onnx_paths = {kind: os.path.join(out, rel) for kind, rel in entry["onnx"].items()}
    return model, version_dir, onnx_paths


# ------------------------------------------------------------ the limited LM
# One LM with a position limit (max_sequence_length), read by tests/contracts/test_front_end_rules.py
# (each request rule on every front end) and tests/export/test_verify.py (positions up to the limit,
# every graph, damaged weights). LIMIT is below the SavedModel's default warmup length (16), so the
# warmup requests must be clipped to it, and at least LIMIT - 2 = 13 (the longest of verify's old
# fixed shapes), so that row LIMIT - 2 of the position table is reached only by a full-length input.
LIMITED_VOCAB, LIMITED_HIDDEN, LIMITED_FFN, LIMIT = 24, 8, 16, 15


def built_limited_lm(feature_map="elu"):
    """A 1-layer `LinearCausalLM` with ``max_sequence_length=LIMIT``, seed 1234, under the float32 policy.

    The shared export (`limited_export`) is the default ``feature_map``; tests of other maps export
    their own with the same architecture.

    Weights are redrawn at scale 0.5 from a fixed generator: logits well apart, so that tokens can be
    compared exactly across runtimes (the default init gives near-ties that any rounding can flip).
    """
    from keras_linattn.models import LinearCausalLM

    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1234)
    lm = LinearCausalLM(
        vocabulary_size=LIMITED_VOCAB,
        num_layers=1,
        hidden_dim=LIMITED_HIDDEN,
        num_heads=2,
        intermediate_dim=LIMITED_FFN,
        chunk_size=4,
        max_sequence_length=LIMIT,
        feature_map=feature_map,
    )
    lm(np.zeros((1, 2), "int32"))
    rng = np.random.default_rng(7)
    for w in lm.trainable_weights:
        w.assign((rng.standard_normal(w.shape) * 0.5).astype(w.dtype))
    return lm


def _build_limited_export(root):
    """``limited.keras`` (+ .npz), ``exported/lm/1`` (`export_saved_model`, default warmup) and
    ``exported/onnx/lm.onnx`` with its step and generate graphs (`export_onnx`)."""
    from keras_linattn import export

    model = built_limited_lm()
    model.save(os.path.join(root, "limited.keras"))
    _save_weights(model, os.path.join(root, "limited.npz"))
    version_dir = export.export_saved_model(model, os.path.join(root, "exported", "lm"))
    paths = export.export_onnx(model, os.path.join(root, "exported", "onnx", "lm.onnx"))
    assert (version_dir, paths) == _limited_paths(root), (version_dir, paths)


def _limited_paths(root):
    out = os.path.join(root, "exported")
    onnx_dir = os.path.join(out, "onnx")
    kinds = {"model": "lm.onnx", "step": "lm_step.onnx", "generate": "lm_generate.onnx"}
    return os.path.join(out, "lm", "1"), {kind: os.path.join(onnx_dir, name) for kind, name in kinds.items()}


def limited_export_root():
    """The folder holding ``limited.keras`` and ``exported/`` (built once per run)."""
    return shared_dir("limited_lm_export", _build_limited_export)


def limited_export():
    """`built_limited_lm()` exported: ``(model, version_dir, onnx_paths)`` (``"model"``, ``"step"``, ``"generate"``).

    ``model`` is a fresh build whose weights were checked, bit for bit, against the exported model's.
    """
    root = limited_export_root()
    model = built_limited_lm()
    check_same_weights(model, os.path.join(root, "limited.npz"))
    version_dir, paths = _limited_paths(root)
    return model, version_dir, paths


def _build_limited_cli_export(root):
    """`keras-linattn export limited.keras --out <root>/exported --name lm --format saved_model`.

    What the command printed goes to ``<root>/export.log``.
    """
    import contextlib
    import io

    from keras_linattn import cli

    keras_file = os.path.join(limited_export_root(), "limited.keras")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        args = ["export", keras_file, "--out", os.path.join(root, "exported"), "--name", "lm"]
        code = cli.main(args + ["--format", "saved_model"])
    with open(os.path.join(root, "export.log"), "w") as f:
        f.write(printed.getvalue())
    assert code == 0, printed.getvalue()


def limited_cli_export():
    """`keras-linattn export` of ``limited.keras`` (`limited_export_root`), SavedModel only, built once per run.

    Returns ``(out, printed)``: the ``--out`` folder (read only) and what the export command printed.
    Read by tests/export/test_verify.py (the CLI's verify of a model with a position limit) and
    tests/export/test_cli.py (export then verify of an LM's step and generate signatures).
    """
    root = shared_dir("limited_cli_export", _build_limited_cli_export)
    with open(os.path.join(root, "export.log")) as f:
        printed = f.read()
    return os.path.join(root, "exported"), printed
