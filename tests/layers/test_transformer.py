"""LinearTransformerDecoder / LinearTransformerEncoder: parallel vs recurrent, masks, gradients, saving."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.layers import LinearTransformerDecoder, LinearTransformerEncoder
from tests._helpers import layer_conditioning, run_steps, step_test_feature_map
from tests.conftest import TEST_SEED
from tests.tolerance import assert_close, assert_rows_close

# numeric: run again with oneDNN off (`make test-onednn-off`)
pytestmark = pytest.mark.numeric

DIM = 8
T = 7
FEATURE_MAPS = feature_maps.available()


def _block(cls, feature_map="elu", **kwargs):
    kwargs.setdefault("num_heads", 2)
    kwargs.setdefault("intermediate_dim", 16)
    kwargs.setdefault("chunk_size", 3)
    # The oracles and the (S, z) state here are of the feature map alone, not of the default's convolution.
    kwargs.setdefault("conv_size", None)
    if isinstance(feature_map, str):
        feature_map = step_test_feature_map(feature_map)
    block = cls(feature_map=feature_map, **kwargs)
    block.build((None, None, DIM))
    return block


def _n_block(block, s):
    """Reduction length of a block's output with ``s`` keys: DIM (attention
    layer norm) + DIM (q/k/v projections) + D (the map's own projection) + S
    keys + C features + H*M (output projection) + DIM (feed-forward layer
    norm) + DIM (feed-forward input) + intermediate (feed-forward output)."""
    att = block.attention
    n = 2 * DIM + att.key_dim + s + att.feature_dim + att.num_heads * att.value_dim
    return n + 2 * DIM + block.intermediate_dim


def _n_state(block, s):
    """Reduction length of the state ``S = sum_s phi(k_s) v_s^T`` (and ``z``):
    DIM (layer norm) + DIM (projections) + D (the map's own projection) + S keys."""
    return 2 * DIM + block.attention.key_dim + s


def _conditioning(block, x, causal, key_mask=None, per_channel=False):
    """Normalizer conditioning of the block's self-attention on what reaches it
    (the normalized inputs); 1 for positive maps."""
    h = block._attention_norm(x)  # [B, T, DIM]
    return layer_conditioning(block.attention, h, h, causal=causal, key_mask=key_mask, per_channel=per_channel)


def _reference_block(block, x, causal, key_mask=None):
    """The block's maths with its own weights and the quadratic attention oracle."""
    att = block.attention
    h = block._attention_norm(x)
    q, k, v = att.project(h, h)
    qf = att.feature_map(q, is_query=True, causal=causal)
    kf = att.feature_map(k, is_query=False, causal=causal)
    a = att.output_dense(lops.kernel_attention_reference(qf, kf, v, causal=causal, key_mask=key_mask))
    x = x + a
    f = block._ffn_output(block._ffn_intermediate(block._ffn_norm(x)))
    return x + f


@pytest.mark.parametrize("cls,causal", [(LinearTransformerDecoder, True), (LinearTransformerEncoder, False)])
def test_block_matches_oracle_outputs_and_gradients(rng, cls, causal):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[1, 5:] = False
    block = _block(cls)
    target = rng.normal(size=x.shape).astype("float32")

    def loss_and_grads(fn):
        with tf.GradientTape() as tape:
            y = fn()
            loss = tf.reduce_sum(tf.where(mask[..., None], (y - target) ** 2, 0.0))
        return y, tape.gradient(loss, block.trainable_weights)

    y, g = loss_and_grads(lambda: block(x, padding_mask=mask))
    y_ref, g_ref = loss_and_grads(lambda: _reference_block(block, x, causal, key_mask=mask))
    # The reference shares the block's float32 layer norms, projections and
    # feed-forward; its attention is the float64 oracle (paths=1).
    n = _n_block(block, T)
    assert_close(np.where(mask[..., None], y, 0), np.where(mask[..., None], y_ref, 0), n=n, what="outputs")
    # A weight's gradient adds the sum over the B*T positions that share it;
    # per weight, conditioned by the whole gradient's scale over the weight's
    # (its absolute error is inherited from the whole backward pass).
    n_grad = n + x.shape[0] * T
    whole = max(float(np.abs(np.asarray(b)).max()) for b in g_ref)
    for w, a, b in zip(block.trainable_weights, g, g_ref, strict=True):
        scale = float(np.abs(np.asarray(b)).max())
        assert scale > 0, w.path
        assert_close(a, b, n=n_grad, conditioning=whole / scale, what=w.path)


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_decoder_step_matches_parallel(rng, feature_map):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder, feature_map)
    parallel, (s, z) = block(x, return_state=True)
    stepped, (s_step, z_step) = run_steps(block, x)
    # Step and parallel are both float32 (paths=2).
    rows = [_conditioning(block, x[b : b + 1], causal=True, per_channel=True) for b in range(x.shape[0])]
    assert_rows_close(stepped, parallel, n=_n_block(block, T), row_conditioning=rows, paths=2, what="outputs")
    assert_close(s_step, s, n=_n_state(block, T), paths=2, what="S")
    assert_close(z_step, z, n=_n_state(block, T), paths=2, what="z")


def _assert_step_is_streaming_encoding(block, x):
    """Step t of the encoder equals the (non-causal) encoding of x[:, :t+1] at t."""
    stepped, _ = run_steps(block, x)
    # Query t of the prefix sees keys 0..t: the causal rows of the whole x.
    conditioning = _conditioning(block, x, causal=True)
    for t in range(x.shape[1]):
        prefix = np.asarray(block(x[:, : t + 1]))
        # Both float32 (paths=2), over S = t + 1 keys.
        assert_close(
            stepped[:, t], prefix[:, t], n=_n_block(block, t + 1), conditioning=conditioning, paths=2, what=f"{t=}"
        )


# favor_trig is left out: where a query's denominator phi(q).z is negative,
# `linear_attention` floors it at eps * sum|phi(q)| (documented), and the
# floored output scales with the keys' norm factor, which the non-causal form
# (per-sequence max) and the step (causal cap) choose differently: there the
# two forms differ by O(1), not by rounding. Its streaming equality where the
# kernel is positive is the next test.
@pytest.mark.parametrize("feature_map", [name for name in FEATURE_MAPS if name != "favor_trig"])
def test_encoder_step_is_streaming_encoding(rng, feature_map):
    x = rng.normal(size=(2, 5, DIM)).astype("float32")
    _assert_step_is_streaming_encoding(_block(LinearTransformerEncoder, feature_map), x)


def test_encoder_step_is_streaming_encoding_favor_trig_positive_kernel(rng):
    """favor_trig's two key norm factors cancel in num / den wherever den > 0.

    With inputs scaled by 0.25 (instead of D^(-1/4)), ``|q' - k'|`` stays
    below ~1.5, so each ``phi(q).phi(k) = amp(k) * mean_i cos(w_i.(q' - k'))``
    estimates ``amp(k) * exp(-|q' - k'|^2 / 2) > 0`` with 256 orthogonal
    frequencies: the kernel is positive by construction (asserted).
    """
    x = rng.normal(size=(2, 5, DIM)).astype("float32")
    fm = feature_maps.get("favor_trig", seed=TEST_SEED, scale=0.25)
    block = _block(LinearTransformerEncoder, fm)
    att = block.attention
    h = block._attention_norm(x)
    q, k, _ = att.project(h, h)
    kernel = np.einsum(
        "bthc,bshc->bhts", att.feature_map(q, is_query=True), att.feature_map(k, is_query=False)
    )  # [B, H, T, S]
    assert kernel.min() > 0, kernel.min()  # the construction above, not a skip
    _assert_step_is_streaming_encoding(block, x)


def test_decoder_prefill_steps_and_resume(rng):
    x = rng.normal(size=(2, 10, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    full = np.asarray(block(x))
    head, state = block(x[:, :4], return_state=True)
    mid, state = block(x[:, 4:7], return_state=True, initial_state=state)
    tail, _ = run_steps(block, x[:, 7:], state)
    # Both float32 (paths=2), over S = 10 keys at most.
    assert_close(np.concatenate([head, mid, tail], axis=1), full, n=_n_block(block, x.shape[1]), paths=2)


def test_decoder_never_sees_the_future(rng):
    x = rng.normal(size=(2, 12, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    a = np.asarray(block(x))
    x2 = x.copy()
    x2[:, 8:] = rng.normal(size=x2[:, 8:].shape)
    b = np.asarray(block(x2))
    np.testing.assert_array_equal(a[:, :8], b[:, :8])


def test_decoder_left_padding_matches_unpadded(rng):
    x = rng.normal(size=(1, 6, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder)
    plain = np.asarray(block(x))
    padded = np.concatenate([rng.normal(size=(1, 3, DIM)).astype("float32"), x], axis=1)
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1]], bool)
    out, state = block(padded, padding_mask=mask, return_state=True)
    # Both float32 (paths=2), over the S = 9 keys of the padded sequence.
    assert_close(np.asarray(out)[:, 3:], plain, n=_n_block(block, padded.shape[1]), paths=2, what="outputs")
    _, state_plain = block(x, return_state=True)
    assert_close(state[0], state_plain[0], n=_n_state(block, padded.shape[1]), paths=2, what="S")


def test_encoder_padding_is_ignored(rng):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    mask = np.ones((2, T), bool)
    mask[0, 4:] = False
    block = _block(LinearTransformerEncoder)
    out = np.asarray(block(x, padding_mask=mask))
    alone = np.asarray(block(x[:1, :4]))
    assert_close(out[0, :4], alone[0], n=_n_block(block, T), paths=2)  # both float32, S = T keys
    x2 = x.copy()
    x2[0, 4:] = 100.0
    # Padded keys and values are replaced by zeros (`where`) before any
    # reduction, so the junk changes no operand of the real outputs: bit-identical.
    np.testing.assert_array_equal(np.asarray(block(x2, padding_mask=mask))[0, :4], out[0, :4])


def test_keras_mask_is_used_as_padding_mask(rng):
    ids = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5]])
    emb = keras.layers.Embedding(8, DIM, mask_zero=True)
    block = _block(LinearTransformerEncoder)
    with_keras_mask = np.asarray(block(emb(ids)))
    explicit = np.asarray(block(emb(ids), padding_mask=ids != 0))
    # The same computation with the same mask: bit-identical.
    np.testing.assert_array_equal(with_keras_mask, explicit)


