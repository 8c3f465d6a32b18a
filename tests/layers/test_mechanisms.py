"""LinearAttention's recall mechanisms (decay, normalize=False, conv_size, window_size) and their combinations.

The layer against an oracle composed from the float64 references of `ops`
(outputs and gradients with respect to the input and every weight), step ==
parallel, pieces, left padding, XLA, mixed precision, `.keras` round trips,
the blocks and the LM, and bad arguments.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_linattn import ops as lops
from keras_linattn.layers import LinearAttention, LinearTransformerDecoder, LinearTransformerEncoder
from keras_linattn.layers._output_norm import OUTPUT_NORM_EPSILON
from keras_linattn.models import LinearCausalLM
from keras_linattn.ops.core import _mask_keys
from keras_linattn.recurrences import AdditiveRecurrence, DeltaRecurrence, WindowRecurrence
from tests._backend import flat, gradients, xla
from tests.tolerance import assert_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

DIM, HEADS, KEY_DIM, T, CHUNK = 16, 2, 8, 13, 4

CONFIGS = {
    "fixed": dict(decay="fixed"),
    "scalar": dict(decay="scalar"),
    "channel": dict(decay="channel"),
    "unnormalized": dict(normalize=False),
    "scalar_unnormalized": dict(decay="scalar", normalize=False),
    "conv": dict(conv_size=4),
    "window": dict(window_size=4),
    "based": dict(feature_map="taylor", key_dim=4, conv_size=3, window_size=5),
    "scalar_conv": dict(decay="scalar", conv_size=4),
    "channel_conv_unnormalized": dict(decay="channel", conv_size=2, normalize=False),
    "delta": dict(update="delta", normalize=False),
    "gated_delta_conv_identity": dict(update="delta", normalize=False, decay="scalar", conv_size=4, feature_map=None),
}
# Each mechanism as its entry names it: elu and no convolution unless named (not the package's default).
CONFIGS = {name: {"feature_map": "elu", "conv_size": None, **cfg} for name, cfg in CONFIGS.items()}


def _layer(name, **extra):
    cfg = dict(CONFIGS[name])
    key_dim = cfg.pop("key_dim", KEY_DIM)
    layer = LinearAttention(HEADS, key_dim, chunk_size=CHUNK, **cfg, **extra)
    layer.build((None, None, DIM), (None, None, DIM))
    if getattr(layer.recurrence, "gate", None) == "scalar":
        # The gate kernel starts at zero (a data-independent gate); give it
        # values so that the tests see a gate that differs from token to token.
        kernel = layer.recurrence.gate_kernel
        kernel.assign(0.3 * np.random.default_rng(1).normal(size=kernel.shape))
    return layer


def _inputs(rng, batch=2, t=T):
    x = rng.normal(size=(batch, t, DIM)).astype("float32")
    mask = np.ones((batch, t), bool)
    mask[1, :3] = False  # a left-padded row
    return x, mask


def _oracle(layer, x, mask):
    """The layer's projections, gates and maps; every sum over time by a float64 reference of `ops`."""
    q, k, v = layer.project(x, x)  # [B, T, H, D|D|M]
    keep = ops.convert_to_tensor(mask)
    k = _mask_keys(k, keep)
    gate_input = k
    if layer.conv_size is not None:
        conv = layer.short_conv
        q = lops.causal_conv_reference(q, conv.conv_q, mask=keep)
        k = lops.causal_conv_reference(k, conv.conv_k, mask=keep)
        v = lops.causal_conv_reference(v, conv.conv_v, mask=keep)
    if layer.feature_map is None:
        qf, kf = q, k
    else:
        qf = layer.feature_map(q, is_query=True, causal=True)
        kf = layer.feature_map(k, is_query=False, causal=True)
    recurrence = layer.recurrence
    if isinstance(recurrence, DeltaRecurrence):
        # The layer's normalization (its 1e-12 keeps all-zero padded rows at 0).
        qf, kf = (x * keras.ops.rsqrt(keras.ops.sum(x * x, axis=-1, keepdims=True) + 1e-12) for x in (qf, kf))
        g = recurrence.log_decay(gate_input)
        att = lops.delta_rule_reference(qf, kf, v, recurrence.beta(gate_input), g, key_mask=keep)[0]
    elif isinstance(recurrence, WindowRecurrence):
        att = lops.window_attention_reference(q, qf, k, kf, v, recurrence.window_size, keep, eps=layer.epsilon)
    else:
        if isinstance(recurrence, AdditiveRecurrence):
            g = ops.zeros(tuple(q.shape[:3]) + (1,))
        else:
            g = recurrence.log_decay(gate_input)
        att = lops.gated_linear_attention_reference(
            qf, kf, v, g, key_mask=keep, normalize=recurrence.normalize, eps=layer.epsilon, compute_dtype="float64"
        )[0]
    if not recurrence.normalize:
        a = ops.cast(att, "float64")
        a = a * ops.rsqrt(ops.mean(a * a, axis=-1, keepdims=True) + OUTPUT_NORM_EPSILON)
        att = ops.cast(a, "float32") * layer.output_norm.scale
    return layer.output_dense(att)


