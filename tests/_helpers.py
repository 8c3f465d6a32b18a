"""Helpers shared by several test modules: stepping, oracles and checks on attention layers."""

import os

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps
from keras_linattn import ops as lops
from keras_linattn.feature_maps.random_features import RandomFeatureMap
from keras_linattn.layers import LinearAttention
from tests import _backend, conftest
from tests.tolerance import assert_close, normalizer_conditioning


# ------------------------------------------------------------ recurrent steps
def run_steps(model, inputs, state=None, self_attention=False):
    """Feed ``inputs[:, t]`` to ``model.step`` for every ``t`` in order.

    ``state`` defaults to ``model.get_initial_state(batch)``. With
    ``self_attention=True`` the step takes ``(query_t, value_t, state)`` (as
    `LinearAttention.step` does) and gets ``inputs[:, t]`` as both; otherwise it
    takes ``(inputs_t, state)``. Returns the outputs stacked on axis 1 (as
    NumPy) and the final state.
    """
    state = model.get_initial_state(inputs.shape[0]) if state is None else state
    outs = []
    for t in range(inputs.shape[1]):
        x_t = inputs[:, t]
        if self_attention:
            y, state = model.step(x_t, x_t, state)
        else:
            y, state = model.step(x_t, state)
        outs.append(np.asarray(y))
    return np.stack(outs, axis=1), state


# ------------------------------------------------------------ step vs parallel
def step_test_feature_map(name):
    """The registered map ``name``; random-projection maps get an explicit seed.

    relu's floor is raised from 1e-6 to 0.1. relu passes a pre-activation's
    absolute rounding error (~eps |q|) on unscaled, so a row whose only
    positive pre-activation is tiny is ill-conditioned: with the default
    floor, one at ~1e-5 put the language model at 3x the bound (default seed,
    oneDNN off). A floor f bounds the row's sensitivity
    ``|q| |z| / (phi(q).z)`` by ~1/f, ~10 here: worst 0.11 of the bound over
    41 seeds with oneDNN on and off (f = 1e-2: 0.88 at 1 of 40 seeds).
    """
    if name == "relu":
        return feature_maps.get(name, epsilon=0.1)
    fm = feature_maps.get(name)
    return feature_maps.get(name, seed=conftest.TEST_SEED) if isinstance(fm, RandomFeatureMap) else fm


# ------------------------------------------------------------ LinearAttention
def oracle_forward(layer, query, value, key=None, causal=False, key_mask=None):
    """The layer's own projections and feature map, attention by the quadratic oracle."""
    q, k, v = layer.project(query, value, key)
    qf = layer.feature_map(q, is_query=True, causal=causal)
    kf = layer.feature_map(k, is_query=False, causal=causal)
    att = lops.kernel_attention_reference(qf, kf, v, causal=causal, key_mask=key_mask)
    return layer.output_dense(att)


def layer_conditioning(layer, query, value, key=None, causal=False, key_mask=None, per_channel=False):
    """`tests.tolerance.normalizer_conditioning` of the layer's own features on these inputs."""
    q, k, _ = layer.project(query, value, key)
    qf = layer.feature_map(q, is_query=True, causal=causal)  # [B, T, H, C]
    kf = layer.feature_map(k, is_query=False, causal=causal)  # [B, S, H, C]
    return normalizer_conditioning(qf, kf, causal=causal, key_mask=key_mask, per_channel=per_channel)


def _outputs_and_gradients(fn, x, weights):
    """``fn(x)`` and the gradients of a fixed cosine-weighted sum of it with respect
    to ``x`` and ``weights``, flattened into one vector (on either backend: `tests._backend`)."""

    def loss(x_):
        out = fn(x_)
        return keras.ops.sum(out * keras.ops.cos(keras.ops.arange(out.shape[-1], dtype="float32"))), out

    out, grads = _backend.gradients(loss, [x], weights)
    return out, _backend.flat(grads)


