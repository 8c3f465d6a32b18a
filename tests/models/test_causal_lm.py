"""LinearCausalLM: parallel vs recurrent logits, state resume, generate() vs parallel greedy decoding."""

import os

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps, generation, samplers
from keras_linattn.models import LinearCausalLM
from tests._backend import gradients
from tests._helpers import layer_conditioning, run_steps, step_test_feature_map
from tests.tolerance import assert_close, assert_rows_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

VOCAB = 23
FEATURE_MAPS = feature_maps.available()
# The per-map grids below run these maps in `make test` (a positive map, a
# signed one, a random projection, a trainable kernel; for save/load the maps
# that carry weights or a projection), every map in `make test-slow`. Each
# map's step-vs-parallel path also runs in `make test` at the layer level
# (tests/layers/test_cell.py, tests/layers/test_transformer.py).
FAST_STEP_MAPS = {"elu", "taylor", "favor+", "hedgehog"}
FAST_SAVE_MAPS = {"favor+", "hedgehog", "aoglu"}


def _maps(fast):
    return [pytest.param(name, marks=() if name in fast else pytest.mark.slow) for name in FEATURE_MAPS]


def _lm(feature_map="elu", **kwargs):
    kwargs.setdefault("num_layers", 2)
    kwargs.setdefault("hidden_dim", 8)
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("intermediate_dim", 16)
    kwargs.setdefault("chunk_size", 3)
    # Each feature map's LM without the default's convolution: the bounds and chosen tokens here are of it.
    kwargs.setdefault("conv_size", None)
    return LinearCausalLM(vocabulary_size=VOCAB, feature_map=step_test_feature_map(feature_map), **kwargs)


def _n_logits(lm, t):
    """Reduction length of the logits of ``t`` tokens, summed over the path.

    Per block: hidden (attention layer norm) + hidden (q/k/v projections) +
    D (the map's own projection) + S = t keys + C features + H*M (output
    projection) + hidden (feed-forward layer norm) + hidden (feed-forward
    input) + intermediate (feed-forward output). Then hidden (final layer
    norm) + hidden (logits against the embedding).
    """
    n = 2 * lm.hidden_dim
    for block in lm.decoder_blocks:
        att = block.attention
        n += 2 * lm.hidden_dim + att.key_dim + t + att.feature_dim + att.num_heads * att.value_dim
        n += 2 * lm.hidden_dim + lm.intermediate_dim
    return n


def _conditioning(lm, ids, per_channel=False):
    """Worst normalizer conditioning over the blocks' causal self-attention on
    what reaches it (the normalized hidden states of unpadded ``ids``); 1 for
    positive maps."""
    x = lm.backbone.embed(ids, np.arange(ids.shape[1])[None])  # [B, T, hidden]
    worst = 1.0
    for block in lm.decoder_blocks:
        h = block._attention_norm(x)  # [B, T, hidden]: the attention layer's input
        worst = max(worst, layer_conditioning(block.attention, h, h, causal=True, per_channel=per_channel))
        x = block(x)
    return worst


def _ids(rng, batch=2, length=7):
    return rng.integers(1, VOCAB, size=(batch, length)).astype("int32")


def _parallel_greedy(lm, prompt, max_length):
    """Reference decoding: the parallel model on the growing sequence, argmax each time."""
    seq = prompt
    while seq.shape[1] < max_length:
        nxt = np.asarray(lm(seq))[:, -1].argmax(-1).astype("int32")
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("feature_map", _maps(FAST_STEP_MAPS))
def test_step_matches_parallel_for_every_feature_map(rng, feature_map):
    ids = _ids(rng)
    lm = _lm(feature_map)
    parallel = np.asarray(lm(ids))
    stepped, _ = run_steps(lm, ids)
    # Step and parallel are both float32 (paths=2).
    rows = [_conditioning(lm, ids[b : b + 1], per_channel=True) for b in range(ids.shape[0])]
    assert_rows_close(stepped, parallel, n=_n_logits(lm, ids.shape[1]), row_conditioning=rows, paths=2)


@pytest.mark.parametrize("max_sequence_length", [None, 16])
def test_prefill_steps_and_resume_match_one_pass(rng, max_sequence_length):
    ids = _ids(rng, length=11)
    lm = _lm(max_sequence_length=max_sequence_length)
    full = np.asarray(lm(ids))
    state = lm.get_initial_state(2)
    head, state = lm.call_with_state(ids[:, :4], state)
    mid, state = lm.call_with_state(ids[:, 4:8], state)
    tail, state = run_steps(lm, ids[:, 8:], state)
    n = _n_logits(lm, ids.shape[1])  # S = 11 keys at most
    assert_close(np.concatenate([head, mid, tail], axis=1), full, n=n, paths=2, what="resumed")
    np.testing.assert_array_equal(state[-1], [11, 11])
    stepped, _ = run_steps(lm, ids)
    assert_close(stepped, full, n=n, paths=2, what="stepped")