def test_dropout_only_in_training(rng):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = _block(LinearTransformerDecoder, dropout=0.5, seed=1)
    np.testing.assert_array_equal(block(x, training=False), block(x))
    # Criterion: dropout at rate 0.5 changes the outputs by O(1) (|y| ~ 1 here);
    # 1e-3 is far above float32 rounding and far below that.
    assert np.abs(np.asarray(block(x, training=True)) - np.asarray(block(x))).max() > 1e-3


@pytest.mark.parametrize("cls", [LinearTransformerDecoder, LinearTransformerEncoder])
def test_config_and_keras_saving(rng, tmp_path, cls):
    x = rng.normal(size=(2, T, DIM)).astype("float32")
    block = cls(num_heads=2, intermediate_dim=16, feature_map="taylor", key_dim=2, dropout=0.1, name="blk")
    inputs = keras.Input((None, DIM))
    model = keras.Model(inputs, block(inputs))
    expected = np.asarray(model(x))
    path = os.path.join(tmp_path, "block.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert_close(restored(x), expected, n=_n_block(block, T), paths=2)  # two float32 runs
    config = block.get_config()
    assert cls.from_config(config).get_config() == config


def test_xla_fit_runs_and_reduces_loss(rng):
    x = rng.normal(size=(16, T, DIM)).astype("float32")
    y = np.roll(x, 1, axis=1)
    inputs = keras.Input((T, DIM))
    model = keras.Model(inputs, _block(LinearTransformerDecoder)(inputs))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)
    history = model.fit(x, y, epochs=5, batch_size=8, verbose=0)
    # Learning criterion (seeded): 5 epochs of Adam(1e-2) lower the training loss.
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_bad_arguments_raise(rng):
    with pytest.raises(ValueError, match="intermediate_dim"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=4, dropout=1.5)
    with pytest.raises(ValueError, match="num_heads"):
        LinearTransformerDecoder(num_heads=3, intermediate_dim=4).build((None, None, DIM))
    with pytest.raises(ValueError, match="batch_size"):
        LinearTransformerDecoder(num_heads=2, intermediate_dim=4).get_initial_state(2)
    block = _block(LinearTransformerDecoder)
    state = block.get_initial_state(2)
    with pytest.raises(ValueError, match="inputs_t"):
        block.step(np.zeros((2, 1, DIM), "float32"), state)
    with pytest.raises(ValueError, match="inputs_t"):
        block.step(np.zeros((2, DIM + 1), "float32"), state)
    with pytest.raises(ValueError, match="state"):
        block.step(np.zeros((3, DIM), "float32"), state)
    with pytest.raises(ValueError, match="padding_mask"):
        block(np.zeros((2, T, DIM), "float32"), padding_mask=np.ones((2, T, 1)))


