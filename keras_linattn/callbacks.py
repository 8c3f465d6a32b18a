"""Keras callbacks for linear-attention models: random-feature redraws and exact resume."""

import json
import math
import os
import shutil

import keras

from keras_linattn import _atomic, _compat
from keras_linattn._validation import check_bool, check_positive_int

__all__ = ["BackupAndRestore", "RedrawRandomFeatures", "batches_per_epoch", "random_feature_layers"]


# Set on the model by `BackupAndRestore` while it replays the batches of a
# resumed epoch that the backup already contains: ``(epoch, batch)``, the
# first position that is trained again. Other callbacks skip earlier positions.
_RESUME_ATTR = "_kla_resume_position"


def random_feature_layers(model):
    """Every layer inside `model` (itself included) that has a `redraw()` method.

    Walks all sublayers recursively (nested models, attention layers and
    their feature maps); each layer is listed once even when shared.
    """
    found, seen = [], set()
    for layer in _compat.flatten_layers(model, include_self=True, recursive=True):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if callable(getattr(layer, "redraw", None)):
            found.append(layer)
    return found


def batches_per_epoch(steps_per_epoch, steps_per_execution=1):
    """How many batches one epoch of `fit` draws from the data: ``ceil(S / E) * E``.

    Keras 3 (`keras/src/trainers/epoch_iterator.py`) runs the executions
    ``range(0, steps_per_epoch, steps_per_execution)`` per epoch and each
    execution draws `steps_per_execution` batches, so an epoch draws
    ``ceil(S / E) * E`` batches, not ``steps_per_epoch`` when E does not
    divide S (``steps_per_epoch=6, steps_per_execution=4``: 8 batches). With
    ``steps_per_epoch`` set, the next epoch continues the same iterator. A
    resumed `fit` over one repeating stream must therefore skip
    ``initial_epoch * batches_per_epoch(S, E)`` batches
    (`BackupAndRestore.batches_to_skip` computes it from the backup).

    Args:
        steps_per_epoch: the `steps_per_epoch` given to `fit` (positive int).
        steps_per_execution: the `steps_per_execution` given to `compile`.

    Returns:
        int.
    """
    steps_per_epoch = check_positive_int("steps_per_epoch", steps_per_epoch)
    steps_per_execution = check_positive_int("steps_per_execution", steps_per_execution)
    return -(-steps_per_epoch // steps_per_execution) * steps_per_execution


def _steps_per_execution(model):
    return int(getattr(model, "steps_per_execution", 1) or 1)


def _replayed(model, epoch, batch):
    """Whether training position ``(epoch, batch)`` is a replay of a restored backup."""
    resume = getattr(model, _RESUME_ATTR, None)
    return resume is not None and (epoch, batch) < resume


@keras.saving.register_keras_serializable(package="keras_linattn")
class RedrawRandomFeatures(keras.callbacks.Callback):
    """Redraws the random projections of random-feature maps during `fit`.

    Performer-style maps (`"favor+"`, `"favor_trig"`) estimate softmax
    attention with a fixed random projection; redrawing it every few
    hundred steps keeps the model from fitting one particular draw. This
    callback finds every layer of the model that has a ``redraw()`` method
    and calls it before training batch ``n, 2n, 3n, ...`` of the `fit` call,
    counted across epochs from epoch 0 (with ``steps_per_execution > 1``
    Keras calls batch hooks once per execution, so count executions).

    The schedule is a function of the position in `fit` (epoch and batch),
    and each map keeps the number of draws it has made in its ``draw_index``
    weight, so the callback itself holds no state: a run resumed by
    `keras.callbacks.BackupAndRestore` (at an epoch boundary) or by
    `keras_linattn.callbacks.BackupAndRestore` (at any batch) redraws exactly
    the projections the uninterrupted run draws. Maps must be seeded for
    that (``seed=None`` draws from OS entropy). When the number of batches
    per epoch is unknown (a dataset of unknown length without
    ``steps_per_epoch``), batches are counted from the start of the call.

    It acts only in `fit` (`on_train_batch_begin`): `predict` and
    `evaluate` never redraw, so inference is deterministic. The projection
    in use when `fit` returns is the one saved with the model.

    Args:
        every_n_steps: redraw interval in training batches (positive int).

    Example:

    >>> import keras
    >>> import numpy as np
    >>> from keras_linattn import feature_maps, layers
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((8, 16))
    >>> fm = feature_maps.get("favor+", num_features=16, seed=0)
    >>> model = keras.Model(inputs, layers.LinearAttention(2, 8, feature_map=fm)(inputs, inputs))
    >>> model.compile("sgd", "mse")
    >>> x = np.random.default_rng(0).normal(size=(8, 8, 16)).astype("float32")
    >>> redraw = RedrawRandomFeatures(every_n_steps=2)
    >>> _ = model.fit(x, x, epochs=1, batch_size=2, verbose=0, callbacks=[redraw])
    >>> redraw.redraw_count  # before batches 2 and 4 of the 4
    1
    """

    def __init__(self, every_n_steps=1000):
        super().__init__()
        self.every_n_steps = check_positive_int("every_n_steps", every_n_steps)
        self.redraw_count = 0
        self._epoch = 0
        self._counted = 0
        self._redrawn = []

    def on_train_begin(self, logs=None):
        self._epoch = 0
        self._counted = 0
        self._redrawn = random_feature_layers(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _position(self, batch):
        """Index of this execution in the `fit` call, counted from epoch 0."""
        steps = (self.params or {}).get("steps")
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if not steps:
            return self._counted
        return self._epoch * math.ceil(steps / per_execution) + batch // per_execution

    def on_train_batch_begin(self, batch, logs=None):
        position = self._position(batch)
        self._counted += 1
        if _replayed(self.model, self._epoch, batch):
            return  # the restored maps already hold this position's draws
        if position > 0 and position % self.every_n_steps == 0:
            for layer in self._redrawn:
                # Unbuilt maps are templates (e.g. the `feature_map` attribute
                # of LinearCausalLM and of the transformer blocks, which copy
                # it): they hold no projection in use.
                if layer.built:
                    layer.redraw()
            self.redraw_count += 1

    def get_config(self):
        return {"every_n_steps": self.every_n_steps}


def _seed_generators(model):
    """Every `keras.random.SeedGenerator` of the model's layers (dropout masks), in a fixed order."""
    found, seen = [], set()
    for layer in _compat.flatten_layers(model, include_self=True, recursive=True):
        for generator in _compat.seed_generators(layer):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def _first_line(error):
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state during `fit` and resumes exactly where it stopped.

    A drop-in replacement for `keras.callbacks.BackupAndRestore` for runs
    that can be killed at any moment (pre-emptible machines). Run the same
    `fit` again after a crash and it continues from the last backup; the
    final weights equal those of a run that was never interrupted (given the
    same data for each epoch, see below).

    What a backup holds: every model weight (trainable feature-map weights,
    the random-feature projections and their ``draw_index``, so that
    `RedrawRandomFeatures` continues its sequence), the optimizer state
    (slots, iteration count, hence the learning-rate schedule), the state of
    the dropout seed generators, and the position in the data (epoch and
    batch within the epoch).

    Differences from `keras.callbacks.BackupAndRestore` (Keras 3.15):

    - **Mid-epoch resume is exact.** Keras saves the batch index with
      ``save_freq=<int>`` but resumes at the start of the epoch, training
      the epoch's first batches a second time. This callback passes over
      them instead: the first ``batch`` calls of the resumed epoch draw
      their data from the iterator and train nothing (metrics of that epoch
      then cover the trained batches only).
    - **Backups are atomic.** The weights are written to a staging
      directory and renamed into place, then ``latest.json``, which names
      them, is replaced in one rename (the commit). A process killed at any
      moment leaves the previous complete backup or the new one. (Keras
      overwrites ``latest.weights.h5`` in place, then the metadata: a kill
      in between resumes from a torn or mismatched pair.)
    - **A damaged backup is an error naming the file** (ValueError), not a
      silent restart or weights silently loaded wrong: the metadata records
      the size and sha256 of the weights file, checked before loading.
    - Dropout seed-generator states are restored (Keras does not save them).

    The data: a resumed `fit` starts at epoch `initial_epoch` and must get
    the batches the uninterrupted run got from there on. Either make each
    epoch's data a function of the epoch (a ``tf.data`` pipeline that is
    re-created per epoch with a seed derived from the epoch), or, with
    ``steps_per_epoch`` and one repeating stream (shuffled with a fixed
    seed), skip what the finished epochs drew:
    ``stream.skip(backup.batches_to_skip)``, which is ``initial_epoch *
    steps_per_epoch`` only when `steps_per_execution` divides
    `steps_per_epoch` (Keras draws whole executions: see
    `batches_per_epoch`). A backup cannot be resumed with another
    `steps_per_epoch` or `steps_per_execution` (ValueError): the resumed run
    could not follow the uninterrupted one. (Keras' ``fit``
    shuffle of NumPy arrays draws a new permutation per epoch from the
    process' random state, which a new process does not continue: pass
    ``shuffle=False`` or a pipeline.)

    Args:
        backup_dir: directory of the backup (created when needed). Use one
            per training run.
        save_freq: ``"epoch"`` (back up after every epoch) or a positive
            int: back up after every that many training batches.
        delete_checkpoint: remove `backup_dir` when `fit` completes
            (default True, as Keras does).

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> import numpy as np
    >>> keras.utils.set_random_seed(0)
    >>> backup_dir = os.path.join(tempfile.mkdtemp(), "backup")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    >>> backup = BackupAndRestore(backup_dir, delete_checkpoint=False)
    >>> backup.initial_epoch  # no backup yet
    0
    >>> _ = model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0, callbacks=[backup])
    >>> BackupAndRestore(backup_dir).initial_epoch  # a new fit would start after both epochs
    2
    """

    METADATA = "latest.json"
    FORMAT = 1

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise ValueError(f"`backup_dir` must be a non-empty path. Received: backup_dir={backup_dir!r}")
        if save_freq != "epoch":
            try:
                save_freq = check_positive_int("save_freq", save_freq)
            except ValueError:
                raise ValueError(
                    f'`save_freq` must be "epoch" or a positive integer. Received: save_freq={save_freq!r}'
                ) from None
        self.backup_dir = os.fspath(backup_dir)
        if os.path.exists(self.backup_dir) and not os.path.isdir(self.backup_dir):
            raise ValueError(
                f"`backup_dir` must be a directory; a file exists there. Received: backup_dir={backup_dir!r}"
            )
        self.save_freq = save_freq
        self.delete_checkpoint = check_bool("delete_checkpoint", delete_checkpoint)
        self._epoch = 0
        self._since_save = 0
        self._sequence = 0
        self._resume = None
        self._skip = 0

    # ------------------------------------------------------------ reading
    @property
    def metadata_path(self):
        return os.path.join(self.backup_dir, self.METADATA)

    def read_metadata(self):
        """The committed backup's metadata (a dict), or None when there is no backup.

        Raises:
            ValueError: naming the file, when ``latest.json`` is unreadable.
        """
        path = self.metadata_path
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
            for key in ("epoch", "batch", "sequence"):
                if isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 0:
                    raise ValueError(f"{key}={meta[key]!r}")
            if not isinstance(meta["weights"], str) or os.sep in meta["weights"] or "/" in meta["weights"]:
                raise ValueError(f"weights={meta['weights']!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"The backup metadata file is unreadable ({type(e).__name__}: {_first_line(e)}); "
                f"delete the backup directory to start over. Received: path={path!r}"
            ) from e
        return meta

    def resume_point(self):
        """``(epoch, batch)`` where a `fit` with this callback starts: the backup's, or ``(0, 0)``."""
        meta = self.read_metadata()
        return (0, 0) if meta is None else (meta["epoch"], meta["batch"])

    @property
    def initial_epoch(self):
        """The epoch a resumed `fit` starts at (0 without a backup)."""
        return self.resume_point()[0]

    @property
    def batches_to_skip(self):
        """Batches of one repeating stream that the finished epochs drew: ``stream.skip(backup.batches_to_skip)``.

        ``initial_epoch * batches_per_epoch(steps_per_epoch,
        steps_per_execution)`` with the values of the run that wrote the
        backup (0 without a backup). The batches of a partly trained epoch
        are not counted: the callback draws them itself on resume.

        Raises:
            ValueError: for a backup written by an older version (it does not
                record the batches per epoch) or by a `fit` whose number of
                steps per epoch was unknown (each epoch then runs until its
                data ends: re-create the data per epoch instead).
        """
        meta = self.read_metadata()
        if meta is None or meta["epoch"] == 0:
            return 0
        per_epoch = meta.get("batches_per_epoch")
        if isinstance(per_epoch, bool) or not isinstance(per_epoch, int) or per_epoch <= 0:
            raise ValueError(
                "The backup does not record how many batches an epoch drew (written by an older version, or "
                "by a `fit` without a known number of steps per epoch): skip "
                "`initial_epoch * batches_per_epoch(steps_per_epoch, steps_per_execution)` yourself. "
                f"Received: batches_per_epoch={per_epoch!r} in {self.metadata_path!r}"
            )
        return meta["epoch"] * per_epoch

    def _batches_per_epoch(self):
        """``(batches per epoch or None, steps, steps_per_execution)`` of the running `fit`."""
        steps = (self.params or {}).get("steps")
        per_execution = _steps_per_execution(self.model)
        if not steps:
            return None, steps, per_execution
        return batches_per_epoch(steps, per_execution), steps, per_execution

    # ------------------------------------------------------------ restore
    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model: call it on a batch (or `build`) before `fit`. "
                f"Received: an unbuilt model {self.model.name!r}"
            )
        _compat.restore_train_function(self.model)
        self._epoch, self._since_save, self._sequence, self._resume, self._skip = 0, 0, 0, None, 0
        meta = self.read_metadata()
        if meta is None:
            return
        if "batches_per_epoch" in meta:
            per_epoch, steps, per_execution = self._batches_per_epoch()
            saved = (meta.get("steps"), meta.get("steps_per_execution"))
            if (steps, per_execution) != saved:
                raise ValueError(
                    "The backup was written by a `fit` with another number of steps per epoch or steps per "
                    "execution: its positions (data, redraws) do not map onto this run. Resume with "
                    f"steps_per_epoch={saved[0]} and steps_per_execution={saved[1]}, or delete the backup "
                    f"directory to start over. Received: steps_per_epoch={steps}, "
                    f"steps_per_execution={per_execution}, backup {self.metadata_path!r}"
                )
        weights = os.path.join(self.backup_dir, meta["weights"])
        if "weights_digest" in meta:  # HDF5 keeps no checksum of the data: a flipped byte would load
            _atomic.check_digest(weights, meta["weights_digest"], what="The backup weights file")
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        try:
            self.model.load_weights(weights)
        except Exception as e:  # h5py OSError on a truncated file, ValueError on a mismatch, ...
            raise ValueError(
                f"The backup weights could not be loaded ({type(e).__name__}: {_first_line(e)}); "
                f"the backup is damaged or belongs to another model. Received: path={weights!r}"
            ) from e
        generators = _seed_generators(self.model)
        states = meta.get("seed_generators", [])
        if len(states) != len(generators):
            raise ValueError(
                f"The backup holds {len(states)} seed-generator states, the model has {len(generators)}: "
                f"it belongs to another model. Received: path={self.metadata_path!r}"
            )
        for generator, state in zip(generators, states, strict=True):
            generator.state.assign(keras.ops.convert_to_tensor(state, dtype=generator.state.dtype))
        self._sequence = meta["sequence"]
        self._epoch = meta["epoch"]
        _compat.set_initial_epoch(self.model, meta["epoch"] or None)
        if meta["batch"] > 0:
            self._resume = (meta["epoch"], meta["batch"])
            self._skip = meta["batch"]
            setattr(self.model, _RESUME_ATTR, self._resume)
            _wrap_train_function(self.model, self)

    # ------------------------------------------------------------ progress
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._resume is not None and (self._epoch, batch) < self._resume:
            return  # a replayed batch: the state is still the restored one
        if self.save_freq == "epoch":
            return
        per_execution = _steps_per_execution(self.model)
        self._since_save += per_execution  # batch hooks run once per execution
        if self._since_save >= self.save_freq:
            self._since_save = 0
            steps = (self.params or {}).get("steps")
            # `batch` is the execution's last step (Keras passes `end_step`):
            # the epoch's last execution ends at or after step `steps - 1`
            # (``steps_per_epoch=6, steps_per_execution=4``: executions 0-3
            # and 4-7). Testing ``batch + per_execution >= steps`` took the
            # first of them for the last and skipped the epoch's other batches.
            if steps and batch + 1 >= steps:
                # The epoch's last batch: resume at the next epoch. Recording
                # (epoch, steps) would make the resumed fit replay a whole epoch
                # without one training step, and Keras fails reading metrics
                # that were never built.
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        _compat.restore_train_function(self.model)
        if getattr(self.model, _RESUME_ATTR, None) is not None:
            setattr(self.model, _RESUME_ATTR, None)
        _compat.set_initial_epoch(self.model, None)
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    # ------------------------------------------------------------ saving
    def _save(self, epoch, batch):
        os.makedirs(self.backup_dir, exist_ok=True)
        per_epoch, steps, per_execution = self._batches_per_epoch()
        self._sequence += 1
        name = f"backup-{self._sequence:08d}.weights.h5"
        meta = {
            "format": self.FORMAT,
            "epoch": int(epoch),
            "batch": int(batch),
            "sequence": self._sequence,
            "weights": name,
            "steps": steps,
            "steps_per_execution": per_execution,
            "batches_per_epoch": per_epoch,
            "seed_generators": [
                [int(v) for v in keras.ops.convert_to_numpy(g.state).reshape(-1)] for g in _seed_generators(self.model)
            ],
            "keras_version": keras.__version__,
        }
        with _atomic.staging_dir(self.backup_dir) as tmp:
            staged = os.path.join(tmp, name)
            self.model.save_weights(staged)
            meta["weights_digest"] = _atomic.file_digest(staged)
            _atomic.fault_point("backup:weights_staged")
            _atomic.publish(staged, os.path.join(self.backup_dir, name))
            _atomic.fault_point("backup:weights_published")
            staged_meta = os.path.join(tmp, self.METADATA)
            with open(staged_meta, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
            _atomic.publish(staged_meta, self.metadata_path)
        _atomic.fault_point("backup:committed")
        for old in os.listdir(self.backup_dir):
            if old.startswith("backup-") and old.endswith(".weights.h5") and old != name:
                try:
                    os.remove(os.path.join(self.backup_dir, old))
                except FileNotFoundError:
                    pass


def _wrap_train_function(model, backup):
    """Makes the next ``backup._skip`` training batches draw their data and train nothing."""
    per_execution = _steps_per_execution(model)

    def draw(iterator):
        count = min(per_execution, backup._skip)
        if not isinstance(iterator, (list, tuple)):  # the data iterator; a buffer already drawn needs nothing
            for _ in range(count):
                next(iterator)
        backup._skip -= count
        return backup._skip <= 0  # every replayed batch drawn: train again

    # The train function's call form differs per backend: `_compat.replace_train_function`.
    _compat.replace_train_function(model, draw)
