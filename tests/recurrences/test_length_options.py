"""The window's options for length past training: `linear_rope=False` and `linear_mean=True`.

Each is checked against a different code path that computes the same
function:

- ``linear_mean``: at query i the mean is the sum with a linear weight of
  ``1 / n_i`` (``n_i`` the real keys older than the window), so each row
  equals the default window with that weight assigned to its learned
  linear weight;
- ``linear_rope=False``: the float64 oracle fed the unrotated queries and
  keys; and what it is for, that the layer's output does not change when
  every position is shifted (a carried state with only a position), while
  the rotated default does.

Also: steps and pieces equal one pass with rotary embeddings, no change
without rotary embeddings, the shorthand's errors, config round trips and
a covering window staying exact in a linearized student.
"""

import keras
import numpy as np
import pytest

import keras_linattn
from keras_linattn.layers import AttentionSpec, LinearAttention
from keras_linattn.ops._common import _mask_keys
from keras_linattn.recurrences import SparseCacheRecurrence, WindowRecurrence
from tests._helpers import _outputs_and_gradients
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

T, DIM, HEADS, KEY_DIM, W = 13, 16, 2, 8, 3
ROPE = 50.0


def _layer(rope=ROPE, seed=3, cache=None, **options):
    """Hedgehog + the window with `options` (and LoLA's cache of `cache` slots), weights spread."""
    recurrence = WindowRecurrence(W, **options) if cache is None else SparseCacheRecurrence(W, cache, **options)
    layer = LinearAttention(
        HEADS,
        KEY_DIM,
        feature_map="hedgehog",
        conv_size=None,  # the float64 oracles here have no convolution
        chunk_size=4,
        recurrence=recurrence,
        rope_max_wavelength=rope,
    )
    layer.build((None, None, DIM), (None, None, DIM))
    rng = np.random.default_rng(seed)
    for w in layer.weights:
        if "gamma" not in w.path and "linear_weight" not in w.path:
            w.assign(rng.normal(size=w.shape).astype("float32") * 0.5)
    return layer


def _copy_weights(source, target):
    """Assigns `source`'s weights to `target`'s by name (the window's own weights where both have them)."""
    values = {w.path.split("/", 1)[1]: w for w in source.weights}
    for w in target.weights:
        name = w.path.split("/", 1)[1]
        if name in values:
            w.assign(values[name])


def _inputs(rng):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[1, :3] = False  # a left-padded row
    return x, mask


def _n(layer):
    return T + layer.feature_dim + KEY_DIM + HEADS * layer.value_dim


@pytest.mark.parametrize("gamma", [None, 0.3])
def test_linear_mean_is_the_window_with_a_weight_of_one_over_the_older_keys(rng, gamma):
    mean = _layer(linear_mean=True, gamma=gamma, linear_weight=0.7)
    plain = _layer(gamma=gamma, linear_weight=1.0)
    _copy_weights(mean, plain)
    x, mask = _inputs(rng)
    out = np.asarray(mean(x, x, key_mask=mask, use_causal_mask=True))
    log_weight = [w for w in plain.weights if "linear_weight" in w.path][0]
    checked = 0
    for row, first_real in ((0, 0), (1, 3)):
        for i in range(first_real, T):
            older = max(0, i - W + 1 - first_real)  # real keys j with first_real <= j <= i - W
            if older == 0:
                continue
            log_weight.assign(np.full((HEADS,), np.log(0.7 / older), "float32"))
            ref = np.asarray(
                plain(x[row : row + 1], x[row : row + 1], key_mask=mask[row : row + 1], use_causal_mask=True)
            )
            assert_close(out[row, i], ref[0, i], n=_n(mean), paths=2, what=f"row {row}, query {i}")
            checked += 1
    assert checked == (T - W) + (T - 3 - W)  # every query with an older real key
    # The mean is not the sum: with weight 0.7 on the sum, the rows with older keys differ.
    log_weight.assign(np.full((HEADS,), np.log(0.7), "float32"))
    summed = np.asarray(plain(x, x, key_mask=mask, use_causal_mask=True))
    assert np.abs(summed[0, W + 2 :] - out[0, W + 2 :]).max() > 1e-3


def _oracle(layer, x, mask):
    """Projections, then the float64 window oracle with the unrotated features, then the output projection."""
    q, k, v = layer.project(x, x)
    keep = keras.ops.convert_to_tensor(mask)
    k = _mask_keys(k, keep)
    q_rot, k_rot, _ = layer.attention_inputs(x, x, key_mask=keep, use_causal_mask=True)
    att = layer.recurrence.oracle(q_rot, k_rot, v, k, keep, unrotated=(q, k))
    att = keras.ops.cast(layer.output_norm(keras.ops.cast(att, "float64"), "float64"), "float32")
    return layer.output_dense(att)


