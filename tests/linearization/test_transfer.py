"""`keras_linattn.attention_transfer`: what it minimizes, that it lowers it, what it leaves alone, fit's callbacks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn.layers import LinearAttention
from keras_linattn.linearization import attention_pairs, transfer_variables
from tests.linearization._models import DIM, T, causal_teacher, data, mha, weights
from tests.tolerance import assert_close

WINDOW = 3


def _teacher_forced_mse(student, probe, x):
    """Per-layer MSE of each student attention layer on the TEACHER's inputs, in float64 from the layers' outputs."""
    h1, a1, h2, a2, _ = (np.asarray(t) for t in probe(x))
    mse = {}
    for name, h, target in (("att1", h1, a1), ("att2", h2, a2)):
        out = np.asarray(student.get_layer(name)(h, h, use_causal_mask=True), np.float64)
        mse[name] = float(np.mean((out - target) ** 2))
    return mse


def test_pairs_follow_model_order():
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    pairs = attention_pairs(teacher, student)
    assert [(t.name, s.name) for t, s in pairs] == [("att1", "att1"), ("att2", "att2")]
    assert all(t is teacher.get_layer(t.name) and s is student.get_layer(s.name) for t, s in pairs)


def test_the_loss_is_the_teacher_forced_output_mse():
    """At learning rate 0 the logged per-layer MSE is the MSE of each student layer on the teacher's inputs."""
    teacher, probe = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    x = data(8)
    expected = _teacher_forced_mse(student, probe, x)
    _, history = keras_linattn.attention_transfer(
        student, teacher, x, steps=2, batch_size=4, optimizer=keras.optimizers.SGD(0.0), verbose=0
    )
    h1, a1, h2, a2, _ = (np.asarray(t) for t in probe(x))
    conditioning = {}
    for name, h, target in (("att1", h1, a1), ("att2", h2, a2)):
        out = np.asarray(student.get_layer(name)(h, h, use_causal_mask=True), np.float64)
        # The same float32 layer outputs on both sides (paths=2), then the MSE's
        # float32 mean over B*T*DIM terms (batches of 4, 2 batches averaged).
        # A rounding error e of out - target changes the square by 2 e (out - target):
        # relative to the MSE, conditioned by 2 max|out| / rms(out - target).
        conditioning[name] = 2 * max(np.abs(out).max(), np.abs(target).max()) / np.sqrt(expected[name])
        assert_close(
            history.history[f"mse/{name}"][0],
            expected[name],
            n=4 * T * DIM + 2,
            conditioning=conditioning[name],
            paths=2,
            what=name,
        )
    assert_close(
        history.history["loss"][0],
        np.mean(list(expected.values())),
        n=4 * T * DIM + 4,
        conditioning=max(conditioning.values()),
        paths=2,
    )
    # Criterion: on the student's OWN input the second layer's MSE differs (its first layer
    # is not the teacher's), so a transfer that did not teacher-force would log another figure.
    own = keras.Model(student.input, student.get_layer("norm").output)(x)
    out_own = np.asarray(student.get_layer("att2")(own, own, use_causal_mask=True), np.float64)
    own_mse = float(np.mean((out_own - a2) ** 2))
    assert abs(own_mse - expected["att2"]) > 0.05 * expected["att2"]


def test_transfer_lowers_each_layer_mse_and_changes_only_the_feature_maps():
    teacher, probe = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    x = data(32, seed=1)
    teacher_before, student_before = weights(teacher), weights(student)
    before = _teacher_forced_mse(student, probe, x)
    returned, history = keras_linattn.attention_transfer(
        student, teacher, x, steps=8, epochs=3, batch_size=8, learning_rate=1e-2, verbose=0
    )
    assert returned is student
    after = _teacher_forced_mse(student, probe, x)
    for name in ("att1", "att2"):
        # Learning criterion (seeded): 24 Adam steps at LoLCATs' learning rate
        # remove over 25% of each layer's output MSE.
        assert after[name] < 0.75 * before[name], (name, before, after)
    assert history.history["loss"][-1] < history.history["loss"][0]
    trained = {v.path for name in ("att1", "att2") for v in transfer_variables(student.get_layer(name))}
    maps = {v.path for name in ("att1", "att2") for v in student.get_layer(name).feature_map.weights}
    # linearize gives the window LoLCATs' learnable gamma: it is trained with the maps.
    gammas = {f"{name}/window_gamma_logit" for name in ("att1", "att2")}
    assert trained == maps | gammas and maps
    for v in student.weights:
        changed = not np.array_equal(np.asarray(v), student_before[v.path])
        assert changed == (v.path in trained), v.path
    assert all(np.array_equal(np.asarray(v), teacher_before[v.path]) for v in teacher.weights)
    assert all("call" not in vars(layer) for model in (teacher, student) for layer in model.layers)
    # The optimizer holds state for the trained variables only (Adam: two slots each,
    # plus its iteration count and learning rate).
    assert len(history.model.optimizer.variables) == 2 * len(trained) + 2


