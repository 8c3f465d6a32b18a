"""What pretrained softmax models need from LinearAttention: RoPE, GQA, the window's gamma, identity hedgehog maps.

Every value check is against a float64 reference written from the maths
(`_reference`: projections, repeated key/value heads, rotary embeddings,
hedgehog features and the windowed softmax + linear attention, all in
float64), never against the layer's own output.
"""

import json

import keras
import numpy as np
import pytest
from keras import ops

import keras_linattn
from keras_linattn import feature_maps
from keras_linattn.layers import LinearAttention, LinearAttentionCell, LinearTransformerDecoder
from keras_linattn.models import LinearCausalLM
from keras_linattn.ops import rotary as rotary_ops
from keras_linattn.ops import window as window_ops
from tests._helpers import _outputs_and_gradients, assert_fits_with_xla, run_steps, save_and_load
from tests.tolerance import assert_close, bound, rel_err

DIM, HEADS, KV_HEADS, KEY_DIM, T = 16, 4, 2, 6, 11
ROPE = dict(rope_max_wavelength=10000, rope_scaling_factor=1.0)


def _layer(window_size=4, gamma=0.1, kv=KV_HEADS, rope=ROPE, **kwargs):
    """Hedgehog (separate q/k maps) + window + gamma + GQA + RoPE, weights spread so every term matters."""
    args = dict(num_heads=HEADS, key_dim=KEY_DIM, chunk_size=4, num_key_value_heads=kv, **rope, **kwargs)
    if window_size is not None:
        args.update(window_size=window_size, window_gamma=gamma)
    args.setdefault("feature_map", feature_maps.get("hedgehog", share_qk=False))
    args.setdefault("conv_size", None)  # the float64 reference and the state layouts here have no convolution
    layer = LinearAttention(**args)
    layer.build((None, None, DIM), (None, None, DIM))
    rng = np.random.default_rng(5)
    for w in layer.weights:
        if "gamma" in w.path:
            w.assign(rng.normal(size=w.shape) - 1.0)  # per-head gammas, away from their shared init
        else:
            w.assign(np.asarray(w) + 0.3 * rng.normal(size=w.shape))
    return layer


def _hedgehog64(fm, x, is_query):
    branch = fm._branches["qk" if fm.share_qk else ("query" if is_query else "key")]
    logits = ops.einsum("bthd,hdf->bthf", x, ops.cast(branch["kernel"], "float64"))
    if fm.use_bias:
        logits = logits + ops.cast(branch["bias"], "float64")
    return ops.concatenate([ops.softmax(logits, axis=-1), ops.softmax(-logits, axis=-1)], axis=-1)


def _reference(layer, x, mask=None):
    """The layer's function in float64, from its weights and the maths (causal self-attention)."""
    f64 = lambda w: ops.cast(w, "float64")  # noqa: E731
    x = f64(x)

    def dense(d, equation):
        y = ops.einsum(equation, x, f64(d.kernel))
        return y + f64(d.bias) if layer.use_bias else y

    q = dense(layer.query_dense, "btd,dhk->bthk")  # [B, T, H, D]
    k = dense(layer.key_dense, "btd,dhk->bthk")  # [B, T, kv, D]
    v = dense(layer.value_dense, "btd,dhk->bthk")  # [B, T, kv, M]
    groups = layer.num_heads // k.shape[2]
    k, v = ops.repeat(k, groups, axis=2), ops.repeat(v, groups, axis=2)  # head h reads kv head h // G
    if layer.rope_max_wavelength is not None:
        m = np.ones(x.shape[:2]) if mask is None else np.asarray(mask, "float64")
        positions = np.cumsum(m, axis=1) - m  # real tokens before each token
        rope = (layer.rope_max_wavelength, layer.rope_scaling_factor)
        q = rotary_ops.rotary_embedding_reference(q, positions, *rope)
        k = rotary_ops.rotary_embedding_reference(k, positions, *rope)
    qf, kf = _hedgehog64(layer.feature_map, q, True), _hedgehog64(layer.feature_map, k, False)
    recurrence = layer.recurrence
    if getattr(recurrence, "window_size", None) is not None:
        gamma = None if recurrence.gamma is None else ops.sigmoid(f64(recurrence.gamma_logit))
        att = window_ops.window_attention_reference(
            q, qf, k, kf, v, recurrence.window_size, mask, eps=layer.epsilon, compute_dtype="float64", gamma=gamma
        )
    else:
        from keras_linattn.ops import kernel_attention_reference

        att = kernel_attention_reference(qf, kf, v, causal=True, key_mask=mask)
    out = ops.einsum("bthm,hmd->btd", f64(att), f64(layer.output_dense.kernel)) + f64(layer.output_dense.bias)
    return ops.cast(out, "float32")  # one last rounding, for the float32 loss of the gradient helper


