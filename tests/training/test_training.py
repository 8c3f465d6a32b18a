"""Training at scale: XLA for every layer and feature map, tracing, mixed precision, MirroredStrategy."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn.feature_maps.random_features import RandomFeatureMap
from keras_linattn.layers import (
    EfficientAttention,
    LinearAttention,
    LinearAttentionCell,
    LinearTransformerDecoder,
    LinearTransformerEncoder,
)
from keras_linattn.models import LinearCausalLM
from tests._helpers import layer_conditioning
from tests.conftest import TEST_SEED
from tests.tolerance import assert_close, bound
from tests.training import _lm_runs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _toy_regression(seed=0, batch=8, length=10, dim=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, length, dim)).astype("float32")
    # Target: a causal running mean of a projection of the inputs.
    w = rng.normal(size=(dim, 2)).astype("float32")
    y = np.cumsum(x @ w, axis=1) / np.arange(1, length + 1, dtype="float32")[None, :, None]
    return x, y.astype("float32")


def _feature_map(name):
    """The registered map ``name``; random-projection maps get an explicit seed."""
    fm = feature_maps.get(name)
    return feature_maps.get(name, seed=0) if isinstance(fm, RandomFeatureMap) else fm


def _attention_model(feature_map, length=10, dim=8, causal=True):
    inp = keras.Input((length, dim))
    h = LinearAttention(2, 4, feature_map=feature_map, chunk_size=4)(inp, inp, use_causal_mask=causal)
    out = keras.layers.Dense(2)(h)
    return keras.Model(inp, out)


def _n_attention(att, length=10, dim=8):
    """Reduction length of a LinearAttention output: dim (q/k/v projections) +
    D (the map's own projection) + S keys + C features + H*M (output projection)."""
    return dim + att.key_dim + length + att.feature_dim + att.num_heads * att.value_dim


def _overfit_and_check(model, x, y, n, conditioning=lambda: 1.0, steps=30):
    """Fits on one batch with XLA; checks XLA stayed on, the loss fell, and the
    XLA-compiled forward pass equals the eager one within the float32 error
    model for reduction length ``n`` (``conditioning()``: of the trained weights)."""
    assert model.jit_compile is True  # No layer switched XLA off.
    # One full-batch step per epoch: the loss logged for epoch k is the XLA train
    # step's loss at the weights after k - 1 updates, so epoch 1 logs the initial
    # loss and epoch steps + 1 the loss after `steps` updates (no separate
    # evaluate: one XLA compile fewer).
    history = model.fit(x, y, batch_size=len(x), epochs=steps + 1, verbose=0, shuffle=False)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    before = losses[0]
    # Learning criterion (seeded): 30 full-batch steps remove over 30% of the loss.
    assert losses[-1] < 0.7 * before, (before, losses[-1])
    # The XLA-compiled prediction of the trained weights equals the eager
    # forward pass: two float32 computations (paths=2).
    xla_pred = model.predict(x, batch_size=len(x), verbose=0)
    eager_pred = np.asarray(keras.Model(model.input, model.output)(x))
    assert_close(xla_pred, eager_pred, n=n, conditioning=conditioning(), paths=2)


# ---------------------------------------------------------------------------
# XLA fit for every registered feature map (maps added later are picked up).


# elu in `make test`, every map in `make test-slow`. The XLA fit of one map of
# each other kind runs in `make test` in that map's own file: favor+ in
# test_favor.py::test_fit_with_xla, aoglu in test_trainable_kernels.py::test_fit_with_xla,
# hedgehog in test_hedgehog.py::test_fit_with_xla_trains_the_kernels.
FAST_XLA_MAPS = {"elu"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=() if name in FAST_XLA_MAPS else pytest.mark.slow) for name in feature_maps.available()],
)
def test_fit_jit_compile_each_feature_map(name):
    keras.utils.set_random_seed(0)
    x, y = _toy_regression()
    model = _attention_model(_feature_map(name))
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=True)
    att = model.layers[1]
    n = _n_attention(att) + 8  # + dim: the Dense(2) head
    _overfit_and_check(model, x, y, n, lambda: layer_conditioning(att, x, x, causal=True))