@pytest.mark.numeric
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_step_norm_matches_the_layer_values_and_gradients(kind, tmp_path):
    """The decode step's plain norm against the Keras layer it stands for (values and gradients)."""
    from keras_linattn.layers.transformer import _make_norm, _step_norm

    rng = np.random.default_rng(TEST_SEED)
    dim = 96
    norm = _make_norm(kind, 1e-5, "float32", "n")
    norm.build((None, dim))
    for w in norm.weights:  # away from the initial ones and zeros, so that a dropped weight shows
        w.assign(rng.normal(size=w.shape).astype("float32") + 1.0)
    x = tf.constant((rng.normal(size=(5, dim)) * 3 + 0.7).astype("float32"))

    def values_and_grads(fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
            loss = tf.reduce_sum(y * tf.sin(tf.range(dim, dtype=tf.float32)))
        return [y.numpy()] + [g.numpy() for g in tape.gradient(loss, [x] + list(norm.trainable_weights))]

    got, expected = values_and_grads(lambda v: _step_norm(norm, v)), values_and_grads(norm)
    # A norm over `dim` values, computed in two orders: sums of `dim` terms each way.
    for name, a, b in zip(["outputs", "d/dx"] + [w.path for w in norm.trainable_weights], got, expected, strict=True):
        assert_close(a, b, n=dim, paths=2, what=name)
    # The point of the plain form: onnxruntime fuses it into one node (Keras' form stays ~13 nodes).
    import onnx
    import onnxruntime as ort
    import tf2onnx

    fn = tf.function(lambda v: _step_norm(norm, v))
    proto, _ = tf2onnx.convert.from_function(fn, [tf.TensorSpec((None, dim), tf.float32)], opset=18)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = {"layer_norm": "LayerNormalization", "rms_norm": "SimplifiedLayerNormalization"}[kind]
    assert [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node] == [fused]
    (y,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert_close(y, expected[0], n=dim, paths=2, what="onnxruntime")


def test_step_norm_calls_any_other_norm_as_is():
    from keras_linattn.layers.transformer import _step_norm

    x = tf.constant(np.random.default_rng(0).normal(size=(3, 8)).astype("float32"))
    others = [
        keras.layers.LayerNormalization(center=False),
        keras.layers.LayerNormalization(dtype="mixed_float16"),
        keras.layers.LayerNormalization(axis=0),
    ]
    for norm in others:
        norm.build(x.shape)
        calls = []
        original = norm.call
        norm.call = lambda v, original=original, calls=calls: calls.append(1) or original(v)
        np.testing.assert_array_equal(np.asarray(_step_norm(norm, x)), np.asarray(norm(x)))
        assert len(calls) == 2, norm.get_config()
