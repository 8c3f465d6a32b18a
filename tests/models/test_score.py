"""`LinearCausalLM.score`, keras-hub's: equal to the keras-hub teacher's where the window covers the sequence."""

import keras
import keras_hub
import numpy as np
import pytest

import keras_linattn
from tests.tolerance import assert_close

pytestmark = pytest.mark.numeric

T, VOCAB = 10, 60


def _gpt2():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=32
    )
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _llama():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request):
    """``(teacher, student)``: the student linearized with a softmax window that covers T, so it is exact."""
    teacher = {"gpt2": _gpt2, "llama": _llama}[request.param]()
    return request.param, teacher, keras_linattn.linearize(teacher, feature_map="hedgehog", window_size=T)


def _inputs(padding):
    ids = np.random.default_rng(0).integers(0, VOCAB, (3, T)).astype("int32")
    mask = np.ones_like(ids, bool)
    if padding == "right":
        mask[0, 6:], mask[1, 8:] = False, False
    elif padding == "left":
        mask[0, :4], mask[1, :2] = False, False
    ids[~mask] = 0
    return ids, mask, np.roll(ids, -1, axis=1)


def _paddings(family):
    # GPT-2's learned positions count columns in keras-hub, real tokens here: left padding shifts one
    # against the other. RoPE sees only distances, so Llama is compared left-padded too.
    return ["none", "right"] + (["left"] if family == "llama" else [])


# Two blocks of float32 attention + MLP on width 16 (the error model's reduction length, as in
# tests/linearization/test_keras_hub_teachers.py).
PATHS, N = 8, 32


def test_logits_equal_the_teachers_score(pair):
    family, teacher, student = pair
    for padding in _paddings(family):
        ids, mask, _ = _inputs(padding)
        want = np.asarray(teacher.score(ids, padding_mask=mask), "float64")  # [B, T, V]
        got = np.asarray(student.score(ids, padding_mask=mask))
        assert got.shape == want.shape and got.dtype == np.float32
        # Padded positions' scores mean nothing on either side (keras-hub's masked softmax rows).
        assert_close(got[mask], want[mask], paths=PATHS, n=N, what=padding)


def test_loss_equals_the_teachers_score(pair):
    family, teacher, student = pair
    for padding in _paddings(family):
        ids, mask, targets = _inputs(padding)
        want = np.asarray(teacher.score(ids, padding_mask=mask, scoring_mode="loss", target_ids=targets), "float64")
        got = np.asarray(student.score(ids, padding_mask=mask, scoring_mode="loss", target_ids=targets))
        assert got.shape == ids.shape
        logits = np.asarray(teacher.score(ids, padding_mask=mask), "float64")[mask]
        # loss = logsumexp(l) - l[target]: each term moves by at most the largest logit error, so the
        # loss error is bounded by 2x the logits' bound, scaled from max|logits| to max|loss|.
        conditioning = max(1.0, np.abs(logits).max() / np.abs(want[mask]).max())
        assert_close(got[mask], want[mask], paths=2 * PATHS, n=N, conditioning=conditioning, what=padding)


def test_layer_intercept_fn_sees_the_same_activations_as_the_teachers(pair):
    family, teacher, student = pair
    ids, mask, _ = _inputs("none")
    seen = []

    def halve_first_block(x, index):
        seen.append(index)
        return x * 0.5 if index == 0 else x

    want = np.asarray(teacher.score(ids, padding_mask=mask, layer_intercept_fn=halve_first_block), "float64")
    assert seen == [-1, 0, 1]
    seen.clear()
    got = np.asarray(student.score(ids, padding_mask=mask, layer_intercept_fn=halve_first_block))
    assert seen == [-1, 0, 1]
    assert_close(got, want, paths=PATHS, n=N)
    plain = np.asarray(student.score(ids, padding_mask=mask))
    assert np.abs(got - plain).max() > 1e-3  # the intercept changed the activations it was given


def test_an_identity_intercept_runs_the_models_own_pass(pair):
    """The layer-by-layer pass behind `layer_intercept_fn` is the model's graph, for any family."""
    _, _, student = pair
    ids, mask, _ = _inputs("right")
    plain = np.asarray(student.score(ids, padding_mask=mask))
    intercepted = np.asarray(student.score(ids, padding_mask=mask, layer_intercept_fn=lambda x, index: x))
    # Two float32 computations of the same sums (paths=2 per side's rounding, as step against parallel).
    assert_close(intercepted[mask], plain[mask], paths=2 * PATHS, n=N)


def test_bad_arguments_are_refused_with_the_value_named(pair):
    _, _, student = pair
    ids, _, targets = _inputs("none")
    with pytest.raises(ValueError, match="scoring_mode='perplexity'"):
        student.score(ids, scoring_mode="perplexity")
    with pytest.raises(ValueError, match="target_ids=None"):
        student.score(ids, scoring_mode="loss")
    with pytest.raises(ValueError, match=r"target_ids.shape=\(3, 9\)"):
        student.score(ids, scoring_mode="loss", target_ids=targets[:, :-1])
    with pytest.raises(TypeError, match="layer_intercept_fn=3"):
        student.score(ids, layer_intercept_fn=3)
    with pytest.raises(ValueError, match=r"token_ids.shape=\(10,\)"):
        student.score(ids[0])
