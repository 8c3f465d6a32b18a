"""Attention distillation: the KL it reports, that it lowers it, and what it leaves alone."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from keras_linattn import distill, feature_maps
from keras_linattn.feature_maps import FeatureMap
from keras_linattn.layers import LinearAttention
from tests.tolerance import assert_close

T, DIM, HEADS, KEY_DIM = 8, 12, 2, 4


class ExpTestMap(FeatureMap):
    """A tiny trainable map, ``phi(x) = exp(x W)``, ``W [H, D, C]``."""

    def __init__(self, size=6, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.size = size
        self.seed = seed

    def feature_dim(self, input_dim):
        return self.size

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel = self.add_weight(
            name="kernel",
            shape=(input_shape[-2], input_shape[-1], self.size),
            initializer=keras.initializers.RandomNormal(stddev=0.3, seed=self.seed),
        )

    def call(self, inputs, is_query=True, causal=False):
        logits = ops.einsum("bthd,hdc->bthc", ops.cast(inputs, "float32"), self.kernel)  # [B, T, H, C]
        return ops.exp(ops.clip(logits, -30.0, 30.0))


def _attention(seed=1, feature_map=None, name="attention"):
    return LinearAttention(
        num_heads=HEADS,
        key_dim=KEY_DIM,
        feature_map=feature_maps.get(feature_map) if feature_map is not None else ExpTestMap(seed=seed),
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.6, seed=seed),
        conv_size=None,  # the NumPy KL reads the bare projections: no convolution between
        name=name,
    )


def _functional_model(feature_map=None):
    inp = keras.Input((T, DIM))
    x = keras.layers.Dense(DIM, kernel_initializer=keras.initializers.GlorotUniform(seed=0), name="embed")(inp)
    x = x + _attention(1, feature_map, "attention_1")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = x + _attention(2, feature_map, "attention_2")(x, x)
    out = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed=1), name="head")(
        keras.layers.GlobalAveragePooling1D()(x)
    )
    return keras.Model(inp, out)


def _data(n=32, seed=0):
    return np.random.default_rng(seed).normal(size=(n, T, DIM)).astype("float32")


def _numpy_kl(layer, query, value, causal=False, key_mask=None, parts=False):
    """KL(softmax || linear) averaged over rows, from the layer's projections, in numpy.

    With ``parts=True``, returns ``(kl, cross_entropy, entropy)`` row means
    (``kl = cross_entropy - entropy``).
    """
    q, k, _ = (np.asarray(t, np.float64) for t in layer.project(query, value))
    qf = np.asarray(layer.feature_map(q.astype("float32"), is_query=True), np.float64)
    kf = np.asarray(layer.feature_map(k.astype("float32"), is_query=False), np.float64)
    t, s = q.shape[1], k.shape[1]
    allowed = np.ones((q.shape[0], t, s), bool)
    if causal:
        allowed &= np.tril(np.ones((t, s), bool))
    if key_mask is not None:
        allowed &= np.asarray(key_mask, bool)[:, None, :]
    total, cross, entropy, rows = 0.0, 0.0, 0.0, 0
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            for i in range(t):
                keep = allowed[b, i]
                if not keep.any():
                    continue
                logits = q[b, i, h] @ k[b, keep, h].T / np.sqrt(q.shape[-1])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                lin = kf[b, keep, h] @ qf[b, i, h]
                lin /= lin.sum()
                total += float(np.sum(p * (np.log(p) - np.log(lin))))
                cross -= float(np.sum(p * np.log(lin)))
                entropy -= float(np.sum(p * np.log(p)))
                rows += 1
    if parts:
        return total / rows, cross / rows, entropy / rows
    return total / rows


def _kl_reduction_length(batch_size, length=T):
    """Reduction length of a float32 mean KL over batches of ``batch_size``:
    D (softmax logits q.k) + S (softmax normalization) + C (phi(q).phi(k)) +
    S (linear normalization) + S (the KL's sum over keys) + B*H*T (the sum of
    a batch's rows; batches are added in float64). The feature map itself is
    the same float32 computation on both sides."""
    return KEY_DIM + length + ExpTestMap().size + length + length + batch_size * HEADS * length


def _kl_conditioning(cross, entropy, kl):
    """The KL is computed as cross-entropy minus entropy, two positive sums
    whose terms carry relative rounding errors: its absolute error scales with
    ``cross + entropy``, so relative to the KL it is conditioned by ``(cross + entropy) / kl``."""
    return (cross + entropy) / kl


def test_attention_kl_matches_numpy_definition():
    model = _functional_model()
    x = _data(6)
    model(x)
    kl = distill.attention_kl(model, x, batch_size=4)
    assert list(kl) == ["attention_1", "attention_2"]
    side = keras.Model(model.input, model.get_layer("embed").output)
    h = np.asarray(side(x))
    expected, cross, entropy = _numpy_kl(model.get_layer("attention_1"), h, h, parts=True)
    # Against the float64 NumPy definition (paths=1).
    assert_close(
        kl["attention_1"], expected, n=_kl_reduction_length(4), conditioning=_kl_conditioning(cross, entropy, expected)
    )
    assert expected > 0.05


def test_distillation_lowers_kl_and_changes_only_feature_maps():
    model = _functional_model()
    x = _data(32)
    model(x)
    model.get_layer("head").trainable = False  # a flag that must survive
    model.get_layer("embed").kernel.trainable = False  # and a variable flag
    flags = {layer.name: layer.trainable for layer in model._flatten_layers(include_self=True, recursive=True)}
    var_flags = {v.path: v.trainable for v in model.variables}
    before = {v.path: np.asarray(v).copy() for v in model.variables}
    history = distill.distill_attention(model, x, epochs=6, batch_size=8, learning_rate=0.05, verbose=0)
    assert history.layers == ["attention_1", "attention_2"]
    for name in history.layers:
        # Learning criterion (seeded): 6 epochs at learning rate 0.05 remove
        # over 30% of each layer's KL.
        assert history.kl_after[name] < 0.7 * history.kl_before[name], (name, history)
    assert len(history.history["kl"]) == 6
    assert history.history["kl"][-1] < history.history["kl"][0]
    fm_paths = {v.path for name in history.layers for v in model.get_layer(name).feature_map.weights}
    for v in model.variables:
        changed = not np.array_equal(np.asarray(v), before[v.path])
        assert changed == (v.path in fm_paths), v.path
    assert {layer.name: layer.trainable for layer in model._flatten_layers(include_self=True, recursive=True)} == flags
    assert {v.path: v.trainable for v in model.variables} == var_flags
    assert all("call" not in layer.__dict__ for layer in model._flatten_layers())
    fresh = distill.attention_kl(model, x, batch_size=8)
    # Two float32 evaluations of the same KL (paths=2), conditioned by the
    # layer's own cross-entropy and entropy (float64, on the inputs it gets).
    inputs = {"attention_1": "embed", "attention_2": "norm"}
    for name in history.layers:
        h = np.asarray(keras.Model(model.input, model.get_layer(inputs[name]).output)(x))
        kl, cross, entropy = _numpy_kl(model.get_layer(name), h, h, parts=True)
        assert_close(
            fresh[name],
            history.kl_after[name],
            n=_kl_reduction_length(8),
            conditioning=_kl_conditioning(cross, entropy, kl),
            paths=2,
            what=name,
        )


class AttnBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = _attention(3, None, "inner_attention")
        self.norm = keras.layers.LayerNormalization()
        self.supports_masking = True

    def call(self, x, mask=None):
        return self.norm(x + self.attention(x, x, use_causal_mask=True))


class SubclassedLM(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(
            11, DIM, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=4)
        )
        self.block = AttnBlock()
        self.head = keras.layers.Dense(11)

    def call(self, tokens):
        return self.head(self.block(self.embed(tokens)))


def _tokens(n=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 11, size=(n, T))
    tokens[::2, 5:] = 0  # right padding: masked keys
    return tokens


def test_subclassed_model_reads_causal_flag_and_keras_mask():
    model = SubclassedLM()
    tokens = _tokens(4)
    model(tokens)
    kl = distill.attention_kl(model, tokens, batch_size=4)
    assert list(kl) == ["inner_attention"]
    h = np.asarray(model.embed(tokens))
    layer = model.block.attention
    expected, cross, entropy = _numpy_kl(layer, h, h, causal=True, key_mask=tokens != 0, parts=True)
    # Against the float64 NumPy definition (paths=1).
    assert_close(
        kl["inner_attention"],
        expected,
        n=_kl_reduction_length(4),
        conditioning=_kl_conditioning(cross, entropy, expected),
    )
    non_causal = distill.attention_kl(model, tokens, batch_size=4, causal=False)
    # Criterion: the causal flag reaches the KL. The non-causal rows see other
    # keys, so the KLs differ at O(kl); 1e-3 is far above rounding.
    assert abs(non_causal["inner_attention"] - kl["inner_attention"]) > 1e-3


def test_distillation_on_subclassed_causal_model_with_dataset_and_xla():
    model = SubclassedLM()
    tokens = _tokens(32, seed=1)
    labels = np.zeros((32,), "int32")
    data = tf.data.Dataset.from_tensor_slices((tokens, labels)).batch(8)
    history = distill.distill_attention(
        model, data, epochs=2, steps_per_epoch=6, learning_rate=0.05, jit_compile=True, verbose=0
    )
    name = history.layers[0]
    # Learning criterion (seeded): 12 XLA steps remove over 40% of the KL.
    assert history.kl_after[name] < 0.6 * history.kl_before[name], history


def test_flags_and_hooks_restored_when_training_fails():
    model = _functional_model()
    x = _data(8)
    model(x)
    flags = {layer.name: layer.trainable for layer in model._flatten_layers(include_self=True, recursive=True)}
    bad = tf.data.Dataset.from_tensor_slices(np.zeros((8, T, DIM + 1), "float32")).batch(4)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        distill.distill_attention(model, bad, validation_data=x, verbose=0)
    assert {layer.name: layer.trainable for layer in model._flatten_layers(include_self=True, recursive=True)} == flags
    assert all("call" not in layer.__dict__ for layer in model._flatten_layers())


def test_bad_arguments():
    model = _functional_model(feature_map="elu")
    x = _data(4)
    model(x)
    with pytest.raises(ValueError, match="trainable feature map"):
        distill.distill_attention(model, x, verbose=0)
    model = _functional_model()
    model(x)
    with pytest.raises(ValueError, match="epochs"):
        distill.distill_attention(model, x, epochs=0)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        distill.distill_attention(model, tf.data.Dataset.from_tensors(x).repeat())
    with pytest.raises(ValueError, match="layers"):
        distill.attention_kl(model, x, layers=["no_such_layer"])
    with pytest.raises(ValueError, match="steps"):
        distill.attention_kl(model, tf.data.Dataset.from_tensors(x).repeat())
    with pytest.raises(ValueError, match="batch_size"):
        distill.attention_kl(model, x, batch_size=0)


@pytest.mark.skipif("hedgehog" not in feature_maps.available(), reason="hedgehog feature map not available")
def test_hedgehog_distillation_lowers_kl():
    model = _functional_model(feature_map="hedgehog")
    x = _data(32, seed=3)
    model(x)
    history = distill.distill_attention(
        model, x, epochs=6, batch_size=8, learning_rate=0.1, layers=["attention_1"], verbose=0
    )
    assert history.layers == ["attention_1"]
    # Learning criterion (seeded): 6 epochs remove over 20% of the KL.
    assert history.kl_after["attention_1"] < 0.8 * history.kl_before["attention_1"], history


def test_multi_head_attention_weights_transfer_to_linear_attention(rng):
    """The copy used by examples/distillation: same kernel layouts, same attention."""
    from keras_linattn.ops import softmax_attention

    x = rng.normal(size=(2, 6, DIM)).astype("float32")
    mha = keras.layers.MultiHeadAttention(HEADS, KEY_DIM, bias_initializer="glorot_uniform")
    expected = mha(x, x)
    linear = LinearAttention(HEADS, KEY_DIM, feature_map="elu")
    linear(x, x)
    for part in ("query_dense", "key_dense", "value_dense", "output_dense"):
        src, dst = getattr(mha, part), getattr(linear, part)
        assert [tuple(w.shape) for w in src.weights] == [tuple(w.shape) for w in dst.weights]
        for w_src, w_dst in zip(src.weights, dst.weights, strict=True):
            w_dst.assign(w_src)
    q, k, v = linear.project(x, x)  # [B, T, H, D], [B, S, H, D], [B, S, H, M]
    got = linear.output_dense(softmax_attention(q, k, v))  # [B, T, dim]
    # The attention of `got` is float64 but both sides project in float32
    # with their own layers (paths=2): DIM (input projections) + D (logits) +
    # S (softmax normalization) + S (weighted sum of values) + H*M (output projection).
    n = DIM + KEY_DIM + 2 * x.shape[1] + HEADS * KEY_DIM
    assert_close(got, expected, n=n, paths=2)


@pytest.mark.slow
def test_distillation_example_runs(tmp_path):
    from examples.distillation import run

    results = run.main(
        [
            "--train-size",
            "512",
            "--test-size",
            "128",
            "--epochs",
            "2",
            "--layers",
            "1",
            "--distill-epochs",
            "1",
            "--distill-steps",
            "20",
            "--finetune-epochs",
            "0",
            "--no-jit",
        ]
    )
    assert results["kl_after"]["attention_0"] < results["kl_before"]["attention_0"]
