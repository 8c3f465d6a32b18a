"""LinearCausalLM trained under a distribution, in a subprocess, against one device: shared pieces.

The TensorFlow part (`TF_LM_SCRIPT`) runs inside the MirroredStrategy
subprocess of tests/training/test_training.py (one TensorFlow start with two
logical CPU devices for the classifier and the LM checks); the JAX part
(`JAX_LM_SCRIPT`) is the JAX subprocess of tests/training/test_strategies.py.
Both write the weights of each run to ``OUT_DIR/lm_weights.npz`` (``tag/i``)
and put their figures under ``out["lm"]``.

Reduction lengths of the LM (1 block, width 16, 2 heads of 8, elu features
C = 8, feed-forward 32, vocabulary 32, T = 8, global batch 8): the block
16 (q/k/v) + 8 keys + 8 features + 16 (output) + 16 + 32 (feed-forward),
then 16 (head) + 32 (softmax). A loss adds the B*T positions it averages; a
weight after S steps adds S*B*T (test_resume.py's convention).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from tests.tolerance import assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, T, STEPS, EPOCHS = 8, 8, 4, 2
N_FORWARD = (16 + 8 + 8 + 16 + 16 + 32) + 16 + 32
N_LOSS = N_FORWARD + B * T
N_WEIGHTS = N_FORWARD + EPOCHS * STEPS * B * T

# The data, the model, the interruption (OUT_DIR = argv[1], SEED = argv[2]).
_COMMON = textwrap.dedent(
    """
    import contextlib, json, os, sys
    import numpy as np
    import keras
    from keras_linattn.callbacks import BackupAndRestore
    from keras_linattn.models import LinearBackbone, LinearCausalLM

    OUT_DIR, SEED = sys.argv[1], int(sys.argv[2])
    V, B, T, STEPS, EPOCHS = 32, {B}, {T}, {STEPS}, {EPOCHS}
    lm_ids = np.random.default_rng(SEED).integers(0, V, size=(B * STEPS, T + 1)).astype("int32")
    lm_x, lm_y = lm_ids[:, :-1], lm_ids[:, 1:]


    def build_lm():
        keras.utils.set_random_seed(SEED)
        return LinearCausalLM(vocabulary_size=V, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32,
                              chunk_size=4)


    LM_INIT = [np.asarray(w) for w in build_lm().get_weights()]


    class Interrupt(keras.callbacks.Callback):
        def __init__(self, at):
            super().__init__()
            self.at, self.seen = at, 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt("interrupted by the test")


    def recorder(losses):
        # Replayed batches of a resumed epoch train nothing and log nothing.
        return keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])) if "loss" in logs else None)


    def interrupted_then_resumed(run, tag):
        '''Backups every 3 batches, interrupted after batch 5 of 8, rerun: (resume point, weights).'''
        backup_dir = os.path.join(OUT_DIR, "backup_" + tag)
        try:
            run([BackupAndRestore(backup_dir, save_freq=3), Interrupt(5)])
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("not interrupted")
        point = list(BackupAndRestore(backup_dir).resume_point())
        weights = run([BackupAndRestore(backup_dir, save_freq=3)])[1]
        assert not os.path.exists(backup_dir), "the backup outlived the completed fit"
        return point, weights


    lm_out, lm_arrays = {{}}, {{f"init/{{i}}": w for i, w in enumerate(LM_INIT)}}
    """
).format(B=B, T=T, STEPS=STEPS, EPOCHS=EPOCHS)

_SAVE = textwrap.dedent(
    """
    np.savez(os.path.join(OUT_DIR, "lm_weights.npz"), **lm_arrays)
    out["lm"] = lm_out
    """
)

# Needs `tf` and `strategy` (a MirroredStrategy) defined before it, and a dict `out`.
TF_LM_SCRIPT = (
    _COMMON
    + textwrap.dedent(
        """
    def run_lm(distributed, callbacks=(), evaluate=False):
        '''A fresh LM from LM_INIT, fit (no test_on_batch first): (batch losses, weights, evaluate loss).'''
        losses = []
        with strategy.scope() if distributed else tf.device("/cpu:0"):
            model = build_lm()
            model.set_weights(LM_INIT)
            model.compile(keras.optimizers.SGD(0.5), weighted_metrics=[], jit_compile=False)
        model.fit(lm_x, lm_y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                  callbacks=[recorder(losses), *callbacks])
        loss = float(model.evaluate(lm_x, lm_y, batch_size=B, verbose=0)) if evaluate else None
        return losses, [np.asarray(w) for w in model.get_weights()], loss


    for tag, distributed in (("single", False), ("mirrored", True)):
        losses, weights, loss = run_lm(distributed, evaluate=True)
        lm_out[tag] = {"losses": losses, "evaluate": loss}
        lm_arrays.update({f"{tag}/{i}": w for i, w in enumerate(weights)})
    lm_out["resumed_point"], weights = interrupted_then_resumed(lambda cbs: run_lm(True, cbs), "mirrored")
    lm_arrays.update({f"resumed/{i}": w for i, w in enumerate(weights)})
    """
    )
    + _SAVE
)

JAX_LM_SCRIPT = (
    _COMMON
    + textwrap.dedent(
        """
    assert keras.backend.backend() == "jax", keras.backend.backend()
    devices = keras.distribution.list_devices()
    assert len(devices) == 2, devices
    out = {}


    def run_lm(distribution=None, callbacks=()):
        '''A fresh LM from LM_INIT, fit: (batch losses, weights, sharding spec of each variable).'''
        losses = []
        with distribution.scope() if distribution is not None else contextlib.nullcontext():
            model = build_lm()
            model.set_weights(LM_INIT)
            model.compile(keras.optimizers.SGD(0.5), weighted_metrics=[])
            model.fit(lm_x, lm_y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[recorder(losses), *callbacks])
        specs = {v.path: str(getattr(v.value.sharding, "spec", None)) for v in model.weights}
        return losses, [np.asarray(w) for w in model.get_weights()], specs


    data_parallel = keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    model_parallel = keras.distribution.ModelParallel(
        layout_map=LinearBackbone.get_layout_map(mesh), batch_dim_name="batch")
    for tag, distribution in (("single", None), ("data_parallel", data_parallel), ("model_parallel", model_parallel)):
        losses, weights, specs = run_lm(distribution)
        lm_out[tag] = {"losses": losses, "specs": specs}
        lm_arrays.update({f"{tag}/{i}": w for i, w in enumerate(weights)})
    for tag, distribution in (("resumed", None), ("resumed_data_parallel", data_parallel)):
        lm_out[tag + "_point"], weights = interrupted_then_resumed(lambda cbs: run_lm(distribution, cbs), tag)
        lm_arrays.update({f"{tag}/{i}": w for i, w in enumerate(weights)})
    """
    )
    + _SAVE
    + 'print("RESULT " + json.dumps(out))\n'
)


def run_script(script, out_dir, seed, env_extra):
    """Runs `script` with ``argv = [out_dir, seed]``; returns its ``RESULT`` JSON."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **env_extra)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    path = os.path.join(out_dir, "run.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(script)
    proc = subprocess.run(
        [sys.executable, path, str(out_dir), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def load_weights(out_dir):
    """``{tag: [weight arrays in order]}`` from ``out_dir/lm_weights.npz``."""
    with np.load(os.path.join(out_dir, "lm_weights.npz")) as f:
        arrays = dict(f)
    runs = {}
    for key, value in arrays.items():
        tag, index = key.rsplit("/", 1)
        runs.setdefault(tag, {})[int(index)] = value
    return {tag: [w[i] for i in range(len(w))] for tag, w in runs.items()}


def assert_same_weights(got, expected, init, what):
    """Float weights within the error model after EPOCHS * STEPS steps; most weights moved (not vacuous)."""
    assert len(got) == len(expected) == len(init), what
    moved = 0
    for i, (a, b, w0) in enumerate(zip(got, expected, init, strict=True)):
        assert np.isfinite(b).all(), f"{what}: reference weight {i} is not finite"
        if np.abs(b).max() > 0:
            assert_close(a, b, n=N_WEIGHTS, paths=2, what=f"{what} weight {i}")
        moved += bool(np.abs(b - w0).max() > 0)
    assert moved >= len(expected) // 2, f"{what}: only {moved} of {len(expected)} weights changed: a vacuous check"


def assert_same_losses(got, expected, what):
    """Batch losses as Keras logs them (the running mean of the epoch), within the error model."""
    assert len(got) == len(expected) == EPOCHS * STEPS, (what, got, expected)
    assert_close(got, expected, n=N_LOSS, paths=2, what=what)