def test_expected_feature_maps_are_registered():
    # The examples, docs and the tests below rely on these; fail loudly, never skip.
    for name in ("elu", "relu", "taylor", "favor+", "favor_trig", "ffn", "glu", "oglu", "aoglu", "hedgehog"):
        assert name in feature_maps.available(), (name, feature_maps.available())


# ---------------------------------------------------------------------------
# XLA fit for every layer and the causal LM.


# Each builder returns (model, n): n is the reduction length of the model's
# output on [10, 8] inputs; every model ends with a Dense(2) over 8 (+ 8).


def _encoder_model():
    inp = keras.Input((10, 8))
    block = LinearTransformerEncoder(2, 16, feature_map="elu", chunk_size=4)
    model = keras.Model(inp, keras.layers.Dense(2)(block(inp)))
    # 8 (layer norm) + attention + 8 (layer norm) + 8 (feed-forward input) + 16 (intermediate)
    return model, 8 + _n_attention(block.attention) + 8 + 8 + 16 + 8


def _decoder_model():
    inp = keras.Input((10, 8))
    block = LinearTransformerDecoder(2, 16, feature_map="elu", chunk_size=4)
    model = keras.Model(inp, keras.layers.Dense(2)(block(inp)))
    return model, 8 + _n_attention(block.attention) + 8 + 8 + 16 + 8  # as the encoder


def _efficient_attention_model():
    inp = keras.Input((10, 8))
    h = EfficientAttention(2, 4)(inp, inp)
    # 8 (projections) + D (query softmax) + S (key softmax over the sequence)
    # + S (context sum over keys) + D (query times context) + H*M (output projection)
    return keras.Model(inp, keras.layers.Dense(2)(h)), 8 + 4 + 10 + 10 + 4 + 2 * 4 + 8


def _rnn_cell_model():
    inp = keras.Input((10, 8))
    att = LinearAttention(2, 4, feature_map="elu")
    h = keras.layers.RNN(LinearAttentionCell(att), return_sequences=True)(inp)
    return keras.Model(inp, keras.layers.Dense(2)(h)), _n_attention(att) + 8


# The decoder in `make test-slow`: its XLA fit runs in `make test` inside the
# causal LM (test_fit_jit_compile_causal_lm: a stack of LinearTransformerDecoder).
@pytest.mark.parametrize(
    "build",
    [_encoder_model, pytest.param(_decoder_model, marks=pytest.mark.slow), _efficient_attention_model, _rnn_cell_model],
    ids=["encoder", "decoder", "efficient_attention", "rnn_cell"],
)
def test_fit_jit_compile_each_layer(build):
    keras.utils.set_random_seed(0)
    x, y = _toy_regression()
    model, n = build()
    model.compile(keras.optimizers.Adam(1e-2), "mse", jit_compile=True)
    _overfit_and_check(model, x, y, n)  # positive (elu, softmax) kernels: conditioning 1


def test_fit_jit_compile_causal_lm():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 12, size=(4, 17)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    lm = LinearCausalLM(vocabulary_size=12, num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=32, chunk_size=4)
    lm.compile(
        keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True
    )
    assert lm.jit_compile is True
    history = lm.fit(x, y, batch_size=4, epochs=40, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    # Learning criterion (seeded): 40 full-batch steps halve the loss.
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])


# ---------------------------------------------------------------------------
# One trace for a fixed padded length.


