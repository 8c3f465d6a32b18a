"""Resume equals never stopped: backups, restores, and training processes killed with SIGKILL.

Every comparison of a resumed run with an uninterrupted one uses the error
model with ``paths=2`` (two float32 training runs). The reduction length of a
weight after S optimizer steps is taken as ``n = S * B * T`` (each step adds a
gradient reduced over the B*T positions of a batch); the runs are in fact
bit-identical on this machine.
"""

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import _atomic, feature_maps
from keras_linattn.callbacks import BackupAndRestore, RedrawRandomFeatures
from keras_linattn.layers import LinearAttention
from tests import _resume_worker as worker
from tests.conftest import TEST_SEED
from tests.tolerance import assert_close

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_STEPS = worker.EPOCHS * worker.STEPS_PER_EPOCH
N_WORKER = TOTAL_STEPS * worker.BATCH * worker.LENGTH


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(_atomic.KILL_ENV, None)
    return env


def _assert_same_weights(got, expected, n, what=""):
    """Integer weights equal, float weights within the error model; every weight finite (a NaN
    reference would make the comparison vacuous)."""
    assert len(got) == len(expected), what
    compared = 0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.shape == b.shape, (what, i)
        assert np.isfinite(b).all(), f"{what}: reference weight {i} is not finite"
        if np.issubdtype(b.dtype, np.integer):
            np.testing.assert_array_equal(a, b, err_msg=f"{what} weight {i}")
        elif np.abs(b).max() > 0:  # zero-initialized biases that got no gradient are compared by the rest
            assert_close(a, b, n=n, paths=2, what=f"{what} weight {i}")
            compared += 1
    assert compared >= len(expected) // 2, f"{what}: only {compared} of {len(expected)} weights compared"


# ---------------------------------------------------------------- in-process
def _every_map_model(dropout=0.0, maps=None):
    """One model holding every registered feature map (one attention layer each), compiled to run eagerly
    (tracing a train step of ten attention layers costs more than the few steps these tests take)."""
    keras.utils.set_random_seed(TEST_SEED)
    inputs = keras.Input((8, 6))
    branches = []  # side by side, not stacked: stacked residual branches overflow exp-based maps
    for i, name in enumerate(maps or feature_maps.available()):
        kwargs = {"num_features": 6, "seed": i} if name in ("favor+", "favor_trig") else {}
        att = LinearAttention(
            2,
            3,
            feature_map=feature_maps.get(name, **kwargs),
            chunk_size=4,
            dropout=dropout,
            name=f"att_{name.replace('+', 'plus')}",
        )
        branches.append(att(inputs, inputs, use_causal_mask=True))
    h = keras.layers.Add()([inputs, *branches]) if len(branches) > 1 else inputs + branches[0]
    model = keras.Model(inputs, keras.layers.Dense(6)(h))
    model.compile(keras.optimizers.Adam(1e-2), "mse", run_eagerly=True)
    return model


SMALL = ("favor+", "oglu")  # a random map that redraws and a trainable one


def _every_map_stream(rng):
    """A function making the training stream. Each run gets its own dataset object: a shuffled
    dataset draws each new iterator's order from a generator it owns, so a second run over the
    same object would see another order than the first."""
    x = rng.normal(size=(8, 8, 6)).astype("float32")

    def make():
        ds = tf.data.Dataset.from_tensor_slices((x, np.roll(x, 1, axis=1)))
        return ds.shuffle(8, seed=1, reshuffle_each_iteration=True).repeat().batch(4)  # 2 batches per pass

    return make