def test_prefill_projects_only_the_last_position(rng, monkeypatch):
    ids = _ids(rng, length=9)
    lm = _lm()
    state = lm.get_initial_state(2)
    full, full_state = lm.call_with_state(ids, state)
    last, last_state = lm.last_logits_with_state(ids, state)
    assert tuple(last.shape) == (2, VOCAB)
    # The same hidden state through the same head, one position instead of nine (paths=2).
    assert_close(last, np.asarray(full)[:, -1], n=_n_logits(lm, ids.shape[1]), paths=2, what="last logits")
    for a, b in zip(last_state, full_state, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    expected = lm.generate(ids, max_length=12)
    # generate's prefill never asks for the logits of every prompt position.
    monkeypatch.setattr(lm, "call_with_state", lambda *a, **k: pytest.fail("prefill ran the head on every position"))
    lm._generation.functions.clear()
    np.testing.assert_array_equal(lm.generate(ids, max_length=12), expected)
    np.testing.assert_array_equal(expected, _parallel_greedy(lm, ids, 12))


def test_recurrent_gradients_match_parallel(rng):
    ids = _ids(rng, length=6)
    lm = _lm()

    def grads(fn):
        def loss():
            logits = fn()
            return keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(ids[:, 1:], logits[:, :-1], from_logits=True)
            ), ()

        return gradients(loss, [], lm.trainable_weights)[1]

    def stepped():
        state, outs = lm.get_initial_state(2), []
        for t in range(ids.shape[1]):
            logits, state = lm.step(ids[:, t], state)
            outs.append(logits)
        return keras.ops.stack(outs, axis=1)

    g_par, g_step = grads(lambda: lm(ids)), grads(stepped)
    # The logits' path + V (the loss's softmax over the vocabulary) + B*T (the
    # positions that share each weight); both sides float32 (paths=2).
    n = _n_logits(lm, ids.shape[1]) + VOCAB + ids.size
    # Per weight, conditioned by the whole gradient's scale over the weight's
    # (e.g. the query biases get tiny sums of larger terms): a weight's
    # absolute error is inherited from the whole backward pass.
    whole = max(float(np.abs(np.asarray(g)).max()) for g in g_par)
    for w, a, b in zip(lm.trainable_weights, g_step, g_par, strict=True):
        scale = float(np.abs(np.asarray(b)).max())
        assert scale > 0, w.path
        assert_close(a, b, n=n, conditioning=whole / scale, paths=2, what=w.path)


# Each map and each position scheme (none, a learned table) in `make test`;
# the other two pairs in `make test-slow`: (None, taylor) has the fast twin
# (None, elu), (20, elu) has the fast twin (20, taylor).
@pytest.mark.parametrize(
    "max_sequence_length,feature_map",
    [
        (None, "elu"),
        pytest.param(None, "taylor", marks=pytest.mark.slow),
        pytest.param(20, "elu", marks=pytest.mark.slow),
        (20, "taylor"),
    ],
)
def test_greedy_generate_equals_parallel_argmax_decoding(rng, feature_map, max_sequence_length):
    lm = _lm(feature_map, max_sequence_length=max_sequence_length)
    prompt = _ids(rng, batch=3, length=4)
    out = lm.generate(prompt, max_length=15, sampler="greedy")
    np.testing.assert_array_equal(out, _parallel_greedy(lm, prompt, 15))
    # Block-wise decoding with a progress bar gives the same tokens.
    np.testing.assert_array_equal(lm.generate(prompt, max_length=15, verbose=True, block_size=4), out)


@pytest.mark.parametrize("max_sequence_length", [None, 20])
def test_left_padded_prompts_generate_like_unpadded(rng, max_sequence_length):
    lm = _lm(max_sequence_length=max_sequence_length)
    long_prompt = _ids(rng, batch=1, length=5)
    short_prompt = _ids(rng, batch=1, length=2)
    batch = np.concatenate([long_prompt, np.concatenate([[[0, 0, 0]], short_prompt], axis=1)]).astype("int32")
    mask = batch != 0  # prompts hold ids >= 1
    out = lm.generate(batch, max_length=12, padding_mask=mask)
    np.testing.assert_array_equal(out[0], lm.generate(long_prompt, max_length=12)[0])
    np.testing.assert_array_equal(out[1, 3:], lm.generate(short_prompt, max_length=9)[0])


