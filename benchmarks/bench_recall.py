"""Recall beyond the window: key-value retrieval by distance, teacher vs its linearized students.

    python -m benchmarks.bench_recall            # full run (21 minutes on one core of a shared 2-core CPU)
    python -m benchmarks.bench_recall --quick    # smoke run (tiny sizes, seconds after the imports)

The task (`generate`): integer tokens from a seeded NumPy generator.
Filler tokens, key tokens and value tokens come from disjoint ranges of the
vocabulary. A row holds `num_pairs` (key, value) pairs (a key token
immediately followed by its value) at free places among the filler, each
key once. A query is the key again; the next token must be its value.
The last token of a row is always a query (position T - 1); the
`num_queries - 1` other queried keys are asked earlier, each followed by its
value (MQAR's layout), which gives training more targets per row. The
distance of a query is its position minus the position of its key in the
pair (the value sits at distance - 1). Scoring counts value predictions
only: the argmax of the logits over the whole vocabulary at the query
position. Training rows score every query; evaluation rows score the last
query only, whose distance is drawn from one bucket at a time:

- inside the window: 2 <= d < W
- 1-4x the window: W <= d < 4W
- 4-32x the window: 4W <= d < min(32W, T)

The teacher: keras-hub `LlamaBackbone` + `LlamaCausalLM` (RoPE, RMSNorm,
SwiGLU, grouped-query attention), random init, trained here with `fit`
(Adam, warm-up + cosine, XLA) on the task's rows, loss on the query
positions only. The rows of the table:

- teacher: the softmax model (its KV cache is T pairs per head and layer);
- LoLCATs student: `linearize(teacher, window_size=W)` (hedgehog maps,
  identity at start), then `attention_transfer` (maps and window gamma);
- ``lolcats_lw``: the same with ``linear_weight`` (``--linear-weight``,
  default 0.001: the learned weight of the linear terms), transferred;
- sliding window alone: the teacher's weights in the window layer with a
  feature map that returns 0 (`examples.linearize.pipeline.window_only`),
  so the linear part is off; no training;
- sparse-cache student: `linearize(teacher, window_size=W, cache_size=N,
  linear_weight=...)` (LoLA), no training, ``W + N = T / 4``;
- ``sparse_cache_unrotated``: the same cache with ``linear_rope=False``
  (the linear part and the self-recall error on unrotated features), no
  training.
- ``sparse_cache_fixed``: the same cache with the length options' settings
  (``linear_rope=False, cache_distance=W``: the linear part and the
  self-recall error on unrotated features, every cached pair scored as if
  W tokens back), no training.
- ``sparse_cache_lolcats``: the same cache on the transferred ``lolcats_lw``
  student's weights (LoLA's setting: a cache added to a LoLCATs model);
- delta-rule student: `linearize(teacher, window_size=None,
  update="delta", normalize=False)` (hedgehog maps, no window: the delta rule
  takes none), then the same attention transfer.

The filler (``--filler``) is uniform random ids (default), a repeated
pattern (``repeat``: the passkey test's haystack) or the standard library's
source (``text``). ``--eval-filler``, ``--eval-pairs`` and
``--eval-queries`` evaluate on other rows than the teacher trains on, e.g.
a few pairs in a haystack for a teacher trained on dense rows.

Every window student uses the same ``window_gamma`` (``--window-gamma``,
default 0.9 as in ``examples/linearize``: LoLCATs' 0.1 starts far from the
teacher, see docs/linearize.md "Window gamma").

Output: ``benchmarks/results/recall.json`` (``--out``): the config, the
teacher's training, every row's accuracy per bucket with its count, the
cache / KV ratio, wall times and the process's peak RSS (VmHWM).

``--cache-sizes`` with ``--pair-counts`` runs the cache-size curve instead
of the rows: dense rows at 4-32x the window, the sparse cache at each size
beside the teacher (`benchmarks.recall_curve`).
"""

import argparse
import json
import os
import platform
import shlex
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks._common import proc_status_bytes  # noqa: E402

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "recall.json")
IGNORE = -1
BUCKET_NAMES = ("inside window", "1-4x window", "4-32x window")
LONG_BUCKET = "32-128x window"  # only in rows longer than 32 W + 1 (``--eval-length``)
FILLERS = ("random", "repeat", "text")
REPEAT_PERIOD = 16