class _Interrupt(keras.callbacks.Callback):
    """Raises after the `at`-th trained batch of the fit call (an in-process crash)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt("interrupted by the test")


def _fit(model, stream, backup=None, interrupt_at=None, epochs=3, steps=2, skip=0):
    callbacks = [RedrawRandomFeatures(every_n_steps=1)]
    if backup is not None:
        callbacks.append(backup)
    if interrupt_at is not None:
        callbacks.append(_Interrupt(interrupt_at))
    model.fit(stream().skip(skip), epochs=epochs, steps_per_epoch=steps, callbacks=callbacks, verbose=0, shuffle=False)


# SMALL (a random map and a trainable one) in `make test`, every registered map in `make test-slow`.
@pytest.mark.parametrize(
    "maps", [pytest.param(SMALL, id="small"), pytest.param(None, id="every", marks=pytest.mark.slow)]
)
def test_keras_backup_and_restore_resumes_every_feature_map(tmp_path, rng, maps):
    """Keras' own BackupAndRestore (epoch backups): random maps redraw every step, trainable maps train."""
    stream = _every_map_stream(rng)
    reference = _every_map_model(maps=maps)
    _fit(reference, stream, epochs=2)
    expected = [np.asarray(w) for w in reference.weights]

    backup_dir = str(tmp_path / "keras_backup")
    model = _every_map_model(maps=maps)
    with pytest.raises(KeyboardInterrupt):  # killed in the middle of epoch 1 (batch 3 of 4)
        _fit(model, stream, keras.callbacks.BackupAndRestore(backup_dir), interrupt_at=3, epochs=2)
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 1
    resumed = _every_map_model(maps=maps)
    _fit(resumed, stream, keras.callbacks.BackupAndRestore(backup_dir), epochs=2, skip=1 * 2)
    _assert_same_weights([np.asarray(w) for w in resumed.weights], expected, n=4 * 4 * 8, what="keras backup")
    # The random maps were redrawn before every step but the first (3 times), in both runs.
    indices = {w.path: int(np.asarray(w)) for w in resumed.weights if w.path.endswith("draw_index")}
    random_maps = [name for name in (maps or feature_maps.available()) if name in ("favor+", "favor_trig")]
    assert len(random_maps) >= 1 and sorted(indices.values()) == [3] * len(random_maps), indices


def test_mid_epoch_backup_resumes_exactly_with_dropout(tmp_path, rng):
    """keras_linattn's BackupAndRestore, a backup every 3 batches: resumed inside an epoch."""
    stream = _every_map_stream(rng)
    reference = _every_map_model(dropout=0.2, maps=SMALL)
    _fit(reference, stream, epochs=2, steps=4)
    expected = [np.asarray(w) for w in reference.weights]

    backup_dir = str(tmp_path / "backup")
    model = _every_map_model(dropout=0.2, maps=SMALL)
    with pytest.raises(KeyboardInterrupt):  # backup after batch 3, killed after batch 5
        _fit(model, stream, BackupAndRestore(backup_dir, save_freq=3), interrupt_at=5, epochs=2, steps=4)
    backup = BackupAndRestore(backup_dir, save_freq=3)
    assert backup.resume_point() == (0, 3)
    resumed = _every_map_model(dropout=0.2, maps=SMALL)
    _fit(resumed, stream, backup, epochs=2, steps=4, skip=backup.initial_epoch * 4)
    _assert_same_weights([np.asarray(w) for w in resumed.weights], expected, n=8 * 4 * 8, what="mid-epoch")
    assert not os.path.exists(backup_dir)  # deleted when fit completes (delete_checkpoint=True)
    assert resumed._initial_epoch is None  # a later fit of this model starts at epoch 0 again
    assert not hasattr(resumed.train_function, "_kla_original")  # the replaying wrapper is gone


def test_backup_after_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path, rng):
    """A backup taken after the last batch of an epoch records (epoch + 1, 0), not
    (epoch, steps): resuming from (epoch, steps) replayed a whole epoch without a
    training step and failed reading metrics that were never built."""
    stream = _every_map_stream(rng)
    reference = _every_map_model(maps=SMALL)
    _fit(reference, stream, epochs=2, steps=4)
    expected = [np.asarray(w) for w in reference.weights]

    backup_dir = str(tmp_path / "backup")
    model = _every_map_model(maps=SMALL)
    with pytest.raises(KeyboardInterrupt):  # backups after batches 2 and 4, killed after batch 5
        _fit(model, stream, BackupAndRestore(backup_dir, save_freq=2), interrupt_at=5, epochs=2, steps=4)
    backup = BackupAndRestore(backup_dir, save_freq=2)
    assert backup.resume_point() == (1, 0)
    resumed = _every_map_model(maps=SMALL)
    _fit(resumed, stream, backup, epochs=2, steps=4, skip=backup.initial_epoch * 4)
    _assert_same_weights([np.asarray(w) for w in resumed.weights], expected, n=8 * 4 * 8, what="epoch end")