def assert_self_attention_matches_oracle(layer, x, causal, *, n, conditioning=1.0):
    """The built layer's self-attention on ``x`` matches `oracle_forward`
    (float64 attention): outputs, and gradients with respect to ``x`` and every
    trainable variable, each within the float32 error model for reduction
    length ``n`` (`tests.tolerance.assert_close`)."""
    weights = layer.trainable_variables
    out, grads = _outputs_and_gradients(lambda x_: layer(x_, x_, use_causal_mask=causal), x, weights)
    ref, ref_grads = _outputs_and_gradients(lambda x_: oracle_forward(layer, x_, x_, causal=causal), x, weights)
    assert_close(out, ref, n=n, conditioning=conditioning, what="outputs")
    assert_close(grads, ref_grads, n=n, conditioning=conditioning, what="gradients")


def assert_causal_outputs_never_see_the_future(layer, x, rng, positions):
    """For each ``t`` in ``positions``: replacing the inputs after ``t`` by large
    noise leaves the causal outputs up to ``t`` bit-identical and changes the later ones."""
    base = np.asarray(layer(x, x, use_causal_mask=True))
    for t in positions:
        changed = x.copy()
        changed[:, t + 1 :] = rng.normal(size=changed[:, t + 1 :].shape) * 5.0
        out = np.asarray(layer(changed, changed, use_causal_mask=True))
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
        assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :])


def causal_attention_model(feature_map, t=16, dim=8):
    """Input [t, dim] -> causal LinearAttention (2 heads of 4, chunks of 8) -> Dense(dim).

    ``model.layers[1]`` is the attention layer.
    """
    inputs = keras.Input((t, dim))
    att = LinearAttention(num_heads=2, key_dim=4, feature_map=feature_map, chunk_size=8)
    h = att(inputs, inputs, use_causal_mask=True)
    outputs = keras.layers.Dense(dim)(h)
    return keras.Model(inputs, outputs)


def assert_fits_with_xla(model, rng):
    """Fits ``model`` (Adam(0.01), MSE, XLA) for 4 epochs on 32 random sequences
    [16, 8] shifted by one step; the loss stays finite and falls."""
    x = rng.normal(size=(32, 16, 8)).astype("float32")
    y = np.roll(x, 1, axis=1)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    losses = model.fit(x, y, batch_size=8, epochs=4, verbose=0).history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]


def save_and_load(model, tmp_path):
    """Saves ``model`` as a .keras file under ``tmp_path`` and loads it back."""
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    return keras.saving.load_model(path)


# ------------------------------------------------------------ feature maps
def assert_rejects_bad_input_rank_and_shape(fm, other_shape):
    """An unbuilt feature map rejects a rank-3 input at build; once built on
    [1, 3, 2, 4] it rejects a rank-3 input and the rank-4 ``other_shape``."""
    with pytest.raises(ValueError, match="input_shape"):
        fm(np.zeros((2, 3, 4), "float32"))
    fm(np.zeros((1, 3, 2, 4), "float32"))
    with pytest.raises(ValueError, match="inputs.shape"):
        fm(np.zeros((3, 2, 4), "float32"))
    with pytest.raises(ValueError, match="inputs.shape"):
        fm(np.zeros(other_shape, "float32"))


# ------------------------------------------------------------ export
def export_once(tmp_path_factory, build_model, export_fn, filename):
    """Builds a model under the float32 policy and exports it into a fresh temporary folder.

    For module-scoped fixtures, which are set up before the per-test Keras reset.
    ``export_fn(model, path)`` writes to ``<new folder named after filename's stem>/filename``.
    Returns ``(model, what export_fn returned)``.
    """
    keras.config.set_dtype_policy("float32")
    model = build_model()
    folder = tmp_path_factory.mktemp(os.path.splitext(filename)[0])
    return model, export_fn(model, folder / filename)