def test_stop_tokens_pad_finished_rows(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=3)
    free = lm.generate(prompt, max_length=14)
    stop = int(free[0, 5])
    out = lm.generate(prompt, max_length=14, stop_token_ids=[stop], pad_token_id=VOCAB + 5)
    assert (out[0] == VOCAB + 5).any()
    for row in range(2):
        hits = np.flatnonzero(free[row, 3:] == stop)  # generated positions only
        end = 3 + hits[0] + 1 if len(hits) else 14
        np.testing.assert_array_equal(out[row, :end], free[row, :end])
        assert (out[row, end:] == VOCAB + 5).all()


def test_seeded_sampling_is_reproducible(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=3)
    for sampler in ("random", "top_k", "top_p"):
        a = lm.generate(prompt, max_length=16, sampler=sampler, seed=7)
        b = lm.generate(prompt, max_length=16, sampler=sampler, seed=7)
        np.testing.assert_array_equal(a, b)
    c = lm.generate(prompt, max_length=16, sampler="random", seed=8)
    assert (c != a).any()
    hot = lm.generate(prompt, max_length=16, sampler=samplers.RandomSampler(temperature=1e-4), seed=3)
    np.testing.assert_array_equal(hot, lm.generate(prompt, max_length=16))


def test_generate_returns_prompt_when_nothing_to_generate(rng):
    lm = _lm()
    prompt = _ids(rng, batch=2, length=4)
    np.testing.assert_array_equal(lm.generate(prompt, max_length=4), prompt)


def test_save_and_load(rng, tmp_path):
    lm = _lm("taylor", max_sequence_length=32, tie_embeddings=False, key_dim=2)
    ids = _ids(rng)
    expected = np.asarray(lm(ids))
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored, LinearCausalLM)
    assert_close(restored(ids), expected, n=_n_logits(lm, ids.shape[1]), paths=2)  # two float32 runs
    np.testing.assert_array_equal(restored.generate(ids[:, :3], 10), lm.generate(ids[:, :3], 10))
    assert restored.get_config() == lm.get_config()