def _n(layer):
    return T + layer.feature_dim + KEY_DIM + HEADS * layer.value_dim


def _rope_conditioning(length):
    # The angle p * inv_freq carries a rounding error ~ eps * p: it grows with the position.
    return float(length)


def _inputs(rng, batch=2):
    x = rng.normal(size=(batch, T, DIM)).astype("float32")
    mask = np.ones((batch, T), bool)
    mask[1, :3] = False  # a left-padded row
    return x, mask


# -------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("wavelength, scaling", [(10000, 1.0), (500000, 4.0)])
def test_rope_equals_keras_hub_rotary_embedding(rng, wavelength, scaling):
    keras_hub = pytest.importorskip("keras_hub")
    x = rng.normal(size=(2, 9, 3, 8)).astype("float32")  # [B, T, H, D]
    start = 5
    hub = keras_hub.layers.RotaryEmbedding(max_wavelength=wavelength, scaling_factor=scaling)(x, start_index=start)
    positions = np.broadcast_to(np.arange(9) + start, (2, 9))
    ours = rotary_ops.rotary_embedding(x, positions, wavelength, scaling)
    ref = rotary_ops.rotary_embedding_reference(x, positions, wavelength, scaling)
    assert_close(ours, ref, n=8, conditioning=_rope_conditioning(9 + start), what="ours vs float64")
    assert_close(hub, ref, n=8, conditioning=_rope_conditioning(9 + start), what="keras-hub vs float64")
    assert_close(ours, hub, n=8, conditioning=_rope_conditioning(9 + start), paths=2, what="ours vs keras-hub")


def test_rope_keeps_dot_products_relative(rng):
    q = rng.normal(size=(1, 1, 1, 8)).astype("float32")
    k = rng.normal(size=(1, 1, 1, 8)).astype("float32")

    def score(i, j):
        rq = rotary_ops.rotary_embedding_reference(q, np.array([[i]]), 10000.0)
        rk = rotary_ops.rotary_embedding_reference(k, np.array([[j]]), 10000.0)
        return float(ops.sum(rq * rk))

    np.testing.assert_allclose(score(7, 3), score(4, 0), rtol=1e-12)
    assert abs(score(7, 3) - score(3, 3)) > 1e-3


# ----------------------------------------------------- outputs and gradients
@pytest.mark.parametrize(
    "config",
    [
        dict(),  # RoPE + GQA + window + gamma together
        dict(window_size=None),  # RoPE + GQA, plain linear attention
        dict(rope={}, kv=None),  # the window's gamma alone
        dict(rope={}, window_size=None, kv=1),  # GQA alone (multi-query)
    ],
    ids=["all", "rope_gqa", "gamma", "mqa"],
)
def test_outputs_and_gradients_match_the_float64_reference(rng, config):
    layer = _layer(**config)
    x, mask = _inputs(rng)
    weights = layer.trainable_variables
    out, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, key_mask=mask, use_causal_mask=True), x, weights)
    ref, ref_grads = _outputs_and_gradients(lambda x_: _reference(layer, x_, mask), x, weights)
    n, c = _n(layer), _rope_conditioning(T)
    assert_close(out, ref, n=n, conditioning=c, what="outputs")
    assert_close(grads, ref_grads, n=2 * n + DIM, conditioning=c, what="gradients")