def _assert_matches_the_oracle(layer, x, mask):
    """The layer's outputs and weight gradients against `_oracle`'s (float64 attention); returns ``(out, n)``."""
    weights = layer.trainable_variables
    out, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, key_mask=mask, use_causal_mask=True), x, weights)
    ref, ref_grads = _outputs_and_gradients(lambda x_: _oracle(layer, x_, mask), x, weights)
    n = _n(layer)
    assert_close(out, ref, n=n, what="outputs")
    assert_close(grads, ref_grads, n=2 * n + DIM, what="gradients")
    return np.asarray(out), n


# The cache's oracle counts the pairs in the linear state from its own masks (not from the older keys).
CACHES = pytest.mark.parametrize("cache", [None, 2], ids=["window", "cache2"])


@CACHES
@pytest.mark.parametrize("mean", [False, True])
def test_unrotated_features_match_the_float64_oracle(rng, mean, cache):
    layer = _layer(linear_rope=False, linear_mean=mean, gamma=0.4, cache=cache)
    x, mask = _inputs(rng)
    _assert_matches_the_oracle(layer, x, mask)
    # The oracle given the rotated features instead is another function: the option is read.
    q, k, v = layer.attention_inputs(x, x, key_mask=mask, use_causal_mask=True)
    rotated = layer.recurrence.oracle(q, k, v, k, keras.ops.convert_to_tensor(mask))
    unrotated = _oracle(layer, x, mask)
    rotated = layer.output_dense(
        keras.ops.cast(layer.output_norm(keras.ops.cast(rotated, "float64"), "float64"), "float32")
    )
    assert np.abs(np.asarray(rotated) - np.asarray(unrotated)).max() > 1e-3


def _shifted(layer, x, offset):
    """The layer's output from a state holding nothing but a position: every token `offset` places later."""
    state = list(layer.get_initial_state(x.shape[0]))
    names = [entry.name for entry in layer.state_spec()]
    state[names.index("position")] = np.full((x.shape[0],), offset, "float32")
    return np.asarray(layer(x, x, use_causal_mask=True, initial_state=tuple(state)))


@CACHES
def test_unrotated_features_make_the_output_independent_of_absolute_position(rng, cache):
    x = rng.normal(size=(1, T, DIM)).astype("float32")
    unrotated = _layer(linear_rope=False, gamma=0.4, cache=cache)
    fresh = np.asarray(unrotated(x, x, use_causal_mask=True))
    # Only relative positions reach the window's softmax; the positions 1000+ change the rounding alone.
    # Error model: a rotation angle (P + t) * f (f <= 1) is rounded to about (P + T) * eps radians, so
    # each rotated coordinate moves by that relative amount where the error model allows sqrt(n) * eps.
    n = _n(unrotated)
    conditioning = (1000 + T) / np.sqrt(n)
    shifted = _shifted(unrotated, x, 1000.0)
    assert_close(shifted, fresh, n=n, paths=2, conditioning=conditioning, what="shifted by 1000")
    rotated = _layer(gamma=0.4, cache=cache)
    _copy_weights(unrotated, rotated)
    base = np.asarray(rotated(x, x, use_causal_mask=True))
    assert np.abs(_shifted(rotated, x, 1000.0) - base)[:, W:].max() > 1e-2  # rotated features: position matters
    # Inside the window there is no linear part, so the two agree there.
    assert_close(base[:, :W], fresh[:, :W], n=_n(unrotated), paths=2, what="inside the first window")


@CACHES
@pytest.mark.parametrize(
    "options", [{"linear_rope": False}, {"linear_mean": True}, {"linear_rope": False, "linear_mean": True}]
)
def test_steps_and_pieces_equal_one_pass_with_rotary_embeddings(rng, options, cache):
    layer = _layer(cache=cache, **options)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    names = [entry.name for entry in layer.state_spec()]
    assert ("window_k_plain" in names) == ("linear_rope" in options)
    assert ("linear_count" in names) == ("linear_mean" in options)
    assert ("cache_f" in names) == ("linear_rope" in options and cache is not None)
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    assert_close(np.concatenate([a, b], 1), full, n=_n(layer), paths=2, what="pieces")
    for name, p, q in zip(names, st2, state, strict=True):
        assert_close(p, q, n=T, paths=2, what=f"state {name}")
    if "linear_mean" in options:
        count = np.asarray(state[names.index("linear_count")])
        np.testing.assert_array_equal(count, [T - W, T - 3 - W])  # real keys older than the window
    s = layer.get_initial_state(1)
    outs = []
    for t in range(T):
        o, s = layer.step(x[:1, t], x[:1, t], s)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), np.asarray(full)[:1], n=_n(layer), paths=2, what="steps")