def _out_and_grads(fn, x, weights):
    """``fn(x)`` and the gradients of a fixed cosine-weighted sum of it with respect to ``x`` and ``weights``."""

    def loss(x_):
        out = fn(x_)
        return ops.sum(out * ops.cos(ops.arange(out.shape[-1], dtype="float32"))), out

    out, grads = gradients(loss, [x], weights)
    return out, flat(grads)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_the_composed_oracle(rng, name):
    layer = _layer(name)
    x, mask = _inputs(rng)
    weights = layer.trainable_variables
    out, grads = _out_and_grads(lambda x_: layer(x_, x_, key_mask=mask, use_causal_mask=True), x, weights)
    ref, ref_grads = _out_and_grads(lambda x_: _oracle(layer, x_, mask), x, weights)
    # The paths share the projections and maps; they differ in the attention
    # sums: T keys, C features (or D window logits), K conv taps, H*M output.
    n = T + layer.feature_dim + KEY_DIM + (layer.conv_size or 0) + HEADS * layer.value_dim
    # Exponents are differences of float32 cumulative sums of log decay
    # (docs/dev/testing.md): 1 + their largest magnitude within a chunk (1 without decay).
    conditioning = layer.recurrence.conditioning(layer.project(x, x)[1])
    assert_close(out, ref, n=n, conditioning=conditioning, what="outputs")
    # Backward adds the sums over T queries, M values and the DIM inputs.
    assert_close(grads, ref_grads, n=2 * n + DIM, conditioning=conditioning, what="gradients")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_pieces_and_left_padding_equal_one_pass(rng, name):
    layer = _layer(name)
    x, mask = _inputs(rng)
    full, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    assert len(state) == len(layer.state_spec())
    for entry, part in zip(layer.state_spec(), state, strict=True):
        assert tuple(part.shape) == (2,) + entry.shape and part.dtype == "float32", entry.name
    n = T + layer.feature_dim + KEY_DIM + (layer.conv_size or 0) + HEADS * layer.value_dim
    # Two pieces chained through the state.
    a, st = layer(x[:, :5], x[:, :5], key_mask=mask[:, :5], use_causal_mask=True, return_state=True)
    b, st2 = layer(x[:, 5:], x[:, 5:], key_mask=mask[:, 5:], use_causal_mask=True, return_state=True, initial_state=st)
    assert_close(np.concatenate([a, b], 1), full, n=n, paths=2, what="pieces")
    for entry, p, q in zip(layer.state_spec(), st2, state, strict=True):
        assert_close(p, q, n=T, paths=2, what=f"state {entry.name}")
    # Token by token (row 0 has no padding).
    s = layer.get_initial_state(1)
    outs = []
    for t in range(T):
        o, s = layer.step(x[:1, t], x[:1, t], s)
        outs.append(np.asarray(o))
    assert_close(np.stack(outs, 1), np.asarray(full)[:1], n=n, paths=2, what="steps")
    # The left-padded row equals the same tokens unpadded.
    unpadded = layer(x[1:, 3:], x[1:, 3:], use_causal_mask=True)
    assert_close(np.asarray(full)[1:, 3:], unpadded, n=n, paths=2, what="left padding")