def test_backup_files_are_complete_at_every_fault_point(tmp_path, rng):
    """A copy of the backup dir taken where a kill could land always restores a consistent state."""
    stream = _every_map_stream(rng)
    backup_dir = tmp_path / "backup"
    snapshots = []

    def snapshot(point):
        if point.startswith("backup:") and backup_dir.exists():
            dst = tmp_path / f"snap{len(snapshots)}"
            import shutil

            shutil.copytree(backup_dir, dst)
            snapshots.append((point, dst))

    model = _every_map_model(maps=SMALL)
    previous = _atomic.set_fault_hook(snapshot)
    try:
        _fit(model, stream, BackupAndRestore(str(backup_dir), save_freq=1, delete_checkpoint=False), epochs=1, steps=2)
    finally:
        _atomic.set_fault_hook(previous)
    assert [p for p, _ in snapshots[:3]] == ["backup:weights_staged", "backup:weights_published", "backup:committed"]
    for point, path in snapshots:
        meta = BackupAndRestore(str(path)).read_metadata()
        if meta is None:  # killed before the first commit: a fresh start
            continue
        names = os.listdir(path)
        assert meta["weights"] in names, (point, names)
        probe = _every_map_model(maps=SMALL)
        probe.optimizer.build(probe.trainable_variables)
        probe.load_weights(os.path.join(path, meta["weights"]))  # complete and loadable
        assert int(np.asarray(probe.optimizer.iterations)) == meta["epoch"] * 2 + meta["batch"], point


def test_redraw_state_is_a_weight_and_old_files_load(tmp_path):
    fm = feature_maps.get("favor+", num_features=4, seed=3)
    att = LinearAttention(2, 4, feature_map=fm)
    x = np.zeros((1, 5, 8), "float32")
    att(x, x)
    fm.redraw()
    fm.redraw()
    assert int(fm.draw_index.numpy()) == 2
    third = feature_maps.get("favor+", num_features=4, seed=3)
    LinearAttention(2, 4, feature_map=third)(x, x)
    for _ in range(3):
        third.redraw()
    path = str(tmp_path / "att.weights.h5")
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, att(inputs, inputs))
    model.save_weights(path)
    # The saved draw index continues the sequence: the next redraw is draw 3.
    fm.redraw(seed=11)  # an explicit seed leaves the index alone
    assert int(fm.draw_index.numpy()) == 2
    model.load_weights(path)
    fm.redraw()
    np.testing.assert_array_equal(fm.projection.numpy(), third.projection.numpy())
    # A file written before `draw_index` existed (projection only) loads with index 0.
    with h5py.File(path, "r+") as f:
        group = [g for g in _h5_groups(f) if g.endswith("feature_map/vars")][0]
        del f[group]["1"]
    fm.redraw()
    model.load_weights(path)
    assert int(fm.draw_index.numpy()) == 0


def _h5_groups(f):
    names = []
    f.visit(lambda name: names.append(name) if isinstance(f[name], h5py.Group) else None)
    return names


def test_backup_arguments_and_unbuilt_model(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq=0)
    with pytest.raises(ValueError, match="backup_dir"):
        BackupAndRestore("")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="a file exists there"):
        BackupAndRestore(str(tmp_path / "file"))
    assert BackupAndRestore(str(tmp_path / "none")).resume_point() == (0, 0)


# ---------------------------------------------------------------- SIGKILL
def _popen(args):
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def _kill_after_line(proc, matches, delay):
    """Sends SIGKILL `delay` seconds after the first stdout line for which `matches(line)` holds."""
    seen = []
    for line in proc.stdout:
        seen.append(line.strip())
        if matches(line.strip()):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=300)
    err = proc.stderr.read()
    assert proc.returncode == -signal.SIGKILL, f"not killed (rc={proc.returncode}): {seen[-5:]} {err[-2000:]}"
    return seen


def _run_to_end(args):
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _kill_step(feature_map):
    """A random step after the first backup (step 3), seeded by the test seed and the map."""
    rng = np.random.default_rng([TEST_SEED, sum(map(ord, feature_map))])
    return int(rng.integers(worker.SAVE_FREQ + 1, TOTAL_STEPS - 2)), float(rng.uniform(0.0, 0.05))


@pytest.mark.parametrize(
    "feature_map",
    [
        "elu",
        pytest.param("favor+", marks=pytest.mark.slow),  # redraws every 2 steps
        pytest.param("oglu", marks=pytest.mark.slow),
    ],
)
def test_sigkill_at_a_random_step_then_rerun_equals_uninterrupted(tmp_path, feature_map):
    step, delay = _kill_step(feature_map)
    backup_dir, out = str(tmp_path / "backup"), str(tmp_path / "weights.npz")
    args = ["-m", "tests._resume_worker", "--feature-map", feature_map, "--backup-dir", backup_dir, "--out", out]
    killed = _popen(args + ["--progress", "--step-delay", "0.05"])
    seen = _kill_after_line(killed, lambda line: line == f"step {step}", delay)
    assert os.path.exists(os.path.join(backup_dir, "latest.json")), seen
    assert not os.path.exists(out)
    resumed_from = BackupAndRestore(backup_dir).resume_point()
    assert resumed_from != (0, 0)
    _run_to_end(args)
    with np.load(out) as f:
        got = [f[f"arr_{i}"] for i in range(len(f.files))]
    expected = worker.train(feature_map)  # uninterrupted, in this process
    what = f"{feature_map} killed at step {step}, resumed at {resumed_from}"
    _assert_same_weights(got, expected, n=N_WORKER, what=what)
    assert not os.path.exists(backup_dir)