def test_without_rotary_embeddings_unrotated_features_change_nothing(rng):
    a = _layer(rope=None, linear_rope=False)
    b = _layer(rope=None)
    _copy_weights(a, b)
    x, mask = _inputs(rng)
    np.testing.assert_array_equal(
        np.asarray(a(x, x, key_mask=mask, use_causal_mask=True)),
        np.asarray(b(x, x, key_mask=mask, use_causal_mask=True)),
    )


def test_shorthand_config_and_errors():
    spec = AttentionSpec.create(feature_map="hedgehog", window_size=4, linear_rope=False, linear_mean=True)
    recurrence = spec.make_recurrence()
    assert isinstance(recurrence, WindowRecurrence)
    assert (recurrence.linear_rope, recurrence.linear_mean, recurrence.reads_unrotated) == (False, True, True)
    assert WindowRecurrence(4).get_config() == {"window_size": 4}  # older configs are unchanged
    config = recurrence.get_config()
    assert config == {"window_size": 4, "linear_rope": False, "linear_mean": True}
    assert WindowRecurrence.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="linear_rope.*needs `window_size`"):
        AttentionSpec.create(linear_rope=False)
    lola = AttentionSpec.create(feature_map="hedgehog", window_size=4, cache_size=2, linear_mean=True).make_recurrence()
    assert isinstance(lola, SparseCacheRecurrence) and (lola.linear_rope, lola.linear_mean) == (True, True)
    assert lola.get_config() == {"window_size": 4, "cache_size": 2, "linear_mean": True}
    assert SparseCacheRecurrence(4, 2).get_config() == {"window_size": 4, "cache_size": 2}
    with pytest.raises(ValueError, match="linear_mean.*needs `window_size`"):
        AttentionSpec.create(linear_mean=True)
    with pytest.raises(ValueError, match="linear_mean"):
        WindowRecurrence(4, linear_mean="yes")


def test_a_layer_with_the_options_round_trips_through_a_keras_file(rng, tmp_path):
    layer = _layer(linear_rope=False, linear_mean=True, linear_weight=0.1)
    x = rng.normal(size=(1, T, DIM)).astype("float32")
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    restored = [layer_ for layer_ in loaded.layers if isinstance(layer_, LinearAttention)][0]
    assert restored.recurrence.get_config() == layer.recurrence.get_config()


def test_a_linearized_student_with_a_covering_window_stays_its_teacher(rng):
    inputs = keras.Input((T, DIM))
    attention = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)
    teacher = keras.Model(inputs, attention(inputs, inputs, use_causal_mask=True))
    student = keras_linattn.linearize(teacher, window_size=T, linear_rope=False, linear_mean=True)
    layer = [layer_ for layer_ in student.layers if isinstance(layer_, LinearAttention)][0]
    assert (layer.recurrence.linear_rope, layer.recurrence.linear_mean) == (False, True)
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    assert_close(student(x), teacher(x), n=T + KEY_DIM + HEADS * KEY_DIM, paths=2, what="covering window")


# ------------------------------------------------------------------ cache_distance
@pytest.mark.parametrize(("mean", "distance"), [(False, 0), (True, 0), (False, W), (True, 7)])
def test_a_cache_at_a_fixed_distance_matches_the_float64_oracle(rng, mean, distance):
    # The cache's logits are the unrotated keys against the unrotated queries rotated to `distance`
    # (cache_q, cache_k); the window's are the rotated q . k.
    layer = _layer(linear_rope=False, linear_mean=mean, gamma=0.4, cache=2, cache_distance=distance)
    x, mask = _inputs(rng)
    out, n = _assert_matches_the_oracle(layer, x, mask)
    # The rotated cache is another function from the first cached pair on: the option is read.
    rotated = _layer(linear_rope=False, linear_mean=mean, gamma=0.4, cache=2)
    _copy_weights(layer, rotated)
    other = np.asarray(rotated(x, x, key_mask=mask, use_causal_mask=True))
    assert np.abs(other - np.asarray(out))[0, W:].max() > 1e-3  # query W reads the first pair to leave
    assert_close(other[:, :W], np.asarray(out)[:, :W], n=n, paths=2, what="before the cache has a pair")


