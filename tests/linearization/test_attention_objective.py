"""Attention transfer's attention-weight objective (Hedgehog's cross-entropy) and `freeze`.

The objective's parts are checked against other computations of the same
numbers: the teacher's weights against MultiHeadAttention's own attention
scores, the student's weights against the recurrence's float64 oracle (its
output is the weights times the values), the cross-entropy against numpy
and its gradient against a tape through a float64 reference written apart.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn.linearization._attention_objective import attention_cross_entropy, attention_weights
from tests.linearization._models import HEADS, KEY_DIM, T, causal_teacher, data, weights
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

W = 3
OPTIONS = {
    "gamma": {"window_gamma": 0.4},
    "weight_mean_plain": {"linear_weight": 0.7, "linear_rope": False, "linear_mean": True},
    "cache": {"cache_size": 2, "window_gamma": 0.6},
}


def _student(options):
    teacher, probe = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=W, **options)
    layer = student.get_layer("att1")
    rng = np.random.default_rng(7)
    for v in layer.feature_map.trainable_weights:  # spread the identity-initialized map
        v.assign(np.asarray(v) + 0.3 * rng.normal(size=v.shape).astype("float32"))
    return teacher, probe, student, layer


def _inputs(probe, n=2):
    h = np.asarray(probe(data(n))[0])  # [B, T, DIM]: att1's input
    mask = np.ones((n, T), bool)
    mask[1, :3] = False  # a left-padded row
    return h, mask


def _reference_weights(layer, h, mask, dtype="float64"):
    """The student's weights written out per row (loops, float64), from the layer's features."""
    rec = layer.recurrence
    q, k, _ = (np.asarray(a, dtype) for a in layer.attention_inputs(h, h, key_mask=mask, use_causal_mask=True))
    q_lin, k_lin = q, k
    if not rec.linear_rope:
        q_lin, k_lin = (np.asarray(a, dtype) for a in layer.project(h, h)[:2])
    qf = np.asarray(rec.features(q_lin.astype("float32"), True, True, False), dtype)
    kf = np.asarray(rec.features(k_lin.astype("float32"), False, True, False), dtype)
    gamma = 1.0 if rec.gamma is None else np.asarray(rec._gamma(), dtype)[:, None]
    b, t, h_ = q.shape[:3]
    out = np.zeros((b, h_, t, t))
    for bb in range(b):
        for i in range(t):
            if not mask[bb, i]:
                continue
            keys = [j for j in range(i + 1) if mask[bb, j]]
            inside = [j for j in keys if j > i - W]
            older = [j for j in keys if j <= i - W]
            s = np.einsum("hd,jhd->hj", q[bb, i], k[bb, inside]) / np.sqrt(q.shape[-1])
            row = np.zeros((h_, t))
            row[:, inside] = gamma * np.exp(s - s.max(-1, keepdims=True))
            if older:
                lin = np.einsum("hc,jhc->hj", qf[bb, i], kf[bb, older])
                row[:, older] = lin / (len(older) if rec.linear_mean else 1.0)
            out[bb, :, i] = row / row.sum(-1, keepdims=True)
    return out


@pytest.mark.parametrize("case", list(OPTIONS))
def test_the_weights_are_the_teachers_and_the_students(case):
    teacher, probe, student, layer = _student(OPTIONS[case])
    h, mask = _inputs(probe)
    p, a = (np.asarray(x) for x in attention_weights(layer, h, h, None, mask))
    _, scores = teacher.get_layer("att1")(h, h, use_causal_mask=True, attention_mask=None, return_attention_scores=True)
    scores = np.asarray(scores)
    n = T + KEY_DIM
    assert_close(p[0], scores[0], n=n, paths=2, what="teacher's weights")  # the unpadded row: MHA's own
    ref = _reference_weights(layer, h, mask)
    assert_close(a, ref, n=n + layer.feature_dim, paths=2, what="student's weights")
    if case != "cache":  # the window's output is these weights times the values (the oracle, float64)
        q, k, v = layer.attention_inputs(h, h, key_mask=mask, use_causal_mask=True)
        plain = layer.project(h, h)[:2]
        att = np.asarray(layer.recurrence.oracle(q, k, v, k, tf.constant(mask), unrotated=plain))
        assert_close(np.einsum("bhts,bshm->bthm", a, np.asarray(v)), att, n=2 * n, paths=2, what="a v")


def test_the_cross_entropy_matches_numpy():
    _, probe, _, layer = _student(OPTIONS["gamma"])
    h, mask = _inputs(probe)
    value = float(attention_cross_entropy(layer, h, h, None, mask))
    p, _ = (np.asarray(x, "float64") for x in attention_weights(layer, h, h, None, mask))
    a = _reference_weights(layer, h, mask)
    rows = -(p * np.log(np.maximum(a, 1e-30))).sum(-1)  # [B, H, T]
    expected = rows[np.broadcast_to(mask[:, None, :], rows.shape)].mean()
    assert_close(value, expected, n=T * HEADS * 2 * T, paths=2, conditioning=np.abs(rows).max() / expected, what="CE")


def test_the_gradient_matches_a_tape_through_a_float64_reference():
    _, probe, _, layer = _student(OPTIONS["weight_mean_plain"])
    h, mask = _inputs(probe)
    variables = layer.recurrence.layer.feature_map.trainable_weights + [
        v for v in layer.trainable_weights if "linear_weight" in v.path or "gamma" in v.path
    ]
    assert len(variables) == len(layer.feature_map.trainable_weights) + 2  # linearize's default gamma, the weight
    rec = layer.recurrence
    q, k, _ = layer.attention_inputs(h, h, key_mask=mask, use_causal_mask=True)
    q_plain, k_plain, _ = layer.project(h, h)
    teacher, _ = attention_weights(layer, h, h, None, mask)
    teacher = tf.cast(teacher, "float64")
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = (j <= i)[None, None] & mask[:, None, None, :]
    inside, older = causal & (j > i - W), causal & (j <= i - W)
    count = np.maximum(older.sum(-1, keepdims=True), 1).astype("float64")
    s = np.einsum("bthd,bshd->bhts", np.asarray(q, "float64"), np.asarray(k, "float64")) / np.sqrt(KEY_DIM)
    soft = np.where(inside, np.exp(s - np.where(inside, s, -np.inf).max(-1, keepdims=True)), 0.0)

    def reference():
        qf = tf.cast(rec.features(q_plain, True, True, False), "float64")
        kf = tf.cast(rec.features(k_plain, False, True, False), "float64")
        gamma = 1.0 if rec.gamma is None else tf.cast(rec._gamma(), "float64")[None, :, None, None]
        a = gamma * soft + tf.where(older, tf.einsum("bthc,bshc->bhts", qf, kf) / count, 0.0)
        total = tf.reduce_sum(a, -1, keepdims=True)
        log_a = tf.math.log(tf.where(a > 0, a, 1.0)) - tf.math.log(tf.where(total > 0, total, 1.0))
        rows = -tf.reduce_sum(tf.where(a > 0, teacher * log_a, 0.0), -1)
        keep = np.broadcast_to(mask[:, None, :], rows.shape)
        return tf.reduce_mean(tf.boolean_mask(rows, keep))

    with tf.GradientTape(persistent=True) as tape:
        ours = attention_cross_entropy(layer, h, h, None, mask)
        ref = reference()
    got = np.concatenate([np.ravel(g) for g in tape.gradient(ours, variables)])
    want = np.concatenate([np.ravel(g) for g in tape.gradient(ref, variables)])
    assert_close(float(ours), float(ref), n=T * T * HEADS, paths=2, what="value")
    assert_close(got, want, n=2 * T * T * HEADS + layer.feature_dim, paths=2, what="gradient")


def test_freezing_keeps_gamma_and_the_linear_weight_bit_identical():
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=W, window_gamma=0.4, linear_weight=0.5)
    before = weights(student)
    keras_linattn.attention_transfer(
        student,
        teacher,
        data(8),
        steps=3,
        batch_size=4,
        objective="attention",
        freeze=("gamma", "linear_weight"),
        verbose=0,
    )
    after = weights(student)
    frozen = [p for p in before if p.endswith(("window_gamma_logit", "window_linear_weight_log"))]
    assert len(frozen) == 4  # two layers, gamma and linear weight each
    for path in frozen:
        np.testing.assert_array_equal(after[path], before[path], err_msg=path)
    moved = [p for p in before if "feature_map" in p and not np.array_equal(after[p], before[p])]
    assert moved  # the feature map trained


@pytest.mark.slow
def test_the_output_objective_is_the_default():
    teacher, _ = causal_teacher()
    x = data(8)
    runs = {}
    for name, options in (("default", {}), ("output", {"objective": "output"})):
        keras.utils.set_random_seed(0)
        student = keras_linattn.linearize(teacher, window_size=W, window_gamma=0.4)
        _, history = keras_linattn.attention_transfer(student, teacher, x, steps=3, batch_size=4, verbose=0, **options)
        runs[name] = (history.history, [np.asarray(v) for v in student.weights])
    assert runs["default"][0] == runs["output"][0] and sorted(runs["output"][0]) == ["loss", "mse/att1", "mse/att2"]
    for got, want in zip(runs["output"][1], runs["default"][1], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_the_attention_objective_lowers_the_cross_entropy():
    teacher, _ = causal_teacher()
    x = data(8)

    student = keras_linattn.linearize(teacher, window_size=W, window_gamma=0.4)
    _, history = keras_linattn.attention_transfer(
        student, teacher, x, steps=2, batch_size=8, objective="both", learning_rate=0.05, verbose=0
    )
    assert sorted(history.history) == ["ce/att1", "ce/att2", "loss", "mse/att1", "mse/att2"]
    _, history = keras_linattn.attention_transfer(
        student, teacher, x, steps=8, batch_size=8, objective="attention", learning_rate=0.05, verbose=0, epochs=2
    )
    ce = history.history["ce/att1"]
    assert ce[1] < ce[0]


def test_bad_objective_and_freeze_are_refused():
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=W)
    for bad in ("mse", None):
        with pytest.raises(ValueError, match="objective"):
            keras_linattn.attention_transfer(student, teacher, data(4), steps=1, objective=bad, verbose=0)
    for bad in (("feature",), 3):
        with pytest.raises(ValueError, match="freeze"):
            keras_linattn.attention_transfer(student, teacher, data(4), steps=1, freeze=bad, verbose=0)
    additive = keras_linattn.linearize(teacher, window_size=None, update="delta", normalize=False)
    with pytest.raises(ValueError, match="recurrence=DeltaRecurrence"):
        keras_linattn.attention_transfer(additive, teacher, data(4), steps=1, objective="attention", verbose=0)
