"""The sparse cache scored at the real distance up to L and at L beyond (`cache_max_distance`), with rotary embeddings.

Each property is checked against another computation of the same function:

- the float64 oracle (`sparse_cache_attention_reference` with both forms of
  the queries and keys), outputs and gradients;
- plain softmax attention (numpy, float64) where window + cache cover the
  row and L covers every distance;
- the real-distance cache for a pair within L, the fixed-distance cache
  (``cache_distance=L``) for a pair beyond L, whatever the gap;
- steps and pieces equal one pass (outputs, states and gradients), with a
  state of one size at any length (the ages clamped at L + 1).

The contract battery (tests/contracts) runs the option too, through
`SparseCacheRecurrence.contract_configs` (export parity included).
"""

import keras
import numpy as np
import pytest

from keras_linattn.layers import AttentionSpec, LinearAttention
from keras_linattn.recurrences import SparseCacheRecurrence
from tests._helpers import _outputs_and_gradients
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

T, DIM, HEADS, KEY_DIM, W = 13, 16, 2, 8, 3
ROPE = 50.0


def _layer(cache=2, seed=3, **options):
    """Hedgehog + LoLA's cache with `options`, rotary embeddings, weights spread."""
    layer = LinearAttention(
        HEADS,
        KEY_DIM,
        feature_map="hedgehog",
        conv_size=None,  # the oracle's unrotated forms come from `project`, which stops before the convolution
        chunk_size=4,
        recurrence=SparseCacheRecurrence(W, cache, linear_rope=False, **options),
        rope_max_wavelength=ROPE,
    )
    layer.build((None, None, DIM), (None, None, DIM))
    rng = np.random.default_rng(seed)
    for w in layer.weights:
        if "gamma" not in w.path and "linear_weight" not in w.path:
            w.assign(rng.normal(size=w.shape).astype("float32") * 0.5)
    return layer


def _copy_weights(source, target):
    values = {w.path.split("/", 1)[1]: w for w in source.weights}
    for w in target.weights:
        name = w.path.split("/", 1)[1]
        if name in values:
            w.assign(values[name])


def _inputs(rng, t=T):
    x = rng.normal(size=(2, t, DIM)).astype("float32")
    mask = np.ones((2, t), bool)
    mask[1, :3] = False  # a left-padded row
    return x, mask


def _n(layer, t=T):
    return t + layer.feature_dim + KEY_DIM + HEADS * layer.value_dim


def _oracle(layer, x, mask):
    """Rotated and unrotated projections, the recurrence's float64 oracle, the output projection."""
    keep = keras.ops.convert_to_tensor(mask)
    q, k, v = layer.attention_inputs(x, x, key_mask=mask, use_causal_mask=True)
    q_plain, k_plain, _ = layer.project(x, x)
    att = layer.recurrence.oracle(q, k, v, k, keep, unrotated=(q_plain, k_plain))
    return layer.output_dense(keras.ops.cast(layer.output_norm(keras.ops.cast(att, "float64"), "float64"), "float32"))


def _softmax(layer, x, mask):
    """Plain causal softmax attention over the rotated queries and keys (numpy, float64), then the projection."""
    q, k, v = (np.asarray(a, "float64") for a in layer.attention_inputs(x, x, key_mask=mask, use_causal_mask=True))
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(KEY_DIM)
    t = q.shape[1]
    allowed = np.tril(np.ones((t, t), bool))[None, None] & mask[:, None, None, :]
    scores = np.where(allowed, scores, -np.inf)
    peak = scores.max(-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))  # a padded query's row: all zeros
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    att = np.einsum("bhts,bshm->bthm", weights, v)
    return layer.output_dense(keras.ops.cast(layer.output_norm(att, "float64"), "float32"))


