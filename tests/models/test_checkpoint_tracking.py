"""`tf.train.Checkpoint` / `CheckpointManager` restore every variable of the package's models and layers.

Each test builds a source model and a fresh target of the same configuration
(`keras.backend.clear_session()` between them, so variable paths match),
moves every target variable away from the source's value, saves a
checkpoint of the source, restores it into the target, and compares EVERY
variable by path: weights, random projections, `draw_index`, dropout seed
states and, with an optimizer, every optimizer variable.
"""

import os

import keras
import numpy as np
import pytest

from keras_linattn.feature_maps.favor import FavorPlusFeatureMap
from keras_linattn.feature_maps.favor_trig import FavorTrigFeatureMap
from keras_linattn.layers import LinearAttention, LinearAttentionCell, LinearTransformerEncoder
from keras_linattn.layers.efficient_attention import EfficientAttention
from keras_linattn.models.causal_lm import LinearCausalLM

pytestmark = pytest.mark.tf_only("tf.train.Checkpoint is TensorFlow's")

VOCAB = 32

LM_CONFIGS = {
    "favor+": dict(feature_map=FavorPlusFeatureMap(num_features=8, seed=3)),
    "favor_trig": dict(feature_map=FavorTrigFeatureMap(num_features=8, seed=3)),
    "gated delta + conv": dict(update="delta", decay="scalar", normalize=False, conv_size=4),
    "window": dict(window_size=4),
    "hedgehog + positions + dropout": dict(feature_map="hedgehog", max_sequence_length=16, dropout=0.1),
}


def _lm(seed, **config):
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    return LinearCausalLM(
        vocabulary_size=VOCAB, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32, name="lm", **config
    )


def _train_one_step(model, ids):
    # Eager: tracing a train step costs more than the step of these small models.
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    model.fit(ids, ids, epochs=1, batch_size=2, verbose=0)


def _state(model, optimizer):
    """Every variable, by path: the model's (seed states included) and the optimizer's."""
    state = {v.path: np.array(v.numpy()) for v in model.variables}
    if optimizer:
        state.update({"optimizer/" + v.path: np.array(v.numpy()) for v in model.optimizer.variables})
    return state


def _perturb(model, optimizer, saved):
    """Sets every variable to the saved value + 1: a variable the restore misses cannot match by chance."""
    variables = [(v.path, v) for v in model.variables]
    if optimizer:
        variables += [("optimizer/" + v.path, v) for v in model.optimizer.variables]
    for path, v in variables:
        v.assign(saved[path] + np.ones_like(saved[path]))


def _restored(source, target):
    """Paths whose value came back, and the total (paths must match)."""
    assert sorted(source) == sorted(target)
    same = [p for p in source if np.array_equal(source[p], target[p])]
    return same, len(source)


def roundtrip(make, ids, directory, optimizer=False, manager=False):
    """Saves `make(1)` and restores it into `make(2)`: ``(restored paths, total, missed paths)``."""
    import tensorflow as tf

    source = make(1)
    if optimizer:
        _train_one_step(source, ids)
        # A second step so that redraw-free state (iterations, moments) is not at its initial value.
        source.fit(ids, ids, epochs=1, batch_size=2, verbose=0)
    else:
        source(ids)
    for layer in source._flatten_layers():
        if hasattr(layer, "redraw") and layer.built:
            layer.redraw()  # draw_index 1 and a new projection: neither is what a fresh build has
    saved = _state(source, optimizer)
    objects = dict(model=source, optimizer=source.optimizer) if optimizer else dict(model=source)
    checkpoint = tf.train.Checkpoint(**objects)
    if manager:
        path = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2).save()
    else:
        path = checkpoint.save(os.path.join(directory, "ckpt"))

    target = make(2)
    if optimizer:
        _train_one_step(target, ids)
    else:
        target(ids)
    _perturb(target, optimizer, saved)
    objects = dict(model=target, optimizer=target.optimizer) if optimizer else dict(model=target)
    checkpoint = tf.train.Checkpoint(**objects)
    if manager:
        path = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2).latest_checkpoint
    checkpoint.restore(path).assert_existing_objects_matched()
    restored = _state(target, optimizer)
    same, total = _restored(saved, restored)
    return same, total, sorted(set(saved) - set(same))