# XLA: the configurations that exercise every op kind (decay matmuls, channel
# chunks, conv, window, the delta rule's loop) in `make test`; the rest in `make test-slow`.
FAST_XLA = {"based", "scalar_conv", "channel_conv_unnormalized", "gated_delta_conv_identity"}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in FAST_XLA else pytest.mark.slow) for name in CONFIGS]
)
def test_xla_matches_eager_and_fit_runs(rng, name):
    layer = _layer(name)
    x, mask = _inputs(rng)
    eager = layer(x, x, key_mask=mask, use_causal_mask=True)
    compiled = xla(lambda a, m: layer(a, a, key_mask=m, use_causal_mask=True))(x, mask)
    n = T + layer.feature_dim + KEY_DIM + (layer.conv_size or 0) + HEADS * layer.value_dim
    assert_close(compiled, eager, n=n, paths=2, what="XLA vs eager")
    inp = keras.Input((T, DIM))
    model = keras.Model(
        inp,
        LinearAttention(HEADS, KEY_DIM, chunk_size=CHUNK, **{k: v for k, v in CONFIGS[name].items() if k != "key_dim"})(
            inp, inp, use_causal_mask=True
        ),
    )
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    y = rng.normal(size=x.shape).astype("float32")
    history = model.fit(x, y, epochs=3, batch_size=2, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["scalar", "channel", "conv", "based", "scalar_unnormalized", "delta"])
def test_mixed_bfloat16_is_close_to_float32_with_a_float32_state(rng, name):
    ref = _layer(name)
    x, mask = _inputs(rng)
    expected = ref(x, x, key_mask=mask, use_causal_mask=True)
    keras.config.set_dtype_policy("mixed_bfloat16")
    layer = _layer(name)
    for w_ref, w in zip(ref.weights, layer.weights, strict=True):
        w.assign(w_ref)
    out, state = layer(x, x, key_mask=mask, use_causal_mask=True, return_state=True)
    assert all(part.dtype == "float32" for part in state)
    n = DIM + T + layer.feature_dim + (layer.conv_size or 0) + HEADS * layer.value_dim
    assert_close(out, expected, n=n, dtype="bfloat16", what="bf16 vs float32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_keras_round_trip(rng, tmp_path, name):
    cfg = dict(CONFIGS[name])
    inp = keras.Input((None, DIM))
    layer = LinearAttention(HEADS, cfg.pop("key_dim", KEY_DIM), chunk_size=CHUNK, **cfg)
    model = keras.Model(inp, layer(inp, inp, use_causal_mask=True))
    x, _ = _inputs(rng)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded(x), model(x))
    restored = loaded.layers[-1]
    assert type(restored.recurrence) is type(layer.recurrence)
    assert restored.recurrence.get_config() == layer.recurrence.get_config()
    assert restored.conv_size == layer.conv_size


def test_state_spec_describes_every_mechanism():
    layer = _layer("based")
    names = [e.name for e in layer.state_spec()]
    assert names == ["S", "z", "conv_q", "conv_k", "conv_v", "window_k", "window_v", "window_valid"]
    c = layer.feature_dim
    assert [e.shape for e in layer.state_spec()] == [
        (HEADS, c, 4),
        (HEADS, c),
        (2, HEADS, 4),
        (2, HEADS, 4),
        (2, HEADS, 4),
        (5, HEADS, 4),
        (5, HEADS, 4),
        (5,),
    ]
    assert [e.name for e in _layer("scalar").state_spec()] == ["S", "z"]
    assert [e.name for e in _layer("delta").state_spec()] == ["S"]


def test_fixed_decay_is_retnets():
    layer = _layer("fixed")
    g = np.exp(np.asarray(layer.recurrence.log_decay(ops.zeros((1, 1, HEADS, KEY_DIM))))[0, 0, :, 0])
    np.testing.assert_allclose(g, 1 - 2.0 ** (-5 - np.arange(HEADS)), rtol=1e-6)


def test_scalar_gate_starts_at_its_bias_rate_for_every_token(rng):
    # The gate kernel starts at zero and A_log at 0: before training every
    # token decays the state at exp(-softplus(bias)), whatever it holds, with
    # softplus(bias) in [1e-3, 1e-2] (a memory of 100 to 1,000 tokens).
    layer = LinearAttention(HEADS, KEY_DIM, decay="scalar", seed=3)
    layer.build((None, None, DIM), (None, None, DIM))
    k = ops.convert_to_tensor(rng.normal(size=(2, 7, HEADS, KEY_DIM)) * 10, "float32")
    g = np.asarray(layer.recurrence.log_decay(k))[..., 0]  # [B, S, H]
    a = np.exp(np.asarray(layer.recurrence.a_log, "float64"))
    dt = np.log1p(np.exp(np.asarray(layer.recurrence.gate_bias, "float64")))
    assert (a == 1.0).all() and ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 1e-2 * (1 + 1e-5))).all(), (a, dt)
    # A chain of four float32 roundings (exp, softplus, product, sum with the
    # zero data term): n = 4.
    assert_close(g, np.broadcast_to(-a * dt, g.shape), n=4, what="initial log decay")


