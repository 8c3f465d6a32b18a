"""Small softmax teachers for the linearization tests, and a probe of their attention inputs and outputs."""

import keras
import numpy as np

T, FEATURES, DIM, HEADS, KEY_DIM = 12, 6, 16, 2, 8


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def mha(name, seed):
    """A MultiHeadAttention with non-zero biases (so that a missed bias copy shows)."""
    return keras.layers.MultiHeadAttention(
        HEADS,
        KEY_DIM,
        kernel_initializer=_init(seed),
        bias_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=seed + 100),
        name=name,
    )


def causal_teacher(length=T):
    """Dense -> residual causal attention -> LayerNorm -> causal attention -> Dense.

    Returns ``(teacher, probe)``: `probe` shares the teacher's layers and
    outputs ``[input of att1, output of att1, input of att2, output of att2, output]``.
    """
    inputs = keras.Input((length, FEATURES), name="features")
    h1 = keras.layers.Dense(DIM, kernel_initializer=_init(1), bias_initializer="ones", name="embed")(inputs)
    a1 = mha("att1", 2)(h1, h1, use_causal_mask=True)
    h2 = keras.layers.LayerNormalization(name="norm")(h1 + a1)
    a2 = mha("att2", 3)(h2, h2, use_causal_mask=True)
    out = keras.layers.Dense(4, kernel_initializer=_init(4), name="head")(h2 + a2)
    return keras.Model(inputs, out, name="teacher"), keras.Model(inputs, [h1, a1, h2, a2, out])


def data(n=16, length=T, seed=0):
    return np.random.default_rng(seed).normal(size=(n, length, FEATURES)).astype("float32")


def weights(model):
    return {v.path: np.asarray(v).copy() for v in model.weights}
