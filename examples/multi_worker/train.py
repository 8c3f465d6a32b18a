"""A char LM trained by a custom loop under `MultiWorkerMirroredStrategy`, resumable.

Keras 3's ``fit`` fails under this strategy (keras-team/keras#20585), so
this is the custom training loop of docs/training.md, with checkpoints:
every model variable (weights, random-feature projections and their
``draw_index``, dropout seed-generator states), every optimizer variable and
the step counter go into a `tf.train.Checkpoint` that a
`tf.train.CheckpointManager` writes every ``--checkpoint-every`` steps. Rerunning the same command (on every worker)
after a crash restores the latest checkpoint and continues; the data stream
(one fixed-seed shuffle) skips the batches the restored steps used, so the
final weights equal those of an uninterrupted run.

Each worker runs the same command with its own ``TF_CONFIG``; without one
it is a single local worker:

    python -m examples.multi_worker.train --backup-dir runs/mw --steps 200 --save lm.keras

Every worker must call ``manager.save()`` (saving is a collective
operation); only the chief (worker 0) writes to ``--backup-dir``, the others
write to a scratch directory they delete right after, the pattern of the
TensorFlow multi-worker guide. TensorFlow writes a checkpoint's files first
and then replaces the small ``checkpoint`` state file that names the latest
one, so a worker killed during a save leaves the previous checkpoint
current.

Losing a worker: `MultiWorkerMirroredStrategy` cannot replace one worker
inside a running job. When a worker dies, the others fail at their next
collective (within seconds: an ``UnavailableError``); this script then
prints the recovery procedure and exits with status 3 (`EXIT_PEER_LOST`).
Recovery: stop every worker that is still running, then start every worker
again with the same command and ``TF_CONFIG``; they restore the last
checkpoint and continue exactly. A worker started alone waits for the others
at start-up; after ``--cluster-timeout`` seconds (default 600; 0 waits
forever) it prints the same procedure and is ended (SIGKILL, by a watchdog
process) instead of waiting without a word. ``--collective-timeout S`` also bounds every
collective of the training loop (a peer that hangs without dying).

The variables are checkpointed as explicit lists, not as ``model=model``:
``tf.train.Checkpoint(model=model)`` does not follow layers that a Keras 3
model keeps in a Python list (`LinearCausalLM`'s decoder blocks), so their
non-trainable state would be lost silently (their trainable weights only come
back through the optimizer's references to them).
"""

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Exit status when a worker of the cluster is lost during training: restart every worker.
EXIT_PEER_LOST = 3

# What a lost worker looks like from the others: the collective is aborted
# (Unavailable: a peer is down; FailedPrecondition: a peer restarted; Aborted /
# Cancelled: collectives aborted after a failure), or it times out
# (DeadlineExceeded, with --collective-timeout).
PEER_LOST_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.FailedPreconditionError,
)


def recovery_message(task_id, num_workers, reason, backup_dir):
    """The text printed when the cluster is incomplete: what happened and how to recover."""
    resume = (
        f"they restore the last checkpoint in {backup_dir!r} and continue exactly where it was written"
        if backup_dir
        else "without --backup-dir training starts over from step 0"
    )
    return (
        f"worker {task_id} of {num_workers}: {reason}\n"
        "MultiWorkerMirroredStrategy cannot replace one worker inside a running job. To recover: stop every "
        "worker that is still running, then start every worker again with the same command and TF_CONFIG; "
        f"{resume}. Restarting one worker alone waits for the others (--cluster-timeout)."
    )


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m examples.multi_worker.train",
        description="Custom training loop under MultiWorkerMirroredStrategy with CheckpointManager resume.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--backup-dir", default=None, help="checkpoint directory; rerun after a crash to resume")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--per-replica-batch", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=200_000)
    parser.add_argument("--feature-map", default="oglu")
    parser.add_argument("--redraw-every", type=int, default=None, help="random maps: redraw every N steps")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="chief: save the trained model to this .keras file")
    parser.add_argument("--weights-out", default=None, help="chief: write the final weights to this .npz file")
    parser.add_argument("--log-steps", action="store_true", help="print 'step N loss' after every step")
    parser.add_argument(
        "--cluster-timeout",
        type=float,
        default=600.0,
        help="seconds to wait at start-up for every worker of TF_CONFIG; then exit with the recovery "
        "procedure (status 3). 0 waits forever",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="seconds any collective of the training loop may take (a hung peer); default: no limit "
        "(a dead peer is detected without it)",
    )
    return parser