FULL = dict(
    sequence_length=256,
    window_size=8,
    vocabulary_size=256,
    num_pairs=40,
    num_queries=40,
    num_layers=2,
    hidden_dim=128,
    num_heads=4,
    num_key_value_heads=2,
    teacher_steps=2000,
    batch_size=32,
    learning_rate=1e-3,
    num_train=48_000,
    num_eval=256,
    transfer_steps=100,
    transfer_batch_size=8,
    transfer_learning_rate=1e-2,
    eval_batch_size=64,
    jit_compile=True,
)
QUICK = dict(
    sequence_length=64,
    window_size=4,
    vocabulary_size=64,
    num_pairs=4,
    num_queries=2,
    num_layers=1,
    hidden_dim=32,
    num_heads=2,
    num_key_value_heads=1,
    teacher_steps=20,
    batch_size=16,
    learning_rate=1e-3,
    num_train=320,
    num_eval=16,
    transfer_steps=2,
    transfer_batch_size=4,
    transfer_learning_rate=1e-2,
    eval_batch_size=48,
    jit_compile=False,
)


# -------------------------------------------------------------------- the task
def vocabulary_layout(vocabulary_size, filler="random"):
    """Disjoint token ranges ``(filler, keys, values)``, each ``(start, stop)``; id 0 is never used.

    ``filler="text"``: the filler is ASCII text (ids 1-127, the characters'
    codes), keys and values split the ids from 128 up. ``"random"`` and
    ``"repeat"`` take the same ranges.
    """
    if filler not in FILLERS:
        raise ValueError(f"`filler` must be one of {FILLERS}. Received: filler={filler!r}")
    if filler == "text":
        if vocabulary_size < 160:
            raise ValueError(f"Text filler needs `vocabulary_size` >= 160. Received: vocabulary_size={vocabulary_size}")
        keys = (128, 128 + (vocabulary_size - 128) // 2)
        return (1, 128), keys, (keys[1], vocabulary_size)
    if vocabulary_size < 16:
        raise ValueError(f"`vocabulary_size` must be at least 16. Received: vocabulary_size={vocabulary_size}")
    filler = (1, vocabulary_size // 4)
    keys = (filler[1], filler[1] + (vocabulary_size - filler[1]) // 2)
    return filler, keys, (keys[1], vocabulary_size)


def buckets(window_size, sequence_length):
    """``[(name, lo, hi)]``: query distances ``lo <= d < hi`` inside, 1-4x and 4-32x the window.

    Rows longer than ``32 W + 1`` get a fourth bucket, 32-128x the window.
    """
    top = min(32 * window_size, sequence_length - 1)
    out = [(BUCKET_NAMES[0], 2, window_size), (BUCKET_NAMES[1], window_size, 4 * window_size)]
    out.append((BUCKET_NAMES[2], 4 * window_size, top))
    if sequence_length - 1 > 32 * window_size:
        out.append((LONG_BUCKET, 32 * window_size, min(128 * window_size, sequence_length - 1)))
    for name, lo, hi in out:
        if hi <= lo:
            raise ValueError(
                f"The bucket {name!r} is empty ({lo} <= d < {hi}). "
                f"Received: window_size={window_size}, sequence_length={sequence_length}"
            )
    return out


def _free(occupied, *positions):
    return all(0 <= p < len(occupied) and not occupied[p] for p in positions)


def text_codes(max_chars=400_000):
    """The standard library's source as ASCII codes (`uint8` in 1-127; other characters become ``?``)."""
    from examples.char_lm.data import load_stdlib_corpus

    codes = np.frombuffer(load_stdlib_corpus(max_chars).encode("ascii", "replace"), np.uint8).copy()
    codes[codes == 0] = ord("?")
    return codes


def generate(
    num_rows,
    sequence_length,
    *,
    num_pairs,
    num_queries,
    final_distances,
    other_buckets,
    vocabulary_size,
    seed,
    filler="random",
    text=None,
):
    """Rows of the retrieval task (see the module docstring).

    Args:
        final_distances: ``[num_rows]`` ints, the distance of each row's last
            query (at position ``T - 1``) to its key.
        other_buckets: ``[(lo, hi)]``: each earlier query draws a bucket, then
            a distance ``lo <= d < hi`` in it.

        filler: ``"random"`` (uniform filler ids); ``"repeat"``: one fixed
            pattern of `REPEAT_PERIOD` filler ids (drawn from ``seed=0``,
            the same for every call) repeated, from a random phase per row:
            the passkey test's haystack, which a linear state recalls well;
            or ``"text"``: each row a slice of `text` (ASCII codes, see
            `text_codes`). The pairs and queries are written over it.
        text: the codes for ``filler="text"``.

    Returns:
        ``(tokens, targets, distances)``, each ``[num_rows, T]`` int32:
        `targets` is the value at each query position and -1 elsewhere,
        `distances` the query's distance there and -1 elsewhere.
    """
    t = sequence_length
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(f"Need 1 <= num_queries <= num_pairs. Received: {num_queries}, {num_pairs}")
    filler_ids, keys, values = vocabulary_layout(vocabulary_size, filler)
    if keys[1] - keys[0] < num_pairs:
        raise ValueError(f"Too few key tokens ({keys[1] - keys[0]}) for num_pairs={num_pairs}")
    if 2 * num_pairs + 2 * num_queries > (3 * t) // 4:
        raise ValueError(f"num_pairs={num_pairs}, num_queries={num_queries} do not fit in T={t}")
    final_distances = np.asarray(final_distances, np.int64)
    if final_distances.shape != (num_rows,) or final_distances.min() < 2 or final_distances.max() > t - 1:
        raise ValueError(f"`final_distances` must be {num_rows} ints in [2, {t - 1}]")
    rng = np.random.default_rng(seed)
    if filler == "text":
        if text is None or len(text) <= t:
            raise ValueError(f"`filler='text'` needs `text` longer than T={t}")
        starts = rng.integers(0, len(text) - t, size=num_rows)
        tokens = np.stack([text[s : s + t] for s in starts]).astype(np.int32)
    elif filler == "repeat":
        pattern = np.random.default_rng(0).integers(*filler_ids, size=REPEAT_PERIOD)
        phase = rng.integers(0, REPEAT_PERIOD, size=(num_rows, 1))
        tokens = pattern[(phase + np.arange(t)[None]) % REPEAT_PERIOD].astype(np.int32)
    else:
        tokens = rng.integers(*filler_ids, size=(num_rows, t)).astype(np.int32)
    targets = np.full((num_rows, t), IGNORE, np.int32)
    distances = np.full((num_rows, t), IGNORE, np.int32)
    for row in range(num_rows):
        occupied = np.zeros(t, bool)
        row_keys = rng.choice(np.arange(*keys), size=num_pairs, replace=False)
        row_values = rng.integers(*values, size=num_pairs)
        # (key position, query position or None) for each pair; the last query first.
        d = int(final_distances[row])
        placed = [(t - 1 - d, t - 1, d)]
        occupied[[t - 1 - d, t - d, t - 1]] = True
        for _ in range(num_queries - 1):
            for _attempt in range(1000):
                lo, hi = other_buckets[rng.integers(len(other_buckets))]
                d = int(rng.integers(lo, hi))
                if d >= t - 2:
                    continue
                q = int(rng.integers(d, t - 2))  # the query at q, its answer at q + 1 (< t - 1)
                if _free(occupied, q - d, q - d + 1, q, q + 1):
                    occupied[[q - d, q - d + 1, q, q + 1]] = True
                    placed.append((q - d, q, d))
                    break
            else:
                raise RuntimeError(f"Could not place {num_queries} queries in T={t}")
        while len(placed) < num_pairs:  # distractor pairs, never queried
            p = int(rng.integers(0, t - 2))
            if _free(occupied, p, p + 1):
                occupied[[p, p + 1]] = True
                placed.append((p, None, None))
        for (p, q, d), key, value in zip(placed, row_keys, row_values, strict=True):
            tokens[row, p], tokens[row, p + 1] = key, value
            if q is not None:
                tokens[row, q] = key
                targets[row, q], distances[row, q] = value, d
                if q + 1 < t:
                    tokens[row, q + 1] = value
    return tokens, targets, distances


def stratified_distances(num_per_bucket, bucket_list, seed):
    """``num_per_bucket`` distances drawn uniformly in each bucket, bucket after bucket."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(lo, hi, size=num_per_bucket) for _, lo, hi in bucket_list])


_TEXT = {}


def _filler_args(cfg, filler=None):
    filler = filler or cfg.get("filler", "random")
    if filler != "text":
        return {"filler": filler}
    if "codes" not in _TEXT:
        _TEXT["codes"] = text_codes()
    return {"filler": filler, "text": _TEXT["codes"]}


def training_rows(cfg, num_rows, seed):
    bucket_list = buckets(cfg["window_size"], cfg["sequence_length"])
    pairs = [(lo, hi) for _, lo, hi in bucket_list]
    rng = np.random.default_rng(seed)
    final = np.array([rng.integers(*pairs[rng.integers(len(pairs))]) for _ in range(num_rows)])
    return generate(
        num_rows,
        cfg["sequence_length"],
        num_pairs=cfg["num_pairs"],
        num_queries=cfg["num_queries"],
        final_distances=final,
        other_buckets=pairs,
        vocabulary_size=cfg["vocabulary_size"],
        seed=seed + 1,
        **_filler_args(cfg),
    )


def eval_length(cfg):
    """The evaluation rows' length: ``eval_length`` where the config has one, else the training length."""
    return cfg.get("eval_length") or cfg["sequence_length"]


def evaluation_rows(cfg, seed=1):
    """``num_eval`` rows per bucket; only the last query is scored.

    The rows' filler, pairs and queries are ``eval_filler``,
    ``eval_num_pairs`` and ``eval_num_queries`` where the config has them
    (e.g. a few pairs in a repeated haystack, the passkey setting, for a
    teacher trained on dense rows), else the training rows'.
    """
    t = eval_length(cfg)
    bucket_list = buckets(cfg["window_size"], t)
    final = stratified_distances(cfg["num_eval"], bucket_list, seed)
    tokens, targets, distances = generate(
        len(final),
        t,
        num_pairs=cfg.get("eval_num_pairs") or cfg["num_pairs"],
        num_queries=cfg.get("eval_num_queries") or cfg["num_queries"],
        final_distances=final,
        other_buckets=[(lo, hi) for _, lo, hi in bucket_list],
        vocabulary_size=cfg["vocabulary_size"],
        seed=seed + 1,
        **_filler_args(cfg, cfg.get("eval_filler")),
    )
    return tokens, targets[:, -1], distances[:, -1]


# ------------------------------------------------------------------- the models
def as_inputs(tokens):
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


def build_teacher(cfg, seed=0):
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=cfg["vocabulary_size"],
        num_layers=cfg["num_layers"],
        num_query_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        hidden_dim=cfg["hidden_dim"],
        intermediate_dim=2 * cfg["hidden_dim"],
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def train_teacher(teacher, cfg, log, seed=0):
    import keras

    tokens, targets, _ = training_rows(cfg, cfg["num_train"], seed=10_000 + seed)
    weights = (targets != IGNORE).astype("float32")
    labels = np.where(targets == IGNORE, 0, targets)
    steps = cfg["teacher_steps"]
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, steps, alpha=0.1, warmup_target=cfg["learning_rate"], warmup_steps=max(1, steps // 10)
    )
    teacher.compile(
        optimizer=keras.optimizers.Adam(schedule, clipnorm=1.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        jit_compile=cfg["jit_compile"],
        sampler="greedy",
    )
    batch = cfg["batch_size"]
    epochs = min(10, steps)  # ten points on the training curve
    start = time.perf_counter()

    def epoch_end(epoch, logs):
        log(
            f"teacher epoch {epoch + 1}/{epochs}: loss {logs['loss']:.3f}, accuracy {logs['accuracy']:.3f}, "
            f"{time.perf_counter() - start:.0f} s"
        )
        if cfg.get("save_teacher"):  # after every epoch: a run stopped by a time limit keeps its teacher
            teacher.save_weights(cfg["save_teacher"])

    progress = keras.callbacks.LambdaCallback(on_epoch_end=epoch_end)
    fit = dict(epochs=epochs, verbose=0, callbacks=[progress])
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((as_inputs(tokens), labels, weights))
        data = data.shuffle(len(tokens), seed=0).repeat().batch(batch, drop_remainder=True).prefetch(2)
        history = teacher.fit(data, steps_per_epoch=steps // epochs, **fit)
    else:
        # keras-hub's CausalLM.fit converts arrays through tf.data (or grain); a functional model around
        # the teacher trains the same weights from NumPy arrays on any backend, TensorFlow not installed.
        inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")}
        wrapper = keras.Model(inputs, teacher(inputs))
        wrapper.compile(
            optimizer=teacher.optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            jit_compile=cfg["jit_compile"],
        )
        per_epoch = steps // epochs
        rows = per_epoch * batch * epochs
        reps = -(-rows // len(tokens))  # the rows repeat as tf.data's .repeat() does
        order = np.concatenate([np.random.default_rng(r).permutation(len(tokens)) for r in range(reps)])[:rows]
        history = wrapper.fit(
            as_inputs(tokens[order]),
            labels[order],
            sample_weight=weights[order],
            batch_size=batch,
            shuffle=False,
            **fit,
        )
    steps = epochs * (steps // epochs)
    wall = time.perf_counter() - start
    log(f"teacher: {steps} steps in {wall:.0f} s, last epoch train accuracy {history.history['accuracy'][-1]:.3f}")
    return {
        "steps": steps,
        "rows_seen": steps * batch,
        "wall_s": wall,
        "train_loss": [float(x) for x in history.history["loss"]],
        "train_accuracy": [float(x) for x in history.history["accuracy"]],
    }


def attention_layers(model):
    from examples.linearize.pipeline import attention_layers as layers

    return layers(model)


def transfer(student, teacher, cfg, seed, objective="output", freeze=None):
    """LoLCATs attention transfer on the task's rows (feature maps and window gamma only).

    ``objective`` and ``freeze`` as `keras_linattn.attention_transfer`'s.
    """
    import tensorflow as tf

    import keras_linattn

    tokens, _, _ = training_rows(cfg, cfg["transfer_steps"] * cfg["transfer_batch_size"], seed=seed)
    data = tf.data.Dataset.from_tensor_slices(as_inputs(tokens)).batch(cfg["transfer_batch_size"]).repeat()
    pairs = list(zip(attention_layers(teacher), attention_layers(student), strict=True))
    _, history = keras_linattn.attention_transfer(
        student,
        teacher,
        data,
        steps=1,
        epochs=cfg["transfer_steps"],
        learning_rate=cfg["transfer_learning_rate"],
        pairs=pairs,
        verbose=0,
        objective=objective,
        freeze=freeze,
    )
    losses = history.history["loss"]
    return {
        "steps": cfg["transfer_steps"],
        "objective": objective,
        "freeze": list(freeze or ()),
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
    }


def prediction_function(model):
    """``f(token_ids [B, T]) -> [B]``: the argmax over the vocabulary at the last position (traced once per shape)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        @tf.function(reduce_retracing=True)
        def last_prediction(x):
            logits = model({"token_ids": x, "padding_mask": tf.ones_like(x)}, training=False)  # [B, T, V]
            return tf.argmax(logits[:, -1], axis=-1, output_type=tf.int32)
    else:

        def last_prediction(x):
            logits = model(as_inputs(x), training=False)  # [B, T, V]
            return keras.ops.argmax(logits[:, -1], axis=-1)

    return last_prediction


def last_predictions(model, tokens, cfg, predict=None):
    """``[rows]`` int: the argmax over the vocabulary at each row's last position, ``eval_batch_size`` rows a call.

    ``predict``: `prediction_function(model)`, to reuse its trace across calls (default: a new one).
    """
    last_prediction = predict or prediction_function(model)
    predictions = []
    size = cfg["eval_batch_size"]
    for start in range(0, len(tokens), size):
        predictions.append(np.asarray(last_prediction(tokens[start : start + size])))
    return np.concatenate(predictions)


def accuracy_by_bucket(model, tokens, targets, distances, cfg):
    """``({bucket: accuracy}, {bucket: count})`` of the last-position value predictions."""
    correct = last_predictions(model, tokens, cfg) == targets
    acc, count = {}, {}
    for name, lo, hi in buckets(cfg["window_size"], eval_length(cfg)):
        sel = (distances >= lo) & (distances < hi)
        acc[name], count[name] = float(correct[sel].mean()), int(sel.sum())
    acc["all"], count["all"] = float(correct.mean()), int(correct.size)
    return acc, count


# ------------------------------------------------------------------------ main
ROWS = (
    "teacher",
    "lolcats",
    "lolcats_lw",
    "window_only",
    "sparse_cache",
    "sparse_cache_unrotated",
    "sparse_cache_fixed",
    "sparse_cache_lolcats",
    "delta",
    "sparse_cache_clamped",
    "sparse_cache_clamped_output",
    "sparse_cache_clamped_attention",
    "sparse_cache_clamped_both",
)
ROW_TITLES = {
    "teacher": "teacher (softmax, full KV cache)",
    "lolcats": "LoLCATs: hedgehog + window, attention transfer",
    "lolcats_lw": "LoLCATs with a small linear weight, attention transfer",
    "window_only": "sliding window alone (linear part 0)",
    "sparse_cache": "sparse cache (LoLA), small linear weight, no training",
    "sparse_cache_unrotated": "sparse cache, unrotated linear part, no training",
    "sparse_cache_fixed": "sparse cache, unrotated linear part, cache scored at distance W, no training",
    "sparse_cache_lolcats": "sparse cache (LoLA) on the small-linear-weight LoLCATs maps",
    "delta": "delta rule (hedgehog, no window), attention transfer",
    "sparse_cache_clamped": "sparse cache, unrotated linear part, cache at distance min(d, T), no training",
    "sparse_cache_clamped_output": "the min(d, T) cache after output-MSE transfer (gamma, linear weight frozen)",
    "sparse_cache_clamped_attention": "the min(d, T) cache after attention-weight transfer (gamma, weight frozen)",
    "sparse_cache_clamped_both": "the min(d, T) cache after output + attention transfer (gamma, weight frozen)",
}
# The min(d, L) cache's transferred rows: the objective of each (gamma and the linear weight frozen by default:
# `--transfer-freeze`).
_CLAMPED_OBJECTIVE = {
    "sparse_cache_clamped_output": "output",
    "sparse_cache_clamped_attention": "attention",
    "sparse_cache_clamped_both": "both",
}
# Rows built from another row's trained student (its weights copied; the cache itself is not trained).
_BASE_ROW = {"sparse_cache_lolcats": "lolcats_lw"}
_TRANSFERRED = ("lolcats", "lolcats_lw", "delta")


def make_student(name, teacher, cfg):
    import keras_linattn

    w, gamma, lw = cfg["window_size"], cfg["window_gamma"], cfg["linear_weight"]
    if name == "lolcats":
        return keras_linattn.linearize(teacher, window_size=w, window_gamma=gamma)
    if name == "lolcats_lw":
        return keras_linattn.linearize(teacher, window_size=w, window_gamma=gamma, linear_weight=lw)
    if name == "window_only":
        from examples.linearize.pipeline import window_only

        student = window_only(teacher, w)  # gamma cancels with a zero linear part
        return student
    if name in ("sparse_cache", "sparse_cache_lolcats"):
        n = cfg["cache_size"]
        return keras_linattn.linearize(teacher, window_size=w, cache_size=n, window_gamma=gamma, linear_weight=lw)
    if name in ("sparse_cache_unrotated", "sparse_cache_fixed"):  # the length options' settings
        fixed = {"cache_distance": w} if name == "sparse_cache_fixed" else {}  # no RoPE distance past W
        n = cfg["cache_size"]
        return keras_linattn.linearize(
            teacher, window_size=w, cache_size=n, window_gamma=gamma, linear_weight=lw, linear_rope=False, **fixed
        )
    if name == "sparse_cache_clamped" or name in _CLAMPED_OBJECTIVE:  # real distance up to T, T beyond
        n, bound = cfg["cache_size"], cfg["sequence_length"]
        return keras_linattn.linearize(
            teacher,
            window_size=w,
            cache_size=n,
            window_gamma=gamma,
            linear_weight=lw,
            linear_rope=False,
            cache_max_distance=bound,
        )
    if name == "delta":
        return keras_linattn.linearize(teacher, window_size=None, update="delta", normalize=False)
    raise ValueError(f"Unknown row {name!r}")


def get_teacher(cfg, log):
    """``(teacher, its training record)``: loaded from ``cfg["load_teacher"]``, else trained (and saved if asked)."""
    seed = cfg.get("seed", 0)
    teacher = build_teacher(cfg, seed=seed)
    if cfg.get("load_teacher"):
        teacher(as_inputs(np.ones((1, 8), "int32")))
        teacher.load_weights(cfg["load_teacher"])
        return teacher, {"loaded_from": cfg["load_teacher"]}
    record = train_teacher(teacher, cfg, log, seed=seed)
    if cfg.get("save_teacher"):
        teacher.save_weights(cfg["save_teacher"])
        record["saved_to"] = cfg["save_teacher"]
    return teacher, record


def run(cfg, rows, log):
    import keras

    started = time.perf_counter()
    out = {"rows": []}
    seed = cfg.get("seed", 0)  # the teacher's init, its training rows, each student's transfer rows
    teacher, out["teacher_training"] = get_teacher(cfg, log)
    tokens, targets, distances = evaluation_rows(cfg)
    built = {}

    def trained(name):
        """The row's student, its attention transfer done once (a base row is shared)."""
        if name not in built:
            keras.utils.set_random_seed(1 + seed)
            model = make_student(name, teacher, cfg)
            info = transfer(model, teacher, cfg, seed=20_000 + seed) if name in _TRANSFERRED else None
            if name in _CLAMPED_OBJECTIVE:
                frozen = cfg.get("transfer_freeze", ("gamma", "linear_weight"))
                objective = _CLAMPED_OBJECTIVE[name]
                info = transfer(model, teacher, cfg, seed=20_000 + seed, objective=objective, freeze=frozen)
            built[name] = (model, info)
        return built[name]

    for name in rows:
        start = time.perf_counter()
        record = {"name": name, "title": ROW_TITLES[name]}
        if name == "teacher":
            model = teacher
        elif name in _BASE_ROW:
            base, info = trained(_BASE_ROW[name])
            model = make_student(name, teacher, cfg)
            model.set_weights(base.get_weights())  # the same weights in the same order; the cache adds none
            record["weights_from"] = _BASE_ROW[name]
        else:
            model, info = trained(name)
            if info is not None:
                record["transfer"] = info
        record["build_and_train_s"] = time.perf_counter() - start
        record["accuracy"], record["count"] = accuracy_by_bucket(model, tokens, targets, distances, cfg)
        record["wall_s"] = time.perf_counter() - start
        cells = ", ".join(f"{k} {v:.3f}" for k, v in record["accuracy"].items())
        log(f"{name}: {cells} ({record['wall_s']:.0f} s)")
        out["rows"].append(record)
    out["total_wall_s"] = time.perf_counter() - started
    return out


def render_table(results):
    names = [n for n, _, _ in results["buckets"]]
    lines = ["| model | " + " | ".join(names) + " | all |", "|---" + "|---:" * (len(names) + 1) + "|"]
    for r in results["rows"]:
        cells = [f"{r['accuracy'][n]:.3f}" for n in [*names, "all"]]
        lines.append(f"| {r['title']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_recall",
        description="Key-value recall by distance (inside, 1-4x, 4-32x the window) of a keras-hub Llama teacher "
        "trained here and its linearized students.",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {ROWS}")
    p.add_argument(
        "--filler",
        choices=FILLERS,
        default="random",
        help="what fills the rows between the pairs: uniform random ids, a repeated pattern (the passkey "
        "test's haystack), or the standard library's source text",
    )
    p.add_argument("--sequence-length", type=int, default=None, help="the teacher's training length (default 256)")
    p.add_argument("--window-size", type=int, default=None, help="the students' window W (default 8)")
    p.add_argument("--num-pairs", type=int, default=None, help="key-value pairs per row")
    p.add_argument(
        "--eval-length", type=int, default=None, help="the evaluation rows' length (default: the training length)"
    )
    p.add_argument(
        "--eval-filler", choices=FILLERS, default=None, help="the evaluation rows' filler (default: --filler)"
    )
    p.add_argument("--eval-pairs", type=int, default=None, help="pairs per evaluation row (default: --num-pairs)")
    p.add_argument("--eval-queries", type=int, default=None, help="queries per evaluation row (default: --num-queries)")
    p.add_argument("--num-queries", type=int, default=None, help="queried pairs per row (the last at T - 1)")
    p.add_argument("--teacher-steps", type=int, default=None)
    p.add_argument("--transfer-steps", type=int, default=None)
    p.add_argument("--num-eval", type=int, default=None, help="evaluation rows per bucket")
    p.add_argument("--cache-size", type=int, default=None, help="sparse cache N (default T/4 - W)")
    p.add_argument("--window-gamma", type=float, default=0.9)
    p.add_argument(
        "--linear-weight",
        type=float,
        default=0.001,
        help="initial linear weight of the *_lw and sparse-cache rows (the LoLCATs row keeps 1)",
    )
    p.add_argument(
        "--transfer-freeze",
        default="gamma,linear_weight",
        help="what the sparse_cache_clamped_{output,attention,both} rows leave untrained: a comma list of gamma, "
        "linear_weight, or '' for neither (default both)",
    )
    p.add_argument("--no-jit", action="store_true", help="train the teacher without XLA")
    p.add_argument(
        "--seed", type=int, default=0, help="teacher init, training and transfer rows (evaluation rows stay fixed)"
    )
    p.add_argument("--save-teacher", default=None, help="write the trained teacher's weights (.weights.h5)")
    p.add_argument("--load-teacher", default=None, help="load the teacher's weights instead of training it")
    p.add_argument(
        "--cache-sizes",
        default=None,
        help="the cache-size curve instead of the rows (benchmarks/recall_curve.py): comma list of cache sizes",
    )
    p.add_argument("--pair-counts", default=None, help="the curve's pairs per evaluation row, comma list")
    p.add_argument("--curve-students", default=None, help="the curve's cache students (default both)")
    p.add_argument("--out", default=None, help="default benchmarks/results/recall.json (the curve: recall_curve.json)")
    args = p.parse_args(argv)
    if args.cache_sizes or args.pair_counts or args.curve_students:
        from benchmarks import recall_curve

        recall_curve.check_args(p, args)
    args.out = args.out or (RESULTS_PATH if not args.cache_sizes else recall_curve.RESULTS_PATH)
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.freeze = tuple(part.strip() for part in args.transfer_freeze.split(",") if part.strip())
    if set(args.freeze) - {"gamma", "linear_weight"}:
        p.error(f"--transfer-freeze takes gamma and linear_weight; received {args.transfer_freeze!r}")
    unknown = sorted(set(args.row_list) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    return args


def config_from_args(args):
    cfg = dict(QUICK if args.quick else FULL)
    cfg["filler"] = args.filler
    cfg["eval_length"] = args.eval_length
    cfg["eval_filler"], cfg["eval_num_pairs"], cfg["eval_num_queries"] = (
        args.eval_filler,
        args.eval_pairs,
        args.eval_queries,
    )
    for key in (
        "sequence_length",
        "window_size",
        "num_pairs",
        "num_queries",
        "teacher_steps",
        "transfer_steps",
        "num_eval",
    ):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if args.no_jit:
        cfg["jit_compile"] = False
    t, w = cfg["sequence_length"], cfg["window_size"]
    cfg["cache_size"] = args.cache_size if args.cache_size is not None else t // 4 - w
    cfg["window_gamma"] = args.window_gamma
    cfg["linear_weight"] = args.linear_weight
    cfg["save_teacher"], cfg["load_teacher"] = args.save_teacher, args.load_teacher
    cfg["seed"] = args.seed
    cfg["transfer_freeze"] = args.freeze
    return cfg


def main(argv=None):
    args = parse_args(argv)
    cfg = config_from_args(args)
    import keras

    try:
        import tensorflow as tf

        tf_version = tf.__version__
    except ImportError:  # the teacher trains on JAX without TensorFlow
        tf_version = None

    def log(msg):
        print(f"[bench_recall] {msg}", flush=True)

    t, w, n = eval_length(cfg), cfg["window_size"], cfg["cache_size"]  # the KV cache at the evaluated length
    results = {
        "command": "python -m benchmarks.bench_recall " + shlex.join(sys.argv[1:] if argv is None else argv),
        "environment": {
            "python": platform.python_version(),
            "tensorflow": tf_version,
            "keras": keras.__version__,
            "backend": keras.backend.backend(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "config": cfg,
        "buckets": buckets(w, t),
        "memory": {
            "teacher_kv_pairs_per_head": t,
            "window": w,
            "cache_size": n,
            "cache_over_kv": n / t,
            "window_plus_cache_over_kv": (w + n) / t,
        },
    }
    if args.cache_sizes:
        from benchmarks import recall_curve

        return recall_curve.main(args, cfg, results, log)
    results.update(run(cfg, args.row_list, log))
    results["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(render_table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
