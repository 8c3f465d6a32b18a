"""RedrawRandomFeatures: redraws projections during fit only."""

import keras
import numpy as np
import pytest

from keras_linattn.callbacks import RedrawRandomFeatures, random_feature_layers
from keras_linattn.feature_maps import FavorPlusFeatureMap, FavorTrigFeatureMap
from keras_linattn.layers import LinearAttention


def _model(jit_compile, learning_rate=0.0):
    inputs = keras.Input((8, 6))
    fm = FavorPlusFeatureMap(num_features=8, seed=1)
    h = LinearAttention(num_heads=2, key_dim=4, feature_map=fm, chunk_size=4)(inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(6)(h))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse", jit_compile=jit_compile)
    return model, fm


class _Recorder(keras.callbacks.Callback):
    """Records the projection used by each batch and the running loss after it."""

    def __init__(self, fm):
        super().__init__()
        self.fm = fm
        self.projections, self.losses = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.projections.append(self.fm.projection.numpy().copy())

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_redraws_every_n_steps_across_epochs(jit_compile):
    # 3 identical batches per epoch, 2 epochs, learning rate 0: the loss of a
    # batch changes only when the projection does.
    x = np.tile(np.random.default_rng(0).normal(size=(1, 8, 6)).astype("float32"), (12, 1, 1))
    y = np.zeros_like(x)
    model, fm = _model(jit_compile)
    before = model.predict(x[:1], verbose=0)
    redraw = RedrawRandomFeatures(every_n_steps=2)
    recorder = _Recorder(fm)  # after `redraw` in the list: sees the new matrix
    model.fit(x, y, batch_size=2 * 2, epochs=2, shuffle=False, verbose=0, callbacks=[redraw, recorder])
    p = recorder.projections
    assert len(p) == 6 and redraw.redraw_count == 2
    # global steps 0..5: new draws before steps 2 and 4
    for i, j in ((0, 1), (2, 3), (4, 5)):
        np.testing.assert_array_equal(p[i], p[j])
    for i, j in ((1, 2), (3, 4)):
        # Not a rounding bound: a redraw is a new Gaussian matrix, O(1) away from the old one.
        assert not np.allclose(p[i], p[j])
    # the compiled train step used the new matrix: the running mean loss
    # (reset every epoch) moves exactly at the redraw steps
    loss = recorder.losses
    assert loss[0] == loss[1] and loss[1] != loss[2]
    assert loss[4] != loss[3] and loss[4] != loss[5]
    after = model.predict(x[:1], verbose=0)
    assert not np.allclose(before, after)  # new features change the outputs by O(1), not by rounding


def test_predict_and_evaluate_never_redraw():
    x = np.random.default_rng(1).normal(size=(8, 8, 6)).astype("float32")
    model, fm = _model(jit_compile=False)
    cb = RedrawRandomFeatures(every_n_steps=1)
    initial = fm.projection.numpy().copy()
    a = model.predict(x, batch_size=2, verbose=0, callbacks=[cb])
    model.evaluate(x, np.zeros_like(x), batch_size=2, verbose=0, callbacks=[cb])
    b = model.predict(x, batch_size=2, verbose=0, callbacks=[cb])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fm.projection.numpy(), initial)
    assert cb.redraw_count == 0


def test_finds_every_random_feature_map_in_nested_models():
    inputs = keras.Input((8, 6))
    favor = FavorPlusFeatureMap(num_features=8, seed=0)
    trig = FavorTrigFeatureMap(num_features=4, seed=0)
    a = LinearAttention(num_heads=2, key_dim=4, feature_map=favor)
    b = LinearAttention(num_heads=2, key_dim=4, feature_map=trig)
    c = LinearAttention(num_heads=2, key_dim=4, feature_map="elu")
    inner_in = keras.Input((8, 6))
    inner = keras.Model(inner_in, b(inner_in, inner_in))
    h = a(inputs, inputs)
    h = inner(h)
    model = keras.Model(inputs, c(h, h))
    found = random_feature_layers(model)
    assert {id(layer) for layer in found} == {id(favor), id(trig)}
    assert len(found) == 2


@pytest.mark.parametrize("value", [0, -1, 1.5, None, True])
def test_bad_interval(value):
    with pytest.raises(ValueError, match="every_n_steps"):
        RedrawRandomFeatures(every_n_steps=value)