CHAR_LM_ARGS = [
    "--steps",
    "16",
    "--eval-every",
    "4",
    "--validation-steps",
    "1",
    "--max-chars",
    "20000",
    "--sequence-length",
    "16",
    "--batch-size",
    "4",
    "--num-layers",
    "1",
    "--hidden-dim",
    "16",
    "--num-heads",
    "2",
    "--intermediate-dim",
    "32",
    "--chunk-size",
    "8",
    "--generate-length",
    "2",
    "--num-samples",
    "1",
    "--sampler",
    "greedy",
    "--verbose",
    "0",
    "--no-jit",
    "--backup-every",
    "2",
]


def _keras_weights(path):
    model = keras.saving.load_model(path)
    return [np.asarray(w) for w in model.weights]


@pytest.mark.slow
def test_char_lm_example_sigkill_then_rerun_equals_uninterrupted(tmp_path, capsys):
    from examples.char_lm import train

    reference = str(tmp_path / "reference.keras")
    train.main(CHAR_LM_ARGS + ["--save", reference])
    capsys.readouterr()
    expected = _keras_weights(reference)

    backup_dir, out = str(tmp_path / "backup"), str(tmp_path / "out.keras")
    cmd = ["-m", "examples.char_lm.train", *CHAR_LM_ARGS, "--backup-dir", backup_dir, "--save", out]
    rng = np.random.default_rng(TEST_SEED)
    target, delay = int(rng.integers(1, 6)), float(rng.uniform(0.0, 0.2))  # after backup `target` (of 8)
    proc = _popen(cmd)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        meta = os.path.join(backup_dir, "latest.json")
        try:
            with open(meta) as f:
                if json.load(f)["sequence"] >= target:
                    time.sleep(delay)
                    proc.send_signal(signal.SIGKILL)
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    assert not os.path.exists(out)
    epoch, batch = BackupAndRestore(backup_dir).resume_point()
    assert (epoch, batch) != (0, 0)
    stdout = _run_to_end(cmd)
    assert f"resuming from the backup in {backup_dir}: epoch {epoch}, batch {batch}" in stdout
    _assert_same_weights(_keras_weights(out), expected, n=16 * 4 * 16, what=f"char_lm resumed at {(epoch, batch)}")


@pytest.mark.slow
def test_multi_worker_loop_sigkill_then_rerun_equals_uninterrupted(tmp_path):
    """The custom loop (one local worker) checkpoints through tf.train.CheckpointManager."""
    common = [
        "-m",
        "examples.multi_worker.train",
        "--steps",
        "10",
        "--checkpoint-every",
        "3",
        "--max-chars",
        "20000",
        "--sequence-length",
        "16",
        "--per-replica-batch",
        "4",
        "--num-layers",
        "1",
        "--hidden-dim",
        "16",
        "--num-heads",
        "2",
        "--intermediate-dim",
        "32",
        "--chunk-size",
        "8",
        "--feature-map",
        "favor+",
        "--redraw-every",
        "2",
        "--dropout",
        "0.1",
        "--log-steps",
    ]
    reference = str(tmp_path / "reference.npz")
    _run_to_end(common + ["--weights-out", reference])
    backup_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "out.npz")
    rng = np.random.default_rng(TEST_SEED)
    step = int(rng.integers(4, 8))
    args = common + ["--backup-dir", backup_dir, "--weights-out", out]
    _kill_after_line(_popen(args), lambda line: line.startswith(f"step {step} "), float(rng.uniform(0, 0.05)))
    assert tf.train.latest_checkpoint(backup_dir) is not None
    stdout = _run_to_end(args)
    assert "resumed from" in stdout
    with np.load(reference) as a, np.load(out) as b:
        expected = [a[k] for k in sorted(a.files, key=lambda k: int(k[1:]))]
        got = [b[k] for k in sorted(b.files, key=lambda k: int(k[1:]))]
    _assert_same_weights(got, expected, n=10 * 4 * 16, what=f"multi-worker loop killed after step {step}")


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_workers(args, kill_step=None, delay=0.0):
    """Runs `args` as two MultiWorkerMirroredStrategy workers on localhost; SIGKILLs both after the
    chief prints ``step <kill_step>``. Returns the chief's stdout lines."""
    workers = [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]
    procs = []
    for index in range(2):
        env = _env()
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        )
    lines = []
    try:
        for line in procs[0].stdout:
            lines.append(line.strip())
            if kill_step is not None and line.startswith(f"step {kill_step} "):
                time.sleep(delay)
                for proc in procs:
                    proc.send_signal(signal.SIGKILL)
                break
        for proc in procs:
            proc.wait(timeout=600)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    expected_rc = -signal.SIGKILL if kill_step is not None else 0
    for proc in procs:
        assert proc.returncode == expected_rc, (proc.returncode, lines[-5:], proc.stderr.read()[-3000:])
    return lines