@pytest.mark.parametrize(("bound", "gamma", "mean"), [(0, 0.4, False), (4, None, False), (5, 0.4, True)])
def test_the_clamped_cache_matches_the_float64_oracle(rng, bound, gamma, mean):
    layer = _layer(cache_max_distance=bound, gamma=gamma, linear_mean=mean)
    x, mask = _inputs(rng)
    weights = layer.trainable_variables
    out, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, key_mask=mask, use_causal_mask=True), x, weights)
    ref, ref_grads = _outputs_and_gradients(lambda x_: _oracle(layer, x_, mask), x, weights)
    n = _n(layer)
    assert_close(out, ref, n=n, what="outputs")
    assert_close(grads, ref_grads, n=2 * n + DIM, what="gradients")
    # The real-distance cache is another function; so is the fixed-distance one (cache_distance=L) once a
    # cached pair is read within L. With L < W every cached pair is beyond L: then it is that one.
    for other in ({}, {"cache_distance": bound}):
        twin = _layer(gamma=gamma, linear_mean=mean, **other)
        _copy_weights(layer, twin)
        twin_out = np.asarray(twin(x, x, key_mask=mask, use_causal_mask=True))
        if other and bound < W:
            assert_close(twin_out, out, n=n, paths=2, what="every pair beyond L")
        else:
            assert np.abs(twin_out - np.asarray(out)).max() > 1e-4


def test_a_covering_window_and_cache_within_the_bound_is_softmax_attention(rng):
    # W + N >= T: nothing reaches the linear state, gamma cancels; L >= T - 1: every cached pair at its
    # real distance. So the layer is causal softmax attention over the rotated queries and keys.
    layer = _layer(cache=T - W, cache_max_distance=T, gamma=0.3)
    x, mask = _inputs(rng)
    out = np.asarray(layer(x, x, key_mask=mask, use_causal_mask=True))
    ref = np.asarray(_softmax(layer, x, mask))
    assert_close(out[mask], ref[mask], n=_n(layer), paths=2, what="softmax")


@pytest.mark.parametrize("gap", [W, W + 2])
def test_a_pair_within_the_bound_is_scored_at_its_real_distance(rng, gap):
    # A pair read `gap + 1` tokens after it (at most L): the real-distance cache's output, not the fixed one's.
    bound = W + 3
    layer = _layer(cache=1, cache_max_distance=bound, gamma=0.4)
    real = _layer(cache=1, gamma=0.4)
    fixed = _layer(cache=1, cache_distance=bound, gamma=0.4)
    for twin in (real, fixed):
        _copy_weights(layer, twin)
    x = rng.normal(size=(1, gap + 1, DIM)).astype("float32")
    out, ref, far = (np.asarray(m(x, x, use_causal_mask=True)) for m in (layer, real, fixed))
    assert_close(out, ref, n=_n(layer), paths=2, what="real distance")
    assert np.abs(far[:, -1] - out[:, -1]).max() > 1e-4


def test_a_pair_beyond_the_bound_is_scored_at_the_bound_whatever_the_gap():
    # A pair cached at the start, read by the last query after 10 or 30 equal fillers (both gaps beyond L):
    # its logit is that of distance L, so the last output is the fixed-distance cache's (cache_distance=L)
    # and the same for both gaps. Once one filler is in the state the state recalls every other exactly,
    # so each goes into the state and the pair stays cached; the tiny linear weight keeps the state's terms
    # out of the readout; the window holds the same tokens at the same distances in both rows.
    bound = W + 2
    layer = _layer(cache=1, cache_max_distance=bound, linear_weight=1e-30)
    fixed = _layer(cache=1, cache_distance=bound, linear_weight=1e-30)
    real = _layer(cache=1, linear_weight=1e-30)
    for twin in (fixed, real):
        _copy_weights(layer, twin)
    rng = np.random.default_rng(5)
    pair, query = rng.normal(size=(1, 1, DIM)), rng.normal(size=(1, 1, DIM))
    ends = {}
    for gap in (10, 30):
        x = np.concatenate([pair, np.zeros((1, gap, DIM)), query], 1).astype("float32")
        for name, model in (("clamped", layer), ("fixed", fixed), ("real", real)):
            ends[name, gap] = np.asarray(model(x, x, use_causal_mask=True))[0, -1]
    n = _n(layer, 32)
    for gap in (10, 30):
        assert_close(ends["clamped", gap], ends["fixed", gap], n=n, paths=2, what=f"at the bound, gap {gap}")
    assert_close(ends["clamped", 30], ends["clamped", 10], n=n, paths=2, what="any gap")
    assert np.abs(ends["real", 30] - ends["real", 10]).max() > 1e-3  # RoPE: the real distance shows