def test_gqa_kernels_have_key_value_heads_and_the_state_keeps_num_heads():
    layer = _layer()
    assert tuple(layer.query_dense.kernel.shape) == (DIM, HEADS, KEY_DIM)
    assert tuple(layer.key_dense.kernel.shape) == (DIM, KV_HEADS, KEY_DIM)
    assert tuple(layer.value_dense.kernel.shape) == (DIM, KV_HEADS, KEY_DIM)
    spec = {e.name: e for e in layer.state_spec()}
    assert spec["S"].shape[0] == HEADS and spec["position"].shape == ()


def _as_multi_head(layer, **kwargs):
    """The same function without grouped-query attention: the key/value kernels repeated per query head."""
    groups = HEADS // KV_HEADS
    mha = _layer(kv=None, **kwargs)
    for ours, theirs in zip(layer.weights, mha.weights, strict=True):
        value = np.asarray(ours)
        if ours is layer.key_dense.kernel or ours is layer.value_dense.kernel:
            value = np.repeat(value, groups, axis=1)  # [dim, kv, D] -> [dim, H, D]: head h reads h // G
        elif ours is layer.key_dense.bias or ours is layer.value_dense.bias:
            value = np.repeat(value, groups, axis=0)
        theirs.assign(value)
    return mha


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(linear_rope=False, linear_mean=True),
        dict(cache_size=2),
        dict(cache_size=2, linear_rope=False, cache_distance=4),
        dict(cache_size=2, linear_rope=False, cache_max_distance=5),
    ],
    ids=["window", "length", "lola", "lola_fixed_distance", "lola_clamped_distance"],
)
def test_gqa_window_buffers_keep_the_key_value_heads(rng, kwargs):
    """Under GQA the window's key/value buffers hold one head per group (a quarter at Llama 3.2 1B's
    32/8 heads), repeated when read: outputs and states equal those of the same layer with its
    key/value kernels repeated per query head (plain multi-head attention), whose buffers are the
    GQA buffers repeated; in one pass, in two pieces and token by token."""
    layer = _layer(**kwargs)
    mha = _as_multi_head(layer, **kwargs)
    spec = {e.name: e.shape for e in layer.state_spec()}
    assert layer.recurrence.buffer_heads == KV_HEADS and mha.recurrence.buffer_heads == HEADS
    assert spec["window_k"] == (4, KV_HEADS, KEY_DIM) and spec["window_v"] == (4, KV_HEADS, KEY_DIM)
    if "linear_rope" in kwargs:
        assert spec["window_k_plain"] == (4, KV_HEADS, KEY_DIM)
    if "cache_size" in kwargs:  # the cache decides per query head: it keeps them all
        assert spec["cache_k"] == (2, HEADS, KEY_DIM)
    x, mask = _inputs(rng)
    n, c = _n(layer), _rope_conditioning(T)
    out, state = layer(x[:, :6], x[:, :6], key_mask=mask[:, :6], use_causal_mask=True, return_state=True)
    want, want_state = mha(x[:, :6], x[:, :6], key_mask=mask[:, :6], use_causal_mask=True, return_state=True)
    assert_close(out, want, n=n, conditioning=c, paths=2, what="one pass")
    names = [e.name for e in layer.state_spec()]
    for name, got, ref in zip(names, state, want_state, strict=True):
        got = np.asarray(got)
        if name.startswith("window_") and name != "window_valid":
            got = np.repeat(got, HEADS // KV_HEADS, axis=2)
        assert_close(got, np.asarray(ref), n=n, conditioning=c, paths=2, what=f"state {name}")
    tail = layer(x[:, 6:], x[:, 6:], key_mask=mask[:, 6:], use_causal_mask=True, initial_state=state)
    tail_mha = mha(x[:, 6:], x[:, 6:], key_mask=mask[:, 6:], use_causal_mask=True, initial_state=want_state)
    assert_close(tail, tail_mha, n=n, conditioning=c, paths=2, what="second piece")
    steps, _ = run_steps(layer, x[:1], self_attention=True)
    steps_mha, _ = run_steps(mha, x[:1], self_attention=True)
    assert_close(steps, steps_mha, n=n, conditioning=c, paths=2, what="steps")
    one_pass = layer(x[:1], x[:1], use_causal_mask=True)
    assert_close(steps, one_pass, n=n, conditioning=c, paths=2, what="steps against one pass")


def test_gqa_buffers_keep_every_head_with_a_short_convolution():
    """A short convolution has a kernel per head, so the heads of a group differ after it."""
    layer = _layer(conv_size=3)
    assert layer.recurrence.buffer_heads == HEADS
    assert {e.name: e.shape for e in layer.state_spec()}["window_k"] == (4, HEADS, KEY_DIM)


# ------------------------------------------------------- step == parallel
@pytest.mark.parametrize("config", [dict(), dict(window_size=None)], ids=["window_gamma", "linear"])
def test_step_pieces_and_left_padding_equal_one_pass(rng, config):
    layer = _layer(**config)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    n, c = _n(layer), _rope_conditioning(T)
    position = dict(zip([e.name for e in layer.state_spec()], state, strict=True))["position"]
    np.testing.assert_array_equal(np.asarray(position), mask.sum(1))
    # Token by token (row 0, no padding) from an empty state.
    steps, step_state = run_steps(layer, x[:1], self_attention=True)
    assert_close(steps, np.asarray(full)[:1], n=n, conditioning=c, paths=2, what="steps")
    # Two pieces chained through the state, padded batch included.
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    assert_close(np.concatenate([a, b], 1), full, n=n, conditioning=c, paths=2, what="pieces")
    # The left-padded row is the unpadded sequence (padding takes no position).
    unpadded = layer(x[1:, 3:], x[1:, 3:], use_causal_mask=True)
    assert_close(np.asarray(full)[1:, 3:], unpadded, n=n, conditioning=c, paths=2, what="left padding")
    # The padded row, continued by steps, equals the unpadded row's one pass.
    st_pad = layer(x[1:, :8], x[1:, :8], key_mask=mask[1:, :8], use_causal_mask=True, return_state=True)[1]
    tail, _ = run_steps(layer, x[1:, 8:], state=st_pad, self_attention=True)
    assert_close(tail, np.asarray(unpadded)[:, 5:], n=n, conditioning=c, paths=2, what="padded prefill then steps")


def test_the_rnn_cell_carries_the_position(rng):
    layer = _layer()
    x, _ = _inputs(rng)
    out = keras.layers.RNN(LinearAttentionCell(layer), return_sequences=True)(x)
    ref = _reference(layer, x)
    assert_close(out, ref, n=_n(layer), conditioning=_rope_conditioning(T), what="RNN(cell)")


# ------------------------------------------------------------ window gamma
def test_a_window_covering_the_sequence_is_exact_softmax_whatever_gamma(rng):
    layer = _layer(window_size=T, kv=None)
    gammas = np.asarray(ops.sigmoid(layer.recurrence.gamma_logit))
    assert np.ptp(gammas) > 0.05 and gammas.max() < 0.9  # per-head gammas far from 1
    x, _ = _inputs(rng)
    out = layer(x, x, use_causal_mask=True)
    q, k, v = (ops.cast(a, "float64") for a in layer.project(x, x))  # [B, T, H, D|D|M]
    positions = np.broadcast_to(np.arange(T), (2, T))
    q = rotary_ops.rotary_embedding_reference(q, positions, 10000.0)
    k = rotary_ops.rotary_embedding_reference(k, positions, 10000.0)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(KEY_DIM)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    att = np.einsum("bhts,bshm->bthm", weights, np.asarray(v))
    expected = np.einsum("bthm,hmd->btd", att, np.asarray(layer.output_dense.kernel, "float64"))
    expected += np.asarray(layer.output_dense.bias, "float64")
    # Projections are float32 in both (the reference starts from them): the
    # error is the window's softmax over T keys of D-term scores.
    assert_close(out, expected, n=T + KEY_DIM + HEADS * KEY_DIM, conditioning=_rope_conditioning(T), what="softmax")


def test_gamma_changes_the_mix_when_the_window_is_shorter(rng):
    layer = _layer(window_size=2, rope={}, kv=None)
    x, _ = _inputs(rng)
    before = np.asarray(layer(x, x, use_causal_mask=True))
    layer.recurrence.gamma_logit.assign(np.full((HEADS,), 3.0, "float32"))
    assert rel_change(before, np.asarray(layer(x, x, use_causal_mask=True))) > 1e-3


def rel_change(a, b):
    return float(np.abs(a - b).max() / np.abs(a).max())


def test_default_window_has_no_gamma_weight_and_a_round2_config():
    layer = LinearAttention(2, 4, window_size=3, conv_size=None)  # the window's state alone
    layer.build((None, None, 8), (None, None, 8))
    assert not any("gamma" in w.path for w in layer.weights)
    assert layer.get_config()["recurrence"]["config"] == {"window_size": 3}
    assert layer.get_config()["num_key_value_heads"] is None and layer.get_config()["rope_max_wavelength"] is None
    assert [e.name for e in layer.state_spec()] == ["S", "z", "window_k", "window_v", "window_valid"]


def test_gamma_starts_at_the_given_value():
    layer = LinearAttention(HEADS, KEY_DIM, window_size=3, window_gamma=0.1)
    layer.build((None, None, DIM), (None, None, DIM))
    np.testing.assert_allclose(np.asarray(ops.sigmoid(layer.recurrence.gamma_logit)), np.full(HEADS, 0.1), rtol=1e-6)
    assert layer.recurrence.gamma_logit.trainable


# --------------------------------------------------------- identity hedgehog
def test_separate_hedgehog_maps_start_as_the_identity(rng):
    fm = feature_maps.get("hedgehog", share_qk=False)
    x = rng.normal(size=(2, 5, 3, KEY_DIM)).astype("float32")  # [B, T, H, D]
    for is_query in (True, False):
        phi = np.asarray(fm(x, is_query=is_query))
        x64 = x.astype("float64")
        expected = np.concatenate(
            [np.exp(x64) / np.exp(x64).sum(-1, keepdims=True), np.exp(-x64) / np.exp(-x64).sum(-1, keepdims=True)],
            -1,
        )
        assert_close(phi, expected, n=KEY_DIM, what="phi = [softmax(x), softmax(-x)]")
    assert {w.path.split("/")[-1] for w in fm.weights} == {"query_kernel", "query_bias", "key_kernel", "key_bias"}


# ------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_key_value_heads=3), "`num_key_value_heads` must divide `num_heads`"),
        (dict(num_key_value_heads=0), "num_key_value_heads"),
        (dict(rope_max_wavelength=-1.0), "rope_max_wavelength"),
        (dict(rope_max_wavelength=1e4, rope_scaling_factor=0.0), "rope_scaling_factor"),
        (dict(window_gamma=0.1), "needs `window_size`"),
        (dict(window_size=3, window_gamma=1.0), "window_gamma"),
        (dict(recurrence="window", window_gamma=0.1), "Pass either `recurrence`"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LinearAttention(4, 6, **kwargs)


def test_rope_needs_an_even_key_dim():
    with pytest.raises(ValueError, match="even `key_dim`"):
        LinearAttention(2, 5, rope_max_wavelength=10000)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LinearCausalLM(
            vocabulary_size=20, num_layers=1, hidden_dim=16, num_heads=4, intermediate_dim=32, num_key_value_heads=3
        )
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LinearTransformerDecoder(4, 32, num_key_value_heads=3)


# ------------------------------------------------------ config and saving
def test_config_round_trip_and_keras_file(rng, tmp_path):
    layer = _layer()
    config = layer.get_config()
    assert config["num_key_value_heads"] == KV_HEADS and config["rope_max_wavelength"] == 10000.0
    assert config["recurrence"]["config"] == {"window_size": 4, "gamma": 0.1}

    def without_map_name(c):  # as JSON (tuples are lists in a file); a rebuilt map gets a fresh layer name
        c = json.loads(json.dumps(c))
        c["feature_map"]["config"]["name"] = None
        return c

    assert without_map_name(LinearAttention.from_config(config).get_config()) == without_map_name(config)
    inputs = keras.Input((T, DIM))
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    x, _ = _inputs(rng)
    loaded = save_and_load(model, tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
    assert without_map_name(loaded.layers[-1].get_config()) == without_map_name(config)


def test_the_lm_carries_the_arguments_to_every_block_and_decodes_like_its_parallel_pass(rng, tmp_path):
    lm = LinearCausalLM(
        vocabulary_size=40,
        num_layers=2,
        hidden_dim=16,
        num_heads=4,
        intermediate_dim=32,
        chunk_size=4,
        feature_map="hedgehog",
        window_size=3,
        window_gamma=0.1,
        num_key_value_heads=2,
        rope_max_wavelength=10000,
    )
    tokens = rng.integers(1, 40, size=(2, 9)).astype("int32")
    mask = np.ones((2, 9), bool)
    mask[1, :2] = False
    logits = np.asarray(lm(tokens, padding_mask=mask))
    for block in lm.decoder_blocks:
        att = block.attention
        assert att.num_key_value_heads == 2 and att.rope_max_wavelength == 10000.0
        assert att.recurrence.gamma == 0.1
    assert f"{lm.decoder_blocks[0].name}/position" in [e.name for e in lm.state_spec()]
    state = lm.get_initial_state(1)
    outs = []
    for t in range(9):
        out, state = lm.step(tokens[:1, t], state)
        outs.append(np.asarray(out))
    n = 9 + 2 * 16 + 16 + 32
    assert_close(np.stack(outs, 1), logits[:1], n=n, paths=2, conditioning=9.0, what="LM steps")
    unpadded = np.asarray(lm(tokens[1:, 2:]))
    assert_close(logits[1:, 2:], unpadded, n=n, paths=2, conditioning=9.0, what="LM left padding")
    loaded = save_and_load(lm, tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded(tokens, padding_mask=mask)), logits)


# ------------------------------------------------------ a keras-hub teacher
def test_copied_llama_attention_weights_give_the_teachers_output(rng):
    """keras-hub's LlamaAttention (RoPE + GQA, no bias) vs LinearAttention with its weights and W >= T."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.models.llama.llama_attention import LlamaAttention

    dim, heads, kv, t = 24, 4, 2, 10
    teacher = LlamaAttention(num_query_heads=heads, num_key_value_heads=kv, rope_max_wavelength=10000)
    teacher.build((None, None, dim))
    student = LinearAttention(
        heads,
        dim // heads,
        feature_map=feature_maps.get("hedgehog", share_qk=False),
        use_bias=False,
        conv_size=None,  # the teacher's function: no convolution
        window_size=t,
        window_gamma=0.1,
        num_key_value_heads=kv,
        rope_max_wavelength=10000,
    )
    student.build((None, None, dim), (None, None, dim))
    for ours, theirs in (
        (student.query_dense, teacher._query_dense),
        (student.key_dense, teacher._key_dense),
        (student.value_dense, teacher._value_dense),
        (student.output_dense, teacher._output_dense),
    ):
        ours.kernel.assign(theirs.kernel)
    x = rng.normal(size=(2, t, dim)).astype("float32")
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (2, t, t))
    expected = teacher(x, attention_mask=causal)
    out = student(x, x, use_causal_mask=True)
    assert keras_hub is not None
    assert_close(out, expected, n=t + dim + heads * (dim // heads), conditioning=float(t), paths=2, what="teacher")


def test_attention_inputs_are_the_rotated_repeated_heads(rng):
    layer = _layer()
    x, mask = _inputs(rng)
    q, k, v = layer.attention_inputs(x, x, key_mask=mask, use_causal_mask=True)
    q0, k0, v0 = layer.project(x, x)  # [B, T, H, D]: GQA heads repeated, before RoPE
    m = mask.astype("float64")
    positions = np.cumsum(m, axis=1) - m
    assert_close(q, rotary_ops.rotary_embedding_reference(q0, positions), n=KEY_DIM, conditioning=float(T))
    expected_k = rotary_ops.rotary_embedding_reference(k0, positions) * mask[:, :, None, None]
    assert_close(k, expected_k, n=KEY_DIM, conditioning=float(T))
    np.testing.assert_array_equal(np.asarray(k)[:, :, 0], np.asarray(k)[:, :, 1])  # one kv head, two query heads


def test_fits_under_xla(rng):
    inputs = keras.Input((16, 8))
    layer = LinearAttention(  # the mechanisms under test, without the default's taylor map and convolution
        4,
        4,
        feature_map="elu",
        conv_size=None,
        chunk_size=8,
        window_size=4,
        window_gamma=0.1,
        num_key_value_heads=2,
        rope_max_wavelength=10000,
    )
    model = keras.Model(inputs, keras.layers.Dense(8)(layer(inputs, inputs, use_causal_mask=True)))
    assert_fits_with_xla(model, rng)
    assert np.asarray(layer.recurrence.gamma_logit).std() > 0  # gamma is trained, per head


def test_non_causal_rope_numbers_queries_and_keys_by_index(rng):
    layer = _layer(window_size=None, kv=None, feature_map="elu")
    x, mask = _inputs(rng)
    q, k, _ = layer.attention_inputs(x, x, key_mask=mask, use_causal_mask=False)
    q0, k0, _ = layer.project(x, x)
    positions = np.broadcast_to(np.arange(T), (2, T))
    assert_close(q, rotary_ops.rotary_embedding_reference(q0, positions), n=KEY_DIM, conditioning=float(T))
    expected_k = rotary_ops.rotary_embedding_reference(k0, positions) * mask[:, :, None, None]
    assert_close(k, expected_k, n=KEY_DIM, conditioning=float(T))
    out = layer(x, x, key_mask=mask)  # the encoder's form: runs, finite
    assert np.isfinite(np.asarray(out)).all()


# Llama-3.2-1B's published rope_scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
LLAMA_3_2_ADJUSTMENT = (32.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_llama3_frequency_adjustment_equals_keras_hub_llama_rotary_embedding(rng, head_dim):
    from keras_hub.src.models.llama.llama_rotary_embedding import LlamaRotaryEmbedding

    factor, low, high, length = LLAMA_3_2_ADJUSTMENT
    hub = LlamaRotaryEmbedding(
        max_wavelength=500000.0,
        frequency_adjustment_factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        pretraining_sequence_length=length,
    )
    # Positions past the pretraining length, where the adjusted low frequencies differ most.
    positions = np.array([[0, 7, 8191, 8192, 20000, 40000]], "float32")
    x = rng.normal(size=(1, positions.shape[1], 2, head_dim)).astype("float32")
    hub_out = np.asarray(hub(x, positions=positions))
    ours = np.asarray(rotary_ops.rotary_embedding(x, positions, 500000.0, 1.0, LLAMA_3_2_ADJUSTMENT))
    ref = np.asarray(
        rotary_ops.rotary_embedding_reference(x, positions, 500000.0, frequency_adjustment=LLAMA_3_2_ADJUSTMENT)
    )
    conditioning = _rope_conditioning(40001)
    assert_close(ours, ref, n=head_dim, conditioning=conditioning, what="ours vs float64")
    assert_close(hub_out, ref, n=head_dim, conditioning=conditioning, what="keras-hub vs float64")
    assert_close(ours, hub_out, n=head_dim, conditioning=conditioning, paths=2, what="ours vs keras-hub")
    unadjusted = np.asarray(rotary_ops.rotary_embedding(x, positions, 500000.0))
    # Without the adjustment the rotation is another one: outside the same bound.
    assert rel_err(unadjusted, ref) > bound("float32", n=head_dim, conditioning=conditioning)


def test_frequency_adjustment_needs_four_positive_factors_and_no_linear_scaling():
    x = np.zeros((1, 1, 1, 4), "float32")
    positions = np.zeros((1, 1), "float32")
    with pytest.raises(ValueError, match="Received: rope_frequency_adjustment=\\(32.0, 1.0\\)"):
        rotary_ops.rotary_embedding(x, positions, 10000.0, 1.0, (32.0, 1.0))
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        rotary_ops.rotary_embedding(x, positions, 10000.0, 1.0, (32.0, 4.0, 1.0, 8192))
    with pytest.raises(ValueError, match="scaling_factor=2.0"):
        rotary_ops.rotary_embedding(x, positions, 10000.0, 2.0, LLAMA_3_2_ADJUSTMENT)
    with pytest.raises(ValueError, match="needs `rope_max_wavelength`"):
        keras_linattn.layers.AttentionSpec.create(rope_frequency_adjustment=LLAMA_3_2_ADJUSTMENT)


def test_frequency_adjustment_round_trips_through_config_and_is_no_key_when_unset():
    layer = LinearAttention(
        num_heads=2, key_dim=8, rope_max_wavelength=500000.0, rope_frequency_adjustment=[32, 1, 4, 8192]
    )
    config = json.loads(json.dumps(layer.get_config()))
    assert config["rope_frequency_adjustment"] == list(LLAMA_3_2_ADJUSTMENT)
    assert LinearAttention.from_config(config).rope_frequency_adjustment == LLAMA_3_2_ADJUSTMENT
    # A layer without it writes the config it wrote before the argument existed.
    assert (
        "rope_frequency_adjustment" not in LinearAttention(num_heads=2, key_dim=8, rope_max_wavelength=1e4).get_config()
    )


def test_qk_norm_normalizes_each_head_before_rope_and_round_trips(rng):
    layer = LinearAttention(num_heads=2, key_dim=8, rope_max_wavelength=1e4, qk_norm_epsilon=1e-5)
    layer.build((None, None, 16), (None, None, 16))
    x = rng.normal(size=(1, 5, 16)).astype("float32")
    q, k, _ = layer.project(x, x)
    rms = np.sqrt(np.mean(np.asarray(q, "float64") ** 2, axis=-1))  # scale 1 at init: unit RMS per head
    np.testing.assert_allclose(rms, 1.0, atol=1e-4)
    assert [w.path.split("/")[-2] for w in layer.weights[-2:]] == ["query_norm", "key_norm"]
    config = json.loads(json.dumps(layer.get_config()))
    assert LinearAttention.from_config(config).qk_norm_epsilon == 1e-5
    plain = LinearAttention(num_heads=2, key_dim=8, rope_max_wavelength=1e4)
    plain.build((None, None, 16), (None, None, 16))
    assert "qk_norm_epsilon" not in plain.get_config() and plain.query_norm is None


def test_partial_rotary_rotates_the_leading_entries_as_keras_hub_does(rng):
    keras_hub = pytest.importorskip("keras_hub")
    x = rng.normal(size=(2, 9, 3, 16)).astype("float32")  # [B, T, H, D]
    positions = np.broadcast_to(np.arange(9), (2, 9))
    hub = keras_hub.layers.RotaryEmbedding(max_wavelength=10000.0)(x[..., :4])  # GPT-NeoX: the first 4 of 16
    ours = np.asarray(rotary_ops.rotary_embedding(x, positions, 10000.0, rotary_dim=4))
    np.testing.assert_array_equal(ours[..., 4:], x[..., 4:])
    assert_close(ours[..., :4], hub, n=4, conditioning=_rope_conditioning(9), paths=2)
    with pytest.raises(ValueError, match="Received: rotary_dim=5"):
        rotary_ops.rotary_embedding(x, positions, 10000.0, rotary_dim=5)