def _error_summary(error):
    """The informative line of a TensorFlow error ("Collective ops is aborted by: ..."), not its traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "aborted" in line.lower() or "deadline" in line.lower() or "timed out" in line.lower():
            return line
    lines = [line for line in lines if line != "Graph execution error:"]
    return lines[0] if lines else type(error).__name__


def _num_workers():
    """Workers (and chief) listed in TF_CONFIG; 1 without it."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {})
        return max(1, sum(len(cluster.get(job, [])) for job in ("chief", "worker")))
    except (ValueError, AttributeError, TypeError):
        return 1


def _task_id():
    try:
        return int(json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {}).get("index", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


# A watchdog in its own small process: TensorFlow waits for the cluster inside a C++ call during
# which this process' Python threads and signal handlers do not run (checked: a threading.Timer
# set to 15 s had not fired after 2 minutes).
_WATCHDOG = """
import os, signal, sys, time
parent, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    time.sleep(0.1)
    if os.getppid() != parent:  # the worker is gone
        sys.exit(0)
sys.stderr.write(message + "\\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)  # SIGTERM does not end a worker blocked there
"""


def make_strategy(args):
    """`MultiWorkerMirroredStrategy`, created under a start-up timeout.

    Creating the strategy waits until every worker of TF_CONFIG has joined
    (TensorFlow waits forever, silently). A watchdog process started here
    prints the recovery procedure after `--cluster-timeout` seconds and
    kills the worker (SIGKILL: exit status 137 in a shell); it is stopped
    as soon as the cluster has formed.
    """
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.collective_timeout)
    watchdog = None
    if args.cluster_timeout and _num_workers() > 1:
        reason = (
            f"the cluster did not form within --cluster-timeout={args.cluster_timeout:g} s: not every worker "
            "of TF_CONFIG is running"
        )
        message = recovery_message(_task_id(), _num_workers(), reason, args.backup_dir)
        watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(args.cluster_timeout), message]
        )
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    finally:
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()


def _feature_map(name, seed):
    from keras_linattn import feature_maps

    cls = type(feature_maps.get(name))
    if "seed" in inspect.signature(cls.__init__).parameters:
        return feature_maps.get(name, seed=seed)
    return feature_maps.get(name)


def restore(checkpoint, directory):
    """Restores the latest checkpoint in `directory`; returns its path (None when there is none).

    Raises:
        ValueError: naming the checkpoint when it cannot be read or does not
            match the model (a truncated or foreign file).
    """
    latest = tf.train.latest_checkpoint(directory) if directory and os.path.isdir(directory) else None
    if latest is None:
        return None
    try:
        checkpoint.restore(latest).assert_existing_objects_matched()
    except Exception as e:  # OpError, IndexError ("Read less bytes than requested"), AssertionError, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"The checkpoint could not be restored ({type(e).__name__}: {reason}). Received: path={latest!r}"
        ) from e
    return latest