@pytest.mark.slow
def test_two_worker_loop_sigkill_then_rerun_equals_uninterrupted(tmp_path):
    """Both workers of the custom loop killed (a pre-empted job) and restarted: same weights."""
    common = [
        "-m",
        "examples.multi_worker.train",
        "--steps",
        "8",
        "--checkpoint-every",
        "2",
        "--max-chars",
        "20000",
        "--sequence-length",
        "16",
        "--per-replica-batch",
        "2",
        "--num-layers",
        "1",
        "--hidden-dim",
        "16",
        "--num-heads",
        "2",
        "--intermediate-dim",
        "32",
        "--chunk-size",
        "8",
        "--feature-map",
        "favor+",
        "--redraw-every",
        "2",
        "--dropout",
        "0.1",
        "--log-steps",
    ]
    reference = str(tmp_path / "reference.npz")
    assert any('replicas": 2' in line for line in _two_workers(common + ["--weights-out", reference]))
    backup_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "out.npz")
    rng = np.random.default_rng(TEST_SEED)
    step = int(rng.integers(3, 7))
    args = common + ["--backup-dir", backup_dir, "--weights-out", out]
    _two_workers(args, kill_step=step, delay=float(rng.uniform(0, 0.05)))
    lines = _two_workers(args)
    assert any(line.startswith("resumed from") for line in lines), lines
    with np.load(reference) as a, np.load(out) as b:
        expected = [a[k] for k in sorted(a.files, key=lambda k: int(k[1:]))]
        got = [b[k] for k in sorted(b.files, key=lambda k: int(k[1:]))]
    _assert_same_weights(got, expected, n=8 * 4 * 16, what=f"two workers killed after step {step}")


_SMALL_MULTI_WORKER = [
    "-m",
    "examples.multi_worker.train",
    "--max-chars",
    "20000",
    "--sequence-length",
    "16",
    "--per-replica-batch",
    "2",
    "--num-layers",
    "1",
    "--hidden-dim",
    "16",
    "--num-heads",
    "2",
    "--intermediate-dim",
    "32",
    "--chunk-size",
    "8",
    "--log-steps",
]


def _worker(index, workers, args):
    env = _env()
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def test_lone_worker_times_out_with_the_recovery_procedure(tmp_path):
    """A worker started without the others (a restart of one worker after a crash) used to wait
    forever without a word; it now prints the recovery procedure after --cluster-timeout."""
    workers = [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]
    args = _SMALL_MULTI_WORKER + ["--steps", "4", "--backup-dir", str(tmp_path / "ckpt"), "--cluster-timeout", "5"]
    proc = _worker(1, workers, args)
    start = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stderr[-3000:])
    assert "worker 1 of 2: the cluster did not form within --cluster-timeout=5 s" in stderr, stderr[-3000:]
    assert "start every worker again" in stderr and str(tmp_path / "ckpt") in stderr, stderr[-3000:]
    assert time.monotonic() - start < 120  # the timeout, plus TensorFlow's start-up