def test_gates_are_in_the_unit_interval(rng):
    for name in ("scalar", "channel"):
        layer = _layer(name)
        k = ops.convert_to_tensor(rng.normal(size=(2, 7, HEADS, KEY_DIM)) * 10, "float32")
        g = np.asarray(layer.recurrence.log_decay(k))
        assert (g <= 0).all() and np.isfinite(g).all(), name


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(decay="exponential"), "`decay` must be one of"),
        (dict(decay=True), "`decay` must be one of"),
        (dict(normalize=1), "`normalize` must be a bool"),
        (dict(conv_size=1), "`conv_size` must be None or an integer >= 2"),
        (dict(conv_size=2.0), "`conv_size` must be a positive integer or None"),
        (dict(window_size=0), "`window_size` must be a positive int"),
        (dict(window_size=4, decay="scalar"), "`window_size` cannot be combined with `decay`"),
        (dict(window_size=4, normalize=False), "`window_size` needs `normalize=True`"),
        (dict(update="replace"), "`update` must be one of"),
        (dict(update="delta"), "pass `normalize=False`"),
        (dict(update="delta", normalize=False, decay="channel"), "takes `decay=None`, 'fixed' or 'scalar'"),
        (dict(feature_map=None), "`feature_map=None` .* needs `update='delta'`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearAttention(HEADS, KEY_DIM, **kwargs)
    with pytest.raises(ValueError, match=match):
        LinearTransformerDecoder(HEADS, 32, **kwargs)
    with pytest.raises(ValueError, match=match):
        LinearCausalLM(vocabulary_size=20, num_layers=1, hidden_dim=DIM, num_heads=HEADS, intermediate_dim=32, **kwargs)


def test_causal_mechanisms_refuse_non_causal_use(rng):
    x, _ = _inputs(rng)
    for name in ("scalar", "window", "delta"):
        with pytest.raises(ValueError, match="causal recurrence"):
            _layer(name)(x, x)
        with pytest.raises(ValueError, match="this attention is not causal"):
            LinearTransformerEncoder(HEADS, 32, **CONFIGS[name])
    # A causal convolution is fine in an encoder.
    block = LinearTransformerEncoder(HEADS, 32, conv_size=3)
    assert block(x).shape == x.shape


@pytest.mark.parametrize("name", ["scalar_conv", "based", "channel_conv_unnormalized", "gated_delta_conv_identity"])
def test_lm_step_matches_parallel_and_round_trips(rng, tmp_path, name):
    cfg = dict(CONFIGS[name])
    lm = LinearCausalLM(
        vocabulary_size=40, num_layers=2, hidden_dim=DIM, num_heads=HEADS, intermediate_dim=32, chunk_size=CHUNK, **cfg
    )
    ids = rng.integers(1, 40, size=(2, T)).astype("int32")
    full = np.asarray(lm(ids))
    state = lm.get_initial_state(2)
    outs = []
    for t in range(T):
        logits, state = lm.step(ids[:, t], state)
        outs.append(np.asarray(logits))
    n = 2 * (T + lm.decoder_blocks[0].attention.feature_dim + DIM + 32) + DIM
    assert_close(np.stack(outs, 1), full, n=n, paths=2, what="LM step vs parallel")
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    np.testing.assert_array_equal(keras.models.load_model(path)(ids), full)


def test_decode_state_does_not_grow(rng):
    lm = LinearCausalLM(
        vocabulary_size=40,
        num_layers=1,
        hidden_dim=DIM,
        num_heads=HEADS,
        intermediate_dim=32,
        conv_size=4,
        window_size=8,
        decay=None,
    )
    state = lm.get_initial_state(1)
    shapes = [tuple(s.shape) for s in state]
    for t in range(40):
        _, state = lm.step(np.array([t % 40], "int32"), state)
    assert [tuple(s.shape) for s in state] == shapes