def main(argv=None):
    args = build_parser().parse_args(argv)
    strategy = make_strategy(args)  # first: it configures TF's devices
    import keras
    import numpy as np

    from examples.char_lm import data
    from keras_linattn import _atomic
    from keras_linattn.callbacks import random_feature_layers
    from keras_linattn.models import LinearCausalLM

    resolver = strategy.cluster_resolver
    task_id = resolver.task_id if resolver is not None else 0
    is_chief = task_id in (None, 0)
    global_batch = args.per_replica_batch * strategy.num_replicas_in_sync

    keras.utils.set_random_seed(args.seed)
    text = data.load_stdlib_corpus(max_chars=args.max_chars)
    vocab = data.CharVocabulary.from_text(text, max_size=96)
    ids = vocab.encode(text)
    # One repeating stream, shuffled with a fixed seed: batch k is the same in every process.
    stream = data.windows(ids, args.sequence_length, global_batch, shuffle=True, seed=args.seed).repeat()

    with strategy.scope():
        model = LinearCausalLM(
            vocabulary_size=vocab.size,
            num_layers=args.num_layers,
            hidden_dim=args.hidden_dim,
            num_heads=args.num_heads,
            intermediate_dim=args.intermediate_dim,
            feature_map=_feature_map(args.feature_map, args.seed),
            conv_size=None,  # the feature map alone, as the example has always trained it
            chunk_size=args.chunk_size,
            dropout=args.dropout,
        )
        model(np.zeros((1, args.sequence_length), "int32"))  # creates the weights
        optimizer = keras.optimizers.AdamW(args.learning_rate, weight_decay=0.01)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    checkpoint = tf.train.Checkpoint(
        # Every variable, listed explicitly: `tf.train.Checkpoint(model=model)` does not reach
        # layers a Keras 3 model holds in a Python list (LinearCausalLM's decoder blocks): their
        # trainable weights would come back only through the optimizer's references, and the
        # non-trainable state (random projections, draw_index, dropout seed state) not at all.
        model_variables={f"{i:04d}": v for i, v in enumerate(model.variables)},
        optimizer_variables={f"{i:04d}": v for i, v in enumerate(optimizer.variables)},
        step=step,
    )

    restored = restore(checkpoint, args.backup_dir)
    start = int(step.numpy())
    if restored and is_chief:
        print(f"resumed from {restored} at step {start}", flush=True)
    manager = None
    if args.backup_dir:
        # Only the chief writes the real directory; the others a scratch one (deleted after each save).
        write_dir = args.backup_dir if is_chief else os.path.join(args.backup_dir, f".worker-{task_id}")
        manager = tf.train.CheckpointManager(checkpoint, directory=write_dir, max_to_keep=1)

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    dist_ds = strategy.experimental_distribute_dataset(stream.skip(start))
    iterator = iter(dist_ds)
    maps = [layer for layer in random_feature_layers(model) if layer.built]

    @tf.function
    def train_step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(loss_fn(y, model(x, training=True)), axis=-1)  # [B]
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                if model.losses:  # e.g. the orthogonal penalty of oglu / ffn
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    def train_loop():
        while int(step.numpy()) < args.steps:
            current = int(step.numpy())
            if args.redraw_every and current > 0 and current % args.redraw_every == 0:
                for layer in maps:  # seeded maps: every worker draws the same matrix
                    layer.redraw()
            loss = train_step(next(iterator))
            step.assign_add(1)
            if args.log_steps and is_chief:
                print(f"step {current + 1} loss {float(loss):.5f}", flush=True)
            if manager is not None and int(step.numpy()) % args.checkpoint_every == 0:
                manager.save(checkpoint_number=int(step.numpy()))
                if not is_chief:
                    shutil.rmtree(manager.directory, ignore_errors=True)

        if manager is not None and manager.latest_checkpoint != manager._checkpoint_prefix + f"-{int(step.numpy())}":
            manager.save(checkpoint_number=int(step.numpy()))  # the final state: a rerun has nothing left to do
            if not is_chief:
                shutil.rmtree(manager.directory, ignore_errors=True)

    try:
        train_loop()
    except PEER_LOST_ERRORS as e:
        if _num_workers() == 1:
            raise
        reason = f"a collective failed ({type(e).__name__}: {_error_summary(e)}): another worker is down or hung"
        print(recovery_message(task_id, _num_workers(), reason, args.backup_dir), file=sys.stderr, flush=True)
        sys.stdout.flush()
        # A plain return would leave TensorFlow's runtime shutting down with the lost peer
        # (it keeps waiting on the lost peer before the process can end).
        os._exit(EXIT_PEER_LOST)

    if is_chief:
        if args.weights_out:
            buffer = {f"w{i}": np.asarray(v) for i, v in enumerate(model.weights)}
            with _atomic.staging_dir(os.path.dirname(os.path.abspath(args.weights_out))) as tmp:
                staged = os.path.join(tmp, "weights.npz")
                np.savez(staged, **buffer)
                _atomic.publish(staged, args.weights_out)
        if args.save:
            with _atomic.staging_dir(os.path.dirname(os.path.abspath(args.save))) as tmp:
                staged = os.path.join(tmp, os.path.basename(args.save))
                model.save(staged)
                _atomic.publish(staged, args.save)
        print("RESULT " + json.dumps({"steps": int(step.numpy()), "replicas": strategy.num_replicas_in_sync}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
