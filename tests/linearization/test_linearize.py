"""`keras_linattn.linearize` on functional models built from `keras.layers.MultiHeadAttention`."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import LinearAttention
from tests.linearization._models import DIM, FEATURES, HEADS, KEY_DIM, T, causal_teacher, data, mha, weights
from tests.tolerance import assert_close

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)

# Reduction length of one attention layer of the teachers: the q/k/v
# projections over DIM inputs, the logits over KEY_DIM, the softmax
# normalization and the weighted sum over T keys, the output projection
# over H * M. Errors of reductions in sequence add their lengths.
_ATTENTION_N = DIM + KEY_DIM + 2 * T + HEADS * KEY_DIM


@pytest.mark.parametrize("window_size", [T, T + 5])
def test_causal_model_with_window_covering_the_sequence_is_the_teacher(window_size):
    """With W >= T the window holds every key: the student computes the teacher's function."""
    teacher, _ = causal_teacher()
    before = weights(teacher)
    student = keras_linattn.linearize(teacher, window_size=window_size)
    assert [type(layer).__name__ for layer in student.layers if "att" in layer.name] == ["LinearAttention"] * 2
    assert not any(isinstance(layer, keras.layers.MultiHeadAttention) for layer in student.layers)
    x = data(4)
    # Teacher (keras' softmax attention) against student, both float32 (paths=2):
    # embed over FEATURES, two attention layers, the head over DIM.
    assert_close(student(x), teacher(x), n=FEATURES + 2 * _ATTENTION_N + DIM, paths=2)
    assert all(np.array_equal(before[path], np.asarray(v)) for path, v in ((v.path, v) for v in teacher.weights))
    assert all(isinstance(teacher.get_layer(n), keras.layers.MultiHeadAttention) for n in ("att1", "att2"))


def test_window_shorter_than_the_sequence_is_not_the_teacher():
    """Criterion for the test above: a window of 3 of 12 changes the function (the linear part is used)."""
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=3)
    x = data(4)
    err = np.abs(np.asarray(student(x)) - np.asarray(teacher(x))).max() / np.abs(np.asarray(teacher(x))).max()
    assert err > 1e-2


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def test_cross_attention_without_window_copies_the_teacher_weights(rng):
    """Non-causal cross-attention (query and memory of different lengths), elu features:
    the student against a float64 NumPy linear attention with the TEACHER's weights."""
    s = 7
    queries = keras.Input((T, DIM), name="queries")
    memory = keras.Input((s, DIM), name="memory")
    attention = mha("cross", 5)
    out = keras.layers.Dense(3, name="head")(attention(queries, memory))
    teacher = keras.Model([queries, memory], out)
    student = keras_linattn.linearize(teacher, feature_map="elu", window_size=None)
    xq = rng.normal(size=(2, T, DIM)).astype("float32")
    xm = rng.normal(size=(2, s, DIM)).astype("float32")

    def w(part, name):
        return np.asarray(getattr(getattr(attention, part), name), np.float64)

    q = np.einsum("btd,dhk->bthk", xq, w("query_dense", "kernel")) + w("query_dense", "bias")
    k = np.einsum("bsd,dhk->bshk", xm, w("key_dense", "kernel")) + w("key_dense", "bias")
    v = np.einsum("bsd,dhk->bshk", xm, w("value_dense", "kernel")) + w("value_dense", "bias")
    qf, kf = _elu1(q), _elu1(k)  # [B, T, H, C], [B, S, H, C]
    numerator = np.einsum("bthc,bshc,bshm->bthm", qf, kf, v)
    denominator = np.einsum("bthc,bshc->bth", qf, kf)[..., None]
    attended = np.einsum("bthm,hmo->bto", numerator / denominator, w("output_dense", "kernel"))
    attended += w("output_dense", "bias")
    head = student.get_layer("head")
    expected = attended @ np.asarray(head.kernel, np.float64) + np.asarray(head.bias, np.float64)
    np.testing.assert_array_equal(np.asarray(head.kernel), np.asarray(teacher.get_layer("head").kernel))
    # Float64 oracle (paths=1): projections over DIM, features over C = KEY_DIM,
    # the sums over S keys, the output projection over H * M, the head over DIM.
    assert_close(student([xq, xm]), expected, n=DIM + KEY_DIM + s + HEADS * KEY_DIM + DIM)