@pytest.mark.slow
def test_one_killed_worker_ends_the_job_then_a_restart_of_every_worker_resumes(tmp_path):
    """Worker 1 killed: worker 0 fails at its next collective, prints the recovery procedure and
    exits with EXIT_PEER_LOST within seconds; restarting both workers resumes to the weights of an
    uninterrupted run."""
    from examples.multi_worker.train import EXIT_PEER_LOST

    common = _SMALL_MULTI_WORKER + ["--steps", "8", "--checkpoint-every", "2", "--collective-timeout", "300"]
    reference = str(tmp_path / "reference.npz")
    assert any('replicas": 2' in line for line in _two_workers(common + ["--weights-out", reference]))
    backup_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "out.npz")
    args = common + ["--backup-dir", backup_dir, "--weights-out", out]
    workers = [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]
    procs = [_worker(index, workers, args) for index in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("step 5 "):
                procs[1].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                break
        _, stderr = procs[0].communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert procs[0].returncode == EXIT_PEER_LOST, (procs[0].returncode, stderr[-3000:])
    assert "worker 0 of 2: a collective failed" in stderr and "start every worker again" in stderr, stderr[-3000:]
    assert ended < 30, ended
    lines = _two_workers(args)  # every worker restarted
    assert any(line.startswith("resumed from") for line in lines), lines
    with np.load(reference) as a, np.load(out) as b:
        expected = [a[k] for k in sorted(a.files, key=lambda k: int(k[1:]))]
        got = [b[k] for k in sorted(b.files, key=lambda k: int(k[1:]))]
    _assert_same_weights(got, expected, n=8 * 4 * 16, what="one worker killed after step 5, every worker restarted")


LISTOPS_ARGS = [
    "--variants",
    "elu",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--batch-size",
    "8",
    "--num-train",
    "64",
    "--num-eval",
    "16",
    "--min-length",
    "4",
    "--max-length",
    "32",
    "--seq-len",
    "32",
    "--hidden-dim",
    "16",
    "--intermediate-dim",
    "16",
    "--no-jit",
    "--verbose",
    "0",
]


@pytest.mark.slow
def test_listops_rerun_skips_finished_runs_and_matches(tmp_path, capsys):
    """ListOps with --backup-dir: a rerun reuses finished (variant, seed) runs, and a run's
    result does not depend on what ran before it in the process (one training stream per run)."""
    from examples.listops import train

    data = ["--data-dir", str(tmp_path / "tfds")]
    backup = ["--backup-dir", str(tmp_path / "backup")]
    reference = train.main(LISTOPS_ARGS + data + ["--seeds", "0,1"])
    first = train.main(LISTOPS_ARGS + data + backup + ["--seeds", "1"])
    capsys.readouterr()
    second = train.main(LISTOPS_ARGS + data + backup + ["--seeds", "0,1"])
    assert "[elu seed=1] finished in an earlier run" in capsys.readouterr().out
    assert second[1] == first[0]  # reused from backup/results/
    for got, expected in zip(second, reference, strict=True):
        assert got["train_loss"] == expected["train_loss"] and got["val_accuracy"] == expected["val_accuracy"]


class _CrashAfterBackups:
    """A fault hook raising KeyboardInterrupt (an in-process crash) after the n-th committed backup."""

    def __init__(self, n):
        self.n, self.seen = n, 0

    def __call__(self, point):
        if point == "backup:committed":
            self.seen += 1
            if self.seen == self.n:
                raise KeyboardInterrupt(f"crash after backup {self.n}")


@pytest.mark.slow
def test_text_classification_rerun_after_a_crash_matches(tmp_path, capsys):
    """The IMDB example (dropout 0.1, oglu) crashed after its first backup, rerun: the same weights."""
    import tensorflow_datasets as tfds

    from examples.text_classification import train

    args = [
        "--steps",
        "6",
        "--eval-every",
        "2",
        "--batch-size",
        "8",
        "--sequence-length",
        "24",
        "--num-layers",
        "1",
        "--hidden-dim",
        "16",
        "--num-heads",
        "2",
        "--intermediate-dim",
        "16",
        "--feature-map",
        "oglu",
        "--verbose",
        "0",
        "--no-jit",
        "--backup-every",
        "3",
    ]
    backup = ["--backup-dir", str(tmp_path / "backup")]
    with tfds.testing.mock_data(num_examples=32):
        reference, _ = train.main(args)
        expected = [np.asarray(w) for w in reference.weights]
        previous = _atomic.set_fault_hook(_CrashAfterBackups(1))
        try:
            with pytest.raises(KeyboardInterrupt):
                train.main(args + backup)
        finally:
            _atomic.set_fault_hook(previous)
        assert BackupAndRestore(str(tmp_path / "backup")).resume_point() == (1, 1)  # after step 3 of 6
        resumed, summary = train.main(args + backup)
    assert "resuming from the backup" in capsys.readouterr().out
    _assert_same_weights([np.asarray(w) for w in resumed.weights], expected, n=6 * 8 * 24, what="imdb")