def test_steps_and_pieces_equal_one_pass(rng):
    layer = _layer(cache_max_distance=4, gamma=0.4)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    names = [entry.name for entry in layer.state_spec()]
    assert {"cache_k", "cache_k_plain", "cache_age"} <= set(names)
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    n = _n(layer)
    assert_close(np.concatenate([a, b], 1), full, n=n, paths=2, what="pieces")
    for name, p, q in zip(names, st2, state, strict=True):
        assert_close(p, q, n=T, paths=2, what=f"state {name}")
    s = layer.get_initial_state(1)
    outs = []
    for t in range(T):
        o, s = layer.step(x[:1, t], x[:1, t], s)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), np.asarray(full)[:1], n=n, paths=2, what="steps")


@pytest.mark.slow
def test_step_gradients_equal_the_parallel_forms(rng):
    layer = _layer(cache_max_distance=4, gamma=0.4)
    x, _ = _inputs(rng)
    n = _n(layer)

    def steps(x_):
        s = layer.get_initial_state(1)
        outs = []
        for t in range(T):
            o, s = layer.step(x_[:, t], x_[:, t], s)
            outs.append(o)
        return keras.ops.stack(outs, axis=1)

    weights = layer.trainable_variables
    one, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, use_causal_mask=True), x[:1], weights)
    stepped, step_grads = _outputs_and_gradients(steps, x[:1], weights)
    assert_close(stepped, one, n=n, paths=2, what="steps")
    assert_close(step_grads, grads, n=2 * n + DIM, paths=2, what="step gradients")


def test_the_state_has_one_size_at_any_length_and_the_ages_stay_bounded(rng):
    bound = 4
    layer = _layer(cache_max_distance=bound)
    sizes = {}
    for t in (T, 5 * T):
        x = rng.normal(size=(1, t, DIM)).astype("float32")
        _, state = layer(x, x, use_causal_mask=True, return_state=True)
        sizes[t] = [tuple(part.shape) for part in state]
        names = [entry.name for entry in layer.state_spec()]
        age = np.asarray(state[names.index("cache_age")])
        valid = np.asarray(state[names.index("cache_valid")])
        assert valid.all() and age.min() >= W and age.max() <= bound + 1  # full cache, ages in [W, L + 1]
    assert sizes[T] == sizes[5 * T]
    assert age.max() == bound + 1  # a pair far back: past the bound, clamped


def test_cache_max_distance_shorthand_config_and_errors():
    spec = AttentionSpec.create(
        feature_map="hedgehog", window_size=4, cache_size=2, linear_rope=False, cache_max_distance=16
    )
    recurrence = spec.make_recurrence()
    assert isinstance(recurrence, SparseCacheRecurrence) and recurrence.cache_max_distance == 16
    config = recurrence.get_config()
    assert config == {"window_size": 4, "cache_size": 2, "linear_rope": False, "cache_max_distance": 16}
    assert SparseCacheRecurrence.from_config(config).get_config() == config
    with pytest.raises(ValueError, match="cache_max_distance.*needs `cache_size`"):
        AttentionSpec.create(window_size=4, cache_max_distance=8)
    with pytest.raises(ValueError, match="cache_max_distance.*needs `linear_rope=False`"):
        SparseCacheRecurrence(4, 2, cache_max_distance=8)
    with pytest.raises(ValueError, match="cache_max_distance.*cache_distance=2"):
        SparseCacheRecurrence(4, 2, linear_rope=False, cache_distance=2, cache_max_distance=8)
    for bad in (-1, 1.5, "4"):
        with pytest.raises(ValueError, match="cache_max_distance"):
            SparseCacheRecurrence(4, 2, linear_rope=False, cache_max_distance=bad)


def test_eager_calls_of_several_key_widths_share_the_compiled_loop():
    # The eager selection loop is one `tf.function` with `reduce_retracing`: calls of several widths and
    # lengths relax its signature to unknown sizes, and the packed keys must still unpack.
    outs = []
    for key_dim, t in ((8, T), (4, 7), (6, 9), (2, 5)):
        layer = LinearAttention(
            HEADS,
            key_dim,
            feature_map="hedgehog",
            conv_size=None,  # as `_layer`
            recurrence=SparseCacheRecurrence(W, 2, linear_rope=False, cache_max_distance=4),
            rope_max_wavelength=ROPE,
        )
        x = np.random.default_rng(key_dim).normal(size=(2, t, DIM)).astype("float32")
        outs.append(np.asarray(layer(x, x, use_causal_mask=True)))
        assert outs[-1].shape == (2, t, DIM) and np.isfinite(outs[-1]).all()
