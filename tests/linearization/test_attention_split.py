"""The attention objective's split gradient: the window / linear split trains gamma and the linear weight only.

`attention_cross_entropy(..., split_gradient="weights")` keeps the value of
Hedgehog's cross-entropy; its gradient reaches gamma and the linear weight
as the plain one does, and the feature map only through the linear part's
shape, ``- sum_{j older} p_j log(a_j / A)``. Checked against a tape through
a float64 reference written apart, and end to end: with both weights
frozen, a step of `attention_transfer` moves the feature map the same way
whatever the (frozen) linear weight, as the shape does not depend on it.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn.linearization._attention_objective import attention_cross_entropy, attention_weights
from tests.linearization._models import HEADS, KEY_DIM, T, causal_teacher, data
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

W = 3


def _student(linear_weight, teacher=None):
    teacher = causal_teacher()[0] if teacher is None else teacher
    student = keras_linattn.linearize(
        teacher, window_size=W, window_gamma=0.4, linear_weight=linear_weight, linear_rope=False
    )
    rng = np.random.default_rng(7)
    for layer in (student.get_layer("att1"), student.get_layer("att2")):
        for v in layer.feature_map.trainable_weights:  # spread the identity-initialized map
            v.assign(np.asarray(v) + 0.3 * rng.normal(size=v.shape).astype("float32"))
    return teacher, student


def _inputs():
    _, probe = causal_teacher()
    h = np.asarray(probe(data(2))[0])  # [B, T, DIM]: att1's input
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # a left-padded row
    return h, mask


def _variables(layer):
    split = [v for v in layer.trainable_weights if "linear_weight" in v.path or "gamma" in v.path]
    return list(layer.feature_map.trainable_weights), split


def test_the_split_gradient_keeps_the_value_and_gives_the_split_to_the_weights():
    _, student = _student(0.05)
    layer = student.get_layer("att1")
    h, mask = _inputs()
    features, split = _variables(layer)
    assert len(split) == 2  # gamma and the linear weight
    rec = layer.recurrence
    q_plain, k_plain, _ = layer.project(h, h)
    teacher, _ = attention_weights(layer, h, h, None, mask)
    teacher = tf.cast(teacher, "float64")
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    older = (j <= i - W)[None, None] & (j <= i)[None, None] & mask[:, None, None, :]  # [B, 1, T, T]
    keep = np.broadcast_to(mask[:, None, :], (2, HEADS, T))

    def shape_reference():
        """- sum_{j older} p_j log(a_j / A), in float64: the part of the cross-entropy the features learn."""
        qf = tf.cast(rec.features(q_plain, True, True, False), "float64")
        kf = tf.cast(rec.features(k_plain, False, True, False), "float64")
        linear = tf.where(older, tf.einsum("bthc,bshc->bhts", qf, kf), 0.0)  # [B, H, T, T]
        mass = tf.reduce_sum(linear, -1, keepdims=True)
        log_a = tf.math.log(tf.where(older, linear, 1.0)) - tf.math.log(tf.where(mass > 0, mass, 1.0))
        rows = -tf.reduce_sum(tf.where(older, teacher * log_a, 0.0), -1)  # [B, H, T]
        return tf.reduce_mean(tf.boolean_mask(rows, keep))

    with tf.GradientTape(persistent=True) as tape:
        plain = attention_cross_entropy(layer, h, h, None, mask)
        split_form = attention_cross_entropy(layer, h, h, None, mask, split_gradient="weights")
        shape = shape_reference()
    n = T * T * HEADS
    assert_close(float(split_form), float(plain), n=n, paths=2, what="value")

    def flat(grads):
        return np.concatenate([np.ravel(g) for g in grads])

    got = flat(tape.gradient(split_form, split))
    assert_close(got, flat(tape.gradient(plain, split)), n=2 * n, paths=2, what="gamma and linear weight gradient")
    got = flat(tape.gradient(split_form, features))
    want = flat(tape.gradient(shape, features))
    assert_close(got, want, n=2 * n + layer.feature_dim, paths=2, what="feature map gradient")
    # the plain gradient differs: its split term reaches the features too
    assert np.abs(flat(tape.gradient(plain, features)) - want).max() > 0.1 * np.abs(want).max()


def test_frozen_split_transfer_moves_the_features_whatever_the_linear_weight():
    teacher, _ = causal_teacher()
    moves = []
    for linear_weight in (0.001, 0.5):
        _, student = _student(linear_weight, teacher)
        before = [np.asarray(v).copy() for v in student.trainable_weights if "feature_map" in v.path]
        keras_linattn.attention_transfer(
            student,
            teacher,
            data(4),
            steps=1,
            batch_size=4,
            objective="attention",
            freeze=("gamma", "linear_weight"),
            optimizer=keras.optimizers.SGD(1.0),  # the step is the gradient itself
            verbose=0,
        )
        after = [np.asarray(v) for v in student.trainable_weights if "feature_map" in v.path]
        moves.append(np.concatenate([np.ravel(a - b) for a, b in zip(after, before, strict=True)]))
    assert np.abs(moves[0]).max() > 0  # the feature map trained
    # one step of the shape's gradient, each run within the float32 bound of the exact one: paths 2 + 2
    n = 4 * T * T * HEADS + 2 * KEY_DIM
    assert_close(moves[0], moves[1], n=n, paths=4, what="feature map step at linear weights 0.001 and 0.5")


def test_a_bad_split_gradient_is_refused():
    _, student = _student(0.05)
    h, _ = _inputs()
    with pytest.raises(ValueError, match="split_gradient"):
        attention_cross_entropy(student.get_layer("att1"), h, h, split_gradient="features")