# Every configuration and every mode once in `make test`: each configuration's
# variables are restored in one mode, and each mode (model only, checkpoint +
# optimizer, CheckpointManager + optimizer) runs for at least one configuration.
# The rest of the configuration x mode grid runs in `make test-slow`.
FAST_LM_CASES = {
    ("favor+", "model+optimizer"),
    ("favor_trig", "model"),
    ("window", "model"),
    ("gated delta + conv", "manager+optimizer"),
    ("hedgehog + positions + dropout", "manager+optimizer"),
}
LM_CASES = [
    pytest.param(name, mode, marks=() if (name, mode) in FAST_LM_CASES else pytest.mark.slow)
    for name, mode in (
        [(name, "model") for name in sorted(LM_CONFIGS)]
        + [(name, "manager+optimizer") for name in sorted(LM_CONFIGS)]
        + [("favor+", "model+optimizer")]
    )
]


@pytest.mark.parametrize("name,mode", LM_CASES)
def test_lm_checkpoint_restores_every_variable(name, mode, tmp_path):
    ids = np.random.randint(0, VOCAB, (2, 8)).astype("int32")
    same, total, missed = roundtrip(
        lambda seed: _lm(seed, **LM_CONFIGS[name]),
        ids,
        str(tmp_path),
        optimizer=mode != "model",
        manager=mode.startswith("manager"),
    )
    assert not missed, f"{len(same)}/{total} restored; missed: {missed}"


def _functional(layer_factory, seed):
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(inputs)
    x = layer_factory(x)
    return keras.Model(inputs, keras.layers.Dense(VOCAB)(x), name="lm")


LAYER_CONFIGS = {
    "LinearAttention hedgehog": lambda x: LinearAttention(num_heads=2, key_dim=4, feature_map="hedgehog")(x, x),
    "LinearAttention favor+ dropout": lambda x: LinearAttention(
        num_heads=2, key_dim=4, feature_map=FavorPlusFeatureMap(num_features=4, seed=5), dropout=0.2
    )(x, x),
    "LinearTransformerEncoder ffn": lambda x: LinearTransformerEncoder(
        num_heads=2, intermediate_dim=16, feature_map="ffn", dropout=0.1
    )(x),
    "EfficientAttention": lambda x: EfficientAttention(num_heads=2, key_dim=4)(x, x),
    "LinearAttentionCell": lambda x: keras.layers.RNN(
        LinearAttentionCell(LinearAttention(num_heads=2, key_dim=4, feature_map="glu")), return_sequences=True
    )(x),
}


@pytest.mark.parametrize("name", sorted(LAYER_CONFIGS))
def test_layer_checkpoint_restores_every_variable(name, tmp_path):
    ids = np.random.randint(0, VOCAB, (2, 8)).astype("int32")
    same, total, missed = roundtrip(
        lambda seed: _functional(LAYER_CONFIGS[name], seed), ids, str(tmp_path), optimizer=True
    )
    assert not missed, f"{len(same)}/{total} restored; missed: {missed}"


def test_checkpoint_keys_name_the_blocks(tmp_path):
    import tensorflow as tf

    lm = _lm(0, **LM_CONFIGS["favor+"])
    path = tf.train.Checkpoint(model=lm).save(os.path.join(str(tmp_path), "ckpt"))
    keys = [name for name, _ in tf.train.list_variables(path)]
    assert any(k.startswith("model/backbone/decoder_blocks_0/") and "projection" in k for k in keys), keys
    assert any(k.startswith("model/backbone/decoder_blocks_1/") and "draw_index" in k for k in keys), keys