class _Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(epoch)


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_to_the_uninterrupted_weights(tmp_path):
    teacher, _ = causal_teacher()
    batch = tf.data.Dataset.from_tensors(data(4, seed=2))  # one batch, repeated: every epoch sees the same data

    def run(callbacks):
        student = keras_linattn.linearize(teacher, window_size=WINDOW)
        try:
            keras_linattn.attention_transfer(student, teacher, batch, steps=2, epochs=3, callbacks=callbacks, verbose=0)
        except RuntimeError:
            pass
        return student

    def values(model):  # in model order (each linearized copy names its feature maps afresh)
        return [np.asarray(v).copy() for v in model.weights]

    uninterrupted = values(run([]))
    backup = str(tmp_path / "backup")
    interrupted = values(run([keras.callbacks.BackupAndRestore(backup), _StopAfter(1)]))
    assert any(not np.array_equal(a, b) for a, b in zip(interrupted, uninterrupted, strict=True))  # stopped early
    epochs = _Epochs()
    resumed = values(run([keras.callbacks.BackupAndRestore(backup), epochs]))
    # Resumed after the saved second epoch: only the third runs, from the saved weights and optimizer state.
    assert epochs.seen == [2]
    # Same float32 operations in the same order from the restored weights and
    # optimizer state: identical.
    for index, (a, b) in enumerate(zip(resumed, uninterrupted, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=str(index))


class _GammaAttention(LinearAttention):
    """A LinearAttention with a per-head weight named like the window's gamma."""

    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        self.window_gamma = self.add_weight(name="window_gamma", shape=(self.num_heads,), initializer="zeros")


def test_a_window_gamma_is_trained_and_other_layer_weights_are_not():
    layer = _GammaAttention(2, 4, feature_map="hedgehog", window_size=4, conv_size=2)
    x = np.zeros((1, 4, 8), "float32")
    layer(x, x, use_causal_mask=True)
    gamma = layer.window_gamma
    chosen = transfer_variables(layer)
    assert any(v is gamma for v in chosen)
    fm = {id(v) for v in layer.feature_map.trainable_weights}
    assert {id(v) for v in chosen} == fm | {id(gamma)}
    assert transfer_variables(LinearAttention(2, 4, feature_map="elu")) == []


def test_bad_arguments():
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    x = data(4)
    with pytest.raises(ValueError, match="steps"):
        keras_linattn.attention_transfer(student, teacher, x, steps=0)
    with pytest.raises(ValueError, match="two models"):
        keras_linattn.attention_transfer(teacher, teacher, x, steps=1)
    inputs = keras.Input((T, DIM))
    single = keras.Model(inputs, mha("only", 9)(inputs, inputs, use_causal_mask=True))
    with pytest.raises(ValueError, match="pair one to one"):
        keras_linattn.attention_transfer(student, single, x, steps=1)
    with pytest.raises(ValueError, match="nothing to train"):
        keras_linattn.attention_transfer(
            keras_linattn.linearize(teacher, feature_map="elu", window_size=WINDOW, window_gamma=None),
            teacher,
            x,
            steps=1,
            verbose=0,
        )
    with pytest.raises(ValueError, match="LinearAttention of the student"):
        keras_linattn.attention_transfer(
            student, teacher, x, steps=1, pairs=[(teacher.get_layer("att1"), teacher.get_layer("att2"))]
        )
    with pytest.raises(ValueError, match="LinearAttention"):
        transfer_variables(teacher.get_layer("att1"))
    with pytest.raises(ValueError, match="no batch"):
        keras_linattn.attention_transfer(student, teacher, x[:0], steps=1)


class _Block(keras.layers.Layer):
    """A decoder block holding its attention in an attribute (like keras-hub's decoders)."""

    def __init__(self, attention, **kwargs):
        super().__init__(**kwargs)
        self._self_attention_layer = attention
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        h = self.norm(x)
        return x + self._self_attention_layer(h, h, use_causal_mask=True)


class _Decoder(keras.Model):
    def __init__(self, attentions, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(DIM, kernel_initializer=keras.initializers.GlorotUniform(seed=11))
        self.blocks = [_Block(attention, name=f"block{i}") for i, attention in enumerate(attentions)]

    def call(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_subclassed_decoders_are_paired_and_teacher_forced():
    teacher = _Decoder([mha("t1", 12), mha("t2", 13)], name="teacher")
    # A hand-linearized student: the teacher's weights, one for one, so no convolution (as `linearize` builds it).
    student = _Decoder(
        [LinearAttention(2, 8, feature_map="hedgehog", conv_size=None, window_size=WINDOW, name=n) for n in "ab"],
        name="student",
    )
    x = data(16, seed=3)
    teacher(x), student(x)
    for source, target in zip(
        teacher.weights, [v for v in student.weights if "feature_map" not in v.path], strict=True
    ):
        target.assign(source)
    pairs = attention_pairs(teacher, student)
    assert [(t.name, s.name) for t, s in pairs] == [("t1", "a"), ("t2", "b")]

    def mse():
        # Each block's attention on the teacher's normalized input, from the teacher's own layers.
        h = teacher.embed(x)
        errors = []
        for t_block, s_block in zip(teacher.blocks, student.blocks, strict=True):
            n = t_block.norm(h)
            target = t_block._self_attention_layer(n, n, use_causal_mask=True)
            out = s_block._self_attention_layer(n, n, use_causal_mask=True)
            errors.append(float(np.mean((np.asarray(out, np.float64) - np.asarray(target)) ** 2)))
            h = t_block(h)
        return errors

    before, teacher_before = mse(), [np.asarray(v).copy() for v in teacher.weights]
    keras_linattn.attention_transfer(student, teacher, x, steps=8, epochs=2, batch_size=8, verbose=0)
    after = mse()
    # Learning criterion (seeded): 16 Adam steps remove over 25% of each layer's output MSE.
    assert all(a < 0.75 * b for a, b in zip(after, before, strict=True)), (before, after)
    assert all(np.array_equal(a, np.asarray(v)) for a, v in zip(teacher_before, teacher.weights, strict=True))


def test_padded_queries_do_not_count():
    """With Keras masks (Embedding(mask_zero=True)), the logged MSE is over unpadded queries only."""
    tokens = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(9, DIM, mask_zero=True, name="embed")(tokens)
    teacher = keras.Model(tokens, mha("att", 14)(h, h, use_causal_mask=True))
    student = keras_linattn.linearize(teacher, window_size=WINDOW)
    ids = np.random.default_rng(4).integers(1, 9, size=(4, T))
    ids[1, 5:] = 0
    ids[3, 8:] = 0
    _, history = keras_linattn.attention_transfer(
        student, teacher, ids, steps=1, batch_size=4, optimizer=keras.optimizers.SGD(0.0), verbose=0
    )
    embedded = np.asarray(teacher.get_layer("embed")(ids))
    real = ids != 0
    target = np.asarray(teacher(ids), np.float64)
    out = np.asarray(student.get_layer("att")(embedded, embedded, key_mask=real, use_causal_mask=True), np.float64)
    squares = np.mean((out - target) ** 2, axis=-1)  # [B, T]
    expected = float(squares[real].mean())
    # The same float32 outputs on both sides (paths=2), then a float32 mean over
    # B*T*DIM terms, conditioned by 2 max|out| / rms(out - target) (see above).
    conditioning = 2 * max(np.abs(out[real]).max(), np.abs(target[real]).max()) / np.sqrt(expected)
    assert_close(history.history["mse/att"][0], expected, n=4 * T * DIM, conditioning=conditioning, paths=2)
    # Criterion: counting the padded queries gives another figure.
    assert abs(float(squares.mean()) - expected) > 0.05 * expected