def test_nested_functional_model_and_shared_attention():
    inner_in = keras.Input((T, DIM))
    shared = mha("shared", 6)
    inner = keras.Model(inner_in, shared(inner_in, inner_in, use_causal_mask=True), name="inner")
    inputs = keras.Input((T, DIM))
    h = inner(inputs)
    teacher = keras.Model(inputs, shared(h, h, use_causal_mask=True))
    student = keras_linattn.linearize(teacher, window_size=T)
    x = data(2).repeat(3, axis=-1)[..., :DIM]
    assert_close(student(x), teacher(x), n=2 * _ATTENTION_N, paths=2)


# `make test` runs the same check in the subprocess of
# tests/models/test_keras_hub_shape.py::test_import_keras_linattn_does_not_import_keras_hub.
@pytest.mark.slow
def test_import_does_not_load_keras_hub():
    code = textwrap.dedent(
        """
        import json, sys
        import keras
        import keras_linattn
        inputs = keras.Input((4, 8))
        model = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 4)(inputs, inputs, use_causal_mask=True))
        keras_linattn.linearize(model, window_size=4)
        print(json.dumps({"keras_hub": "keras_hub" in sys.modules}))
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"keras_hub": False}


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.attention = keras.layers.MultiHeadAttention(2, 4)

    def call(self, x):
        return self.attention(x, x)


def test_bad_teachers_and_arguments():
    x = keras.Input((T, DIM))
    with pytest.raises(TypeError, match="functional or Sequential"):
        keras_linattn.linearize(_Subclassed())
    with pytest.raises(TypeError, match="functional or Sequential"):
        keras_linattn.linearize(keras.layers.MultiHeadAttention(2, 4))
    with pytest.raises(ValueError, match="no keras.layers.MultiHeadAttention"):
        keras_linattn.linearize(keras.Model(x, keras.layers.Dense(3)(x)))
    with pytest.raises(ValueError, match="window_size"):
        keras_linattn.linearize(causal_teacher()[0], window_size=0)
    non_causal = keras.Model(x, mha("plain", 7)(x, x))
    with pytest.raises(ValueError, match="window_size=None"):
        keras_linattn.linearize(non_causal, window_size=8)
    assert isinstance(keras_linattn.linearize(non_causal, window_size=None).get_layer("plain"), LinearAttention)
    mask = keras.Input((T, T), dtype="bool")
    masked = keras.Model([x, mask], mha("masked", 8)(x, x, attention_mask=mask))
    with pytest.raises(ValueError, match="attention_mask"):
        keras_linattn.linearize(masked, window_size=None)
    _, scores = mha("scores", 9)(x, x, return_attention_scores=True, use_causal_mask=True)
    with pytest.raises(ValueError, match="return_attention_scores"):
        keras_linattn.linearize(keras.Model(x, scores), window_size=4)
    gated = keras.layers.MultiHeadAttention(2, 4, use_gate=True, name="gated")
    with pytest.raises(ValueError, match="use_gate"):
        keras_linattn.linearize(keras.Model(x, gated(x, x, use_causal_mask=True)))


def test_linearized_model_saves_and_loads_as_itself(tmp_path):
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=4)
    path = str(tmp_path / "student.keras")
    student.save(path)
    loaded = keras.models.load_model(path)
    assert [type(layer).__name__ for layer in loaded.layers] == [type(layer).__name__ for layer in student.layers]
    x = data(2)
    # The same float32 computation on the same weights: identical.
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(student(x)))


def test_dtype_argument_sets_the_students_policy():
    """``linearize(..., dtype=...)`` is the student's dtype policy (it was passed twice to each attention)."""
    teacher, _ = causal_teacher()
    student = keras_linattn.linearize(teacher, window_size=T, dtype="mixed_float16")
    policies = {layer.name: layer.dtype_policy.name for layer in student.layers if layer.weights}
    assert set(policies.values()) == {"mixed_float16"}, policies
    x = data(4)
    # The teacher's function (W >= T), computed in float16.
    assert_close(student(x), teacher(x), n=FEATURES + 2 * _ATTENTION_N + DIM, paths=2, dtype="float16")


def test_attention_nested_in_a_layer_is_named_with_what_is_supported():
    """A functional model around keras-hub's TransformerDecoder: its attention sits inside the layer."""
    keras_hub = pytest.importorskip("keras_hub")
    ids = keras.Input((T,), dtype="int32")
    hidden = keras.layers.Embedding(50, DIM)(ids)
    hidden = keras_hub.layers.TransformerDecoder(32, HEADS, name="decoder")(hidden)
    teacher = keras.Model(ids, keras.layers.Dense(50)(hidden))
    with pytest.raises(ValueError, match=r"decoder.*TransformerDecoder.*CachedMultiHeadAttention.*Supported"):
        keras_linattn.linearize(teacher, window_size=T)