# The XLA fit of the LM runs in `make test` as
# tests/training/test_training.py::test_fit_jit_compile_causal_lm.
@pytest.mark.slow
def test_xla_fit_reduces_loss(rng):
    lm = _lm()
    ids = rng.integers(1, VOCAB, size=(16, 9)).astype("int32")
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    history = lm.fit(ids[:, :-1], ids[:, 1:], epochs=4, batch_size=8, verbose=0)
    # Learning criterion (seeded): 4 epochs of Adam(1e-2) lower the training loss.
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_bad_inputs_raise(rng):
    lm = _lm(max_sequence_length=10)
    prompt = _ids(rng, batch=2, length=4)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.zeros((2, 0), "int32"), max_length=5)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.zeros((4,), "int32"), max_length=5)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(np.full((1, 2), VOCAB), max_length=5)
    with pytest.raises(ValueError, match="max_length"):
        lm.generate(prompt, max_length=3)
    with pytest.raises(ValueError, match="max_length"):
        lm.generate(prompt, max_length=11)
    with pytest.raises(ValueError, match="padding_mask"):
        lm.generate(prompt, max_length=6, padding_mask=np.array([[1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="padding_mask"):
        lm.generate(prompt, max_length=6, padding_mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="sampler"):
        lm.generate(prompt, max_length=6, sampler="beam")
    with pytest.raises(ValueError, match="token_ids"):
        lm(np.zeros((1, 11), "int32"))
    state = lm.get_initial_state(2)
    with pytest.raises(ValueError, match="state"):
        lm.step(prompt[:, 0], state[:-1])
    with pytest.raises(ValueError, match="state"):
        lm.step(prompt[:, 0], lm.get_initial_state(3))
    with pytest.raises(ValueError, match="state"):
        lm.call_with_state(prompt, [state[1], state[0]] + state[2:])
    with pytest.raises(ValueError, match="token_t"):
        lm.step(prompt, state)
    with pytest.raises(ValueError, match="hidden_dim"):
        LinearCausalLM(vocabulary_size=5, num_layers=1, hidden_dim=9, num_heads=2, intermediate_dim=4)


def test_mixed_precision_keeps_float32_state(rng):
    keras.config.set_dtype_policy("mixed_bfloat16")
    # One block with a narrow feed-forward: the bfloat16 error model of two
    # blocks (n = 88) allows a relative error >= 0.5, which is no test.
    lm = _lm(num_layers=1, intermediate_dim=8)
    ids = _ids(rng)
    parallel = np.asarray(lm(ids))
    stepped, state = run_steps(lm, ids)
    assert all(keras.backend.standardize_dtype(x.dtype) == "float32" for x in state[:-1])
    assert parallel.dtype == np.float32
    # Both sides round the dense layers in bfloat16 (paths=2); layer norms and
    # the attention accumulate in float32 (negligible next to bfloat16's eps).
    # The state sums keys and values projected over hidden inputs:
    _, par_state = lm.call_with_state(ids, lm.get_initial_state(ids.shape[0]))
    for a, b in zip(state[:-1], par_state[:-1], strict=True):
        assert_close(a, b, n=lm.hidden_dim, dtype="mixed_bfloat16", paths=2, what="state")
    # The logits: hidden (q/k/v projections) + H*M (output projection) +
    # hidden (feed-forward input) + intermediate (feed-forward output) + hidden (logits).
    att = lm.decoder_blocks[0].attention
    n = 3 * lm.hidden_dim + att.num_heads * att.value_dim + lm.intermediate_dim
    assert_close(stepped, parallel, n=n, dtype="mixed_bfloat16", paths=2, what="logits")


@pytest.mark.parametrize("feature_map", _maps(FAST_SAVE_MAPS))
def test_save_and_load_every_feature_map(rng, tmp_path, feature_map):
    lm = _lm(feature_map, num_layers=1)
    ids = _ids(rng)
    # Move every weight off its initial value so a reload that re-initialized
    # anything (e.g. a feature map's kernel or random projection) would show.
    for w in lm.weights:
        w.assign(w + rng.normal(scale=0.05, size=w.shape).astype(w.dtype))
    expected = np.asarray(lm(ids))
    path = os.path.join(tmp_path, "lm.keras")
    lm.save(path)
    restored = keras.models.load_model(path)
    # Two float32 runs of the same weights (paths=2).
    assert_close(restored(ids), expected, n=_n_logits(lm, ids.shape[1]), conditioning=_conditioning(lm, ids), paths=2)


# ------------------------------------------------------- non-finite logits
NAN_PROMPT = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], "int32")
NAN_LENGTH = 11
NAN_SAMPLERS = {"greedy": (samplers.get("greedy"), 0), "top_k": (samplers.get("top_k", k=5), 3)}


def _spread_lm():
    """Untied embeddings, weights of scale 0.5: the tokens of a row vary (the default init repeats one)."""
    lm = _lm(tie_embeddings=False)
    lm(NAN_PROMPT)
    rng = np.random.default_rng(7)
    for w in lm.trainable_weights:
        w.assign((rng.standard_normal(w.shape) * 0.5).astype("float32"))
    return lm


def _first_without_token(clean, tokens, prompt_length=NAN_PROMPT.shape[1]):
    """Per row of `clean` ``[B, L]``: the first position whose logits have seen one of `tokens` (None: never).

    With a NaN input embedding for those tokens, feeding one makes its row's state, and so every
    later logit of that row, NaN (the other rows are untouched): the first position without a token
    is right after the row's first such token (the prompt's end if the prompt holds one).
    """
    first = []
    for row in np.asarray(clean):
        hits = np.flatnonzero(np.isin(row[:-1], list(tokens)))
        first.append(None if not len(hits) else max(int(hits[0]) + 1, prompt_length))
    return first


def _pick_nan_tokens(*cleans, prompt_length=NAN_PROMPT.shape[1]):
    """One or two tokens that, in each clean output, one row meets mid-generation and another never
    (preferring a choice that a prompt holds too)."""
    singles = [(t,) for t in range(VOCAB)]
    pairs = [(a, b) for a in range(VOCAB) for b in range(a + 1, VOCAB)]
    for choices in (singles, pairs):
        candidates = []
        for tokens in choices:
            firsts = [_first_without_token(clean, tokens, prompt_length) for clean in cleans]
            if all(None in f and any(p is not None and p > prompt_length for p in f) for f in firsts):
                candidates.append((not any(prompt_length in f for f in firsts), tokens))
        if candidates:
            return min(candidates)[1]
    raise AssertionError(f"no tokens are met mid-generation by one row and never by another: {cleans}")


def _set_nan_embeddings(lm, tokens):
    embeddings = lm.backbone.token_embedding.embeddings
    value = np.asarray(embeddings).copy()
    value[list(tokens)] = np.nan
    embeddings.assign(value)


def _nan_token_case(sampler_name):
    """``(lm, clean tokens, first)``: `lm` with NaN input embeddings for tokens from `_pick_nan_tokens`;
    ``first`` as `_first_without_token` gives it."""
    lm = _spread_lm()
    sampler, seed = NAN_SAMPLERS[sampler_name]
    clean = lm.generate(NAN_PROMPT, max_length=NAN_LENGTH, sampler=sampler, seed=seed)
    tokens = _pick_nan_tokens(clean)
    _set_nan_embeddings(lm, tokens)
    return lm, clean, _first_without_token(clean, tokens)


@pytest.mark.parametrize("sampler_name", list(NAN_SAMPLERS))
def test_generate_raises_on_nonfinite_logits_naming_row_and_position(sampler_name):
    lm, clean, first = _nan_token_case(sampler_name)
    sampler, seed = NAN_SAMPLERS[sampler_name]
    rows = [r for r, p in enumerate(first) if p is not None]
    for block_size in (None, 2):  # one compiled loop; blocks of 2 end early when every row is done
        with pytest.raises(generation.NonFiniteLogitsError) as info:
            lm.generate(NAN_PROMPT, max_length=NAN_LENGTH, sampler=sampler, seed=seed, block_size=block_size)
        assert f"non-finite logits at row {rows[0]}, position {first[rows[0]]}" in str(info.value)
        assert "NaN" in str(info.value) and "KernelUnderflowError" in str(info.value)
        assert info.value.rows == rows and info.value.positions == [first[r] for r in rows], block_size
    assert isinstance(info.value, FloatingPointError) and isinstance(info.value, ValueError)


def test_decode_loop_writes_the_sentinel_and_other_rows_decode_on():
    """The graphs' contract (SavedModel, ONNX): -1 from the first position without a token, every
    other token as in the clean model, and the step's id checks (graph assertions) never fire.
    Sampled here; greedy through the SavedModel in tests/export/test_generate_parity.py."""
    import tensorflow as tf

    lm, clean, first = _nan_token_case("top_k")
    sampler, seed = NAN_SAMPLERS["top_k"]

    @tf.function  # a graph with the step's id assertions (the SavedModel's form)
    def run(prompt):
        mask = tf.ones_like(prompt)
        return generation.generate_tokens(lm, sampler, prompt, mask, NAN_LENGTH, tf.constant([seed, 0]))

    out = np.asarray(run(tf.constant(NAN_PROMPT)))
    expected = clean.copy()
    for row, position in enumerate(first):
        if position is not None:
            expected[row, position:] = -1
    np.testing.assert_array_equal(out, expected)


def test_generate_raises_where_a_kernel_underflows():
    """favor+ with query/key kernels x100: the eager layer raises KernelUnderflowError; compiled
    decoding gets NaN logits, and `generate` raises instead of returning ids (it returned V)."""
    from keras_linattn.ops.core import KernelUnderflowError

    lm = _lm("favor+")
    lm(NAN_PROMPT)
    for w in lm.weights:
        if w.path.endswith(("query/kernel", "key/kernel")):
            w.assign(np.asarray(w) * 100)
    with pytest.raises(KernelUnderflowError):
        lm(NAN_PROMPT)
    with pytest.raises(generation.NonFiniteLogitsError, match=r"non-finite logits at row 0, position 3"):
        lm.generate(NAN_PROMPT, max_length=8, sampler="top_k", seed=1)


def test_generate_refuses_the_sentinel_as_pad_token_id(rng):
    with pytest.raises(ValueError, match=r"pad_token_id.*-1"):
        _lm().generate(_ids(rng), max_length=9, pad_token_id=-1)


def test_a_traced_prefill_returns_the_state_with_the_spec_shapes():
    """A window buffer cut from the prompt has a length the trace cannot know: prefill gives it the spec's."""
    import tensorflow as tf

    lm = _lm(feature_map="hedgehog", window_size=4)
    spec = lm.state_spec()

    @tf.function(input_signature=[tf.TensorSpec((None, None), tf.int32)])
    def traced(ids):
        state = lm.get_initial_state(tf.shape(ids)[0])
        raw = lm.call_with_state(ids, state, training=False)[1]
        return generation.prefill(lm, ids, tf.ones_like(ids, tf.bool), state)[1], raw

    fixed, raw = traced.get_concrete_function().structured_outputs
    assert any(tuple(x.shape[1:]) != tuple(e.shape) for x, e in zip(raw, spec, strict=True))  # what a trace loses
    for x, entry in zip(fixed, spec, strict=True):
        assert tuple(x.shape[1:]) == tuple(entry.shape), entry.name
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 7)).astype("int32")
    got, want = traced(ids)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