class _TraceCounter(keras.layers.Layer):
    """Identity layer counting how often its Python `call` runs (= traces once compiled)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.count = 0

    def call(self, x):
        self.count += 1
        return x


def test_fixed_padded_length_traces_once():
    keras.utils.set_random_seed(0)
    counter = _TraceCounter()
    inp = keras.Input((None,), dtype="int32")
    mask = keras.layers.Lambda(lambda t: keras.ops.not_equal(t, 0))(inp)
    h = keras.layers.Embedding(20, 8)(inp)
    h = counter(h)
    h = LinearAttention(2, 4, chunk_size=4)(h, h, key_mask=mask)
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h, mask=mask))
    model = keras.Model(inp, out)
    built = counter.count  # the symbolic call of the functional model
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)

    rng = np.random.default_rng(0)

    def padded_batches(num, length=12):
        # Sequences of random lengths, all padded to the same `length`.
        x = np.zeros((num, length), "int32")
        for i in range(num):
            n = rng.integers(3, length + 1)
            x[i, :n] = rng.integers(1, 20, size=n)
        return x, rng.integers(0, 2, size=num)

    x, y = padded_batches(40)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 5 batches
    traces = counter.count
    # At most two traces of the train step, whatever the number of batches: a
    # tf.function whose first trace creates variables (the optimizer's) is
    # traced once more without creating them.
    assert 1 <= traces - built <= 2
    x2, y2 = padded_batches(48)
    model.fit(x2, y2, batch_size=8, epochs=3, verbose=0)  # 18 more batches of the same shape
    assert counter.count == traces


# ---------------------------------------------------------------------------
# Mixed precision.


def _mixed_model(feature_map):
    inp = keras.Input((16, 8))
    h = keras.layers.Dense(16)(inp)
    h = LinearAttention(2, 8, feature_map=feature_map, chunk_size=8)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(h)
    out = keras.layers.Dense(2, dtype="float32")(h)
    return keras.Model(inp, out)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize(
    "name", ["elu", pytest.param("favor+", marks=pytest.mark.slow), pytest.param("oglu", marks=pytest.mark.slow)]
)
def test_mixed_precision_200_steps_stable(policy, name):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    x, y = _toy_regression(batch=32, length=16)
    model = _mixed_model(feature_maps.get(name))
    compute = "bfloat16" if policy == "mixed_bfloat16" else "float16"
    assert model.layers[1].compute_dtype == compute
    model.compile(keras.optimizers.Adam(3e-3), "mse", jit_compile=True)
    if policy == "mixed_float16":
        # Keras 3 wraps the optimizer in a LossScaleOptimizer under mixed_float16.
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    else:
        assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)

    def full_batch_mse():
        # The mean squared error of the float32 outputs over the whole set (what evaluate reports),
        # from an eager call: the XLA-compiled path under test is the train step.
        return float(np.mean((np.asarray(model(x), "float64") - y) ** 2))

    first = full_batch_mse()

    batch_losses = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batch_losses.append(logs["loss"]))
    # 50 reshuffled passes over the 32 examples in batches of 8 (200 steps), as one epoch of a
    # repeated dataset: 50 epochs of fit would build 50 iterators around the same compiled step.
    passes = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=0, reshuffle_each_iteration=True)
    model.fit(passes.repeat().batch(8), epochs=1, steps_per_epoch=200, verbose=0, callbacks=[record])
    assert len(batch_losses) == 200
    assert np.all(np.isfinite(batch_losses))
    for w in model.weights:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(w, "float32")))), w.path
    last = full_batch_mse()
    # Learning criterion (seeded): 200 steps remove over 40% of the loss.
    assert np.isfinite(last) and last < 0.6 * first, (first, last)
    if policy == "mixed_float16":
        scale = float(keras.ops.convert_to_numpy(model.optimizer.dynamic_scale))
        assert np.isfinite(scale) and scale >= 1.0


# ---------------------------------------------------------------------------
# tf.distribute.MirroredStrategy over 2 logical CPU devices (a subprocess: the
# logical devices must be configured before TensorFlow initializes devices).
# One subprocess for a functional classifier and for LinearCausalLM
# (tests/training/_lm_runs.py: fit, evaluate, mid-epoch resume).

_MIRRORED_SCRIPT = (
    textwrap.dedent(
        """
    import json, os
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    import keras
    import numpy as np
    from keras_linattn.layers import LinearAttention

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 12, 8)).astype("float32")
    y = rng.normal(size=(16, 12, 2)).astype("float32")

    def build(feature_map):
        keras.utils.set_random_seed(0)
        inp = keras.Input((12, 8))
        h = LinearAttention(2, 4, feature_map=feature_map, chunk_size=4)(inp, inp, use_causal_mask=True)
        return keras.Model(inp, keras.layers.Dense(2)(h))

    def first_step(model):
        losses = []
        cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
        return losses[0], [np.asarray(w) for w in model.get_weights()]

    def flat(weights):
        return np.concatenate([np.ravel(w) for w in weights]).tolist()

    out = {}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out["replicas"] = strategy.num_replicas_in_sync
    for name in ("elu", "oglu"):
        single = build(name)
        single.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
        init = single.get_weights()
        pred = np.asarray(single(x), np.float64)  # the first step's predictions
        loss1, w1 = first_step(single)
        with strategy.scope():
            dist = build(name)
            dist.set_weights(init)
            dist.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=False)
        loss2, w2 = first_step(dist)
        out[name] = {
            "loss_single": loss1,
            "loss_mirrored": loss2,
            # mean 2 |r p| over the loss: its condition number w.r.t. the predictions p (r = p - y)
            "loss_conditioning": float(np.mean(2 * np.abs((pred - y) * pred)) / loss1),
            "init": flat(init),
            "single": flat(w1),
            "mirrored": flat(w2),
            "num_losses": len(single.losses),
        }
    """
    )
    + _lm_runs.TF_LM_SCRIPT
    + 'print("RESULT " + json.dumps(out))\n'
)

# Reduction lengths of the subprocess models (LinearAttention(2, 4), C = 4
# for elu and oglu, then Dense(2), on [16, 12, 8] batches): 8 (q/k/v
# projections) + D 4 (the map's own projection) + S 12 keys + C 4 features +
# H*M 8 (output projection) + 8 (the Dense head).
_N_FORWARD = 8 + 4 + 12 + 4 + 8 + 8
_N_LOSS = _N_FORWARD + 16 * 12 * 2  # + B*T*2: the mean squared error over the batch
_N_GRAD = _N_FORWARD + 16 * 12  # + B*T: the positions that share each weight


@pytest.fixture(scope="module")
def mirrored_run(tmp_path_factory):
    """The MirroredStrategy subprocess: ``(RESULT dict, out dir)``."""
    out_dir = str(tmp_path_factory.mktemp("mirrored"))
    return _lm_runs.run_script(_MIRRORED_SCRIPT, out_dir, TEST_SEED, {"KERAS_BACKEND": "tensorflow"}), out_dir


def test_mirrored_strategy_two_logical_cpus_matches_one_device(mirrored_run):
    out, _ = mirrored_run
    assert out["replicas"] == 2
    for name in ("elu", "oglu"):
        r = out[name]
        # Two float32 computations of the loss (paths=2), conditioned by the
        # loss's sensitivity to its predictions.
        assert_close(
            r["loss_mirrored"],
            r["loss_single"],
            n=_N_LOSS,
            conditioning=max(1.0, r["loss_conditioning"]),
            paths=2,
            what=f"{name} loss",
        )
        # The all-reduced gradients equal one device's: the updated weights
        # agree within the error model (relative to the weights' scale)...
        init, single, mirrored = (np.asarray(r[k]) for k in ("init", "single", "mirrored"))
        assert_close(mirrored, single, n=_N_GRAD, paths=2, what=f"{name} weights")
        # ... and the step moved them by far more than that bound (100x), so
        # a wrong all-reduce (e.g. a sum instead of a mean) would show.
        resolution = bound(n=_N_GRAD, paths=2) * np.abs(single).max()
        assert np.abs(single - init).max() > 100 * resolution, (name, np.abs(single - init).max(), resolution)
    # oglu carries its orthogonal penalty: the regularization loss is in play.
    assert out["oglu"]["num_losses"] >= 1


def test_causal_lm_mirrored_strategy_fit_evaluate_resume(mirrored_run):
    """LinearCausalLM under MirroredStrategy (jit_compile=False, logical CPUs), with no
    `test_on_batch` first: `fit` and `evaluate` agree with one device (Keras builds the loss from
    the first batch mean-reduced over replicas, which turned the ids into float32), and the
    package's BackupAndRestore, interrupted inside an epoch, resumes to the one-device weights."""
    out, out_dir = mirrored_run
    lm, weights = out["lm"], _lm_runs.load_weights(out_dir)
    _lm_runs.assert_same_losses(lm["mirrored"]["losses"], lm["single"]["losses"], "mirrored fit losses")
    assert_close(lm["mirrored"]["evaluate"], lm["single"]["evaluate"], n=_lm_runs.N_LOSS, paths=2, what="evaluate")
    _lm_runs.assert_same_weights(weights["mirrored"], weights["single"], weights["init"], "mirrored fit")
    assert lm["resumed_point"] == [0, 3]
    _lm_runs.assert_same_weights(weights["resumed"], weights["single"], weights["init"], "mirrored resumed")