@pytest.mark.parametrize("distance", [0, 5])
def test_a_cache_at_a_fixed_distance_scores_a_pair_the_same_at_any_distance(distance):
    # A pair cached at the start, read by the last query of a row: the cache's logit of that pair is the
    # unrotated q . k whatever the distance, so the last output does not change when filler tokens (all
    # equal) are added between them. Once one filler is in the state, the state recalls every other one
    # exactly, so each goes into the state as it leaves the window and the pair stays cached (checked
    # below); the tiny linear weight keeps the state's terms out of the readout. The window holds the
    # same tokens at the same distances from the query in both rows.
    layer = _layer(linear_rope=False, cache=1, cache_distance=distance, linear_weight=1e-30)
    rotated = _layer(linear_rope=False, cache=1, linear_weight=1e-30)
    _copy_weights(layer, rotated)
    rng = np.random.default_rng(5)
    pair, query = rng.normal(size=(1, 1, DIM)), rng.normal(size=(1, 1, DIM))
    ends = {}
    _, pair_key, _ = layer.project(pair.astype("float32"), pair.astype("float32"))  # [1, 1, H, D] unrotated
    for name, model in (("unrotated", layer), ("rotated", rotated)):
        for gap in (W, W + 20):
            x = np.concatenate([pair, np.zeros((1, gap, DIM)), query], 1).astype("float32")
            out, state = model(x, x, use_causal_mask=True, return_state=True)
            ends[name, gap] = np.asarray(out)[0, -1]
            if name == "unrotated":
                names = [entry.name for entry in model.state_spec()]
                cached = np.asarray(state[names.index("cache_k")])[0, 0]  # [H, D]: the one slot
                # The same projection of the same token, in a row of one and in the whole row.
                assert_close(cached, np.asarray(pair_key)[0, 0], n=DIM, paths=2, what="the cached key")
    assert_close(ends["unrotated", W + 20], ends["unrotated", W], n=_n(layer), paths=2, what="distance")
    assert np.abs(ends["rotated", W + 20] - ends["rotated", W]).max() > 1e-3  # RoPE: the distance shows


def test_a_cache_at_a_fixed_distance_steps_and_pieces_equal_one_pass(rng):
    layer = _layer(linear_rope=False, cache=2, cache_distance=W, gamma=0.4)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    names = [entry.name for entry in layer.state_spec()]
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    assert_close(np.concatenate([a, b], 1), full, n=_n(layer), paths=2, what="pieces")
    for name, p, q in zip(names, st2, state, strict=True):
        assert_close(p, q, n=T, paths=2, what=f"state {name}")
    s = layer.get_initial_state(1)
    outs = []
    for t in range(T):
        o, s = layer.step(x[:1, t], x[:1, t], s)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), np.asarray(full)[:1], n=_n(layer), paths=2, what="steps")
    # The cache keeps the unrotated keys: the last row's cached keys are among the unrotated keys.
    _, k_plain, _ = layer.project(x, x)
    cached = np.asarray(state[names.index("cache_k")])[0]  # [N, H, D]
    valid = np.asarray(state[names.index("cache_valid")])[0]  # [N, H]
    plain = np.asarray(k_plain)[0]  # [T, H, D]
    for slot, head in zip(*np.nonzero(valid), strict=True):
        assert np.abs(plain[:, head] - cached[slot, head]).sum(-1).min() < 1e-5


def test_cache_distance_shorthand_config_and_errors():
    spec = AttentionSpec.create(
        feature_map="hedgehog", window_size=4, cache_size=2, linear_rope=False, cache_distance=4
    )
    recurrence = spec.make_recurrence()
    assert isinstance(recurrence, SparseCacheRecurrence) and recurrence.cache_distance == 4
    assert recurrence.reads_unrotated
    config = recurrence.get_config()
    assert config == {"window_size": 4, "cache_size": 2, "linear_rope": False, "cache_distance": 4}
    assert SparseCacheRecurrence.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="cache_distance.*needs `cache_size`"):
        AttentionSpec.create(window_size=4, cache_distance=0)
    with pytest.raises(ValueError, match="cache_distance.*needs `linear_rope=False`"):
        SparseCacheRecurrence(4, 2, cache_distance=0)
    for bad in (-1, 1.5, "4"):
        with pytest.raises(ValueError, match="cache_distance"):
            SparseCacheRecurrence(4, 2, linear_rope=False, cache_distance=bad)


def test_a_cache_at_a_fixed_distance_is_the_real_distance_for_a_pair_at_that_distance(rng):
    # With T = W + 1 the only pair to leave the window (token 0) is cached and read by query W, at
    # distance W: cache_distance=W gives the real-distance cache's output, another distance does not.
    t = W + 1
    real = _layer(linear_rope=False, cache=1, gamma=0.4)
    x = rng.normal(size=(1, t, DIM)).astype("float32")
    b = np.asarray(real(x, x, use_causal_mask=True))
    outs = {}
    for distance in (W, W + 3):
        fixed = _layer(linear_rope=False, cache=1, cache_distance=distance, gamma=0.4)
        _copy_weights(real, fixed)
        outs[distance] = np.asarray(fixed(x, x, use_causal_mask=True))
    assert_close(outs[W], b, n=_n(real), paths=2, what="the pair's own distance")
    assert np.abs(outs[W + 3][:, W] - b[:, W]).max() > 1e-4
    assert_close(outs[W + 3][:, :W], b[:, :W], n=_n(real), paths=2, what="before the cache has a pair")