# ---------------------------------------------------------------------------
# tf.distribute.MultiWorkerMirroredStrategy: two worker processes on localhost.
# Keras 3's `fit` fails under this strategy (keras-team/keras#20585), so the
# documented path is a custom training loop; this is that loop.

_MULTI_WORKER_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras
    import numpy as np
    from keras_linattn.layers import LinearAttention

    GLOBAL_BATCH = 16
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 12, 8)).astype("float32")
    y = rng.normal(size=(32, 12, 2)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inp = keras.Input((12, 8))
        h = LinearAttention(2, 4, feature_map="oglu", chunk_size=4)(inp, inp, use_causal_mask=True)
        model = keras.Model(inp, keras.layers.Dense(2)(h))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    # The same loss on one device, before any update.
    pred = model(x[:GLOBAL_BATCH])
    reference = float(np.mean((np.asarray(pred) - y[:GLOBAL_BATCH]) ** 2))
    reference += float(sum(np.asarray(l) for l in model.losses))

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_ds = strategy.experimental_distribute_dataset(ds)

    @tf.function
    def train_step(batch):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                pred = model(xb, training=True)
                per_example = tf.reduce_mean(tf.square(pred - yb), axis=[1, 2])
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)

    # The loss's condition number w.r.t. the predictions p (r = p - y): mean 2 |r p| over the loss.
    pred = np.asarray(pred, np.float64)
    conditioning = float(np.mean(2 * np.abs((pred - y[:GLOBAL_BATCH]) * pred)) / reference)

    losses = [float(train_step(b)) for b in dist_ds]
    weights = np.concatenate([np.ravel(np.asarray(v)) for v in model.trainable_variables]).tolist()
    print("RESULT " + json.dumps({"replicas": strategy.num_replicas_in_sync, "losses": losses,
                                  "reference": reference, "conditioning": conditioning, "weights": weights}))
    """
)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_multi_worker_mirrored_strategy_two_local_workers():
    workers = [f"localhost:{_free_port()}", f"localhost:{_free_port()}"]
    procs = []
    for index in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _MULTI_WORKER_SCRIPT],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, stdout[-3000:] + stderr[-3000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for r in results:
        assert r["replicas"] == 2
        assert len(r["losses"]) == 2 and all(np.isfinite(r["losses"]))
        # First step: the all-reduced loss equals the one-device loss of the
        # global batch; two float32 computations (paths=2), conditioned by the
        # loss's sensitivity to its predictions. Same model as the mirrored test.
        assert_close(
            r["losses"][0], r["reference"], n=_N_LOSS, conditioning=max(1.0, r["conditioning"]), paths=2, what="loss"
        )
    # Both workers end with the same weights (two float32 runs of two steps).
    assert_close(results[1]["weights"], results[0]["weights"], n=_N_GRAD, paths=2, what="weights")
