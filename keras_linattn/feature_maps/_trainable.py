"""Shared machinery of the trainable, head-wise feature maps (hedgehog, ffn, glu, oglu, aoglu).

Shape legend: B batch, T length, H heads, D input (key) dim, C feature dim,
r rank of a low-rank factor.
"""

from keras import ops

from keras_linattn._docstrings import fill
from keras_linattn._validation import (
    check_bool,
    check_int_in_range,
    check_one_of,
    check_optional_positive_int,
    check_seed,
)
from keras_linattn.feature_maps.base import FeatureMap
from keras_linattn.regularizers import OrthogonalRegularizer

# The arguments and call contract every trainable map shares, documented once
# (see `keras_linattn._docstrings.fill` and `document` below).
SHARED_ARGS_DOC = """\
        depth: number of layers (GLU units for the GLU maps) ``k``, 1 to 3.
            Default 1.
        feature_dim: output feature dim ``C``, also the width of every
            hidden layer or unit. Default None: ``C = D``.
        hidden_activation: activation of the layers or units before the
            last: ``"sigmoid"`` (default, as in the paper), ``"gelu"``,
            ``"relu"``, ``"tanh"``.
        share_qk: True (default): queries and keys share one kernel. False:
            separate kernels for queries and keys.
        seed: optional integer base seed of the initializers (head ``h`` of
            weight ``i`` uses ``seed + i * H + h``).
        **kwargs: `FeatureMap` / `keras.layers.Layer` arguments."""

CALL_DOC = """\
    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: selects the query or key kernel when ``share_qk=False``.
        causal: unused (the map is token-wise).

    Returns:
        ``[B, T, H, C]`` positive float32 features."""


document = fill(shared_args=SHARED_ARGS_DOC, call=CALL_DOC)

HIDDEN_ACTIVATIONS = {
    "gelu": ops.gelu,
    "relu": ops.relu,
    "sigmoid": ops.sigmoid,
    "tanh": ops.tanh,
}


def headwise_matmul(x, w):
    """Applies one matrix per head: ``[B, T, H, D] x [H, D, C] -> [B, T, H, C]``.

    At one token (a decode step: ``T == 1``, H, D and C known) it is written
    as the batched product the einsum lowers to, with constant reshapes (-1
    for the batch): 5 ONNX nodes where the einsum's run-time shape reads make
    about 12. The same products over D either way.
    """
    t, h, d = x.shape[1], x.shape[2], x.shape[3]
    c = w.shape[-1]
    if t == 1 and h is not None and d is not None and c is not None:
        rows = ops.transpose(ops.reshape(x, (-1, h, d)), (1, 0, 2))  # [H, B, D]
        out = ops.matmul(rows, w)  # [H, B, C]
        return ops.reshape(ops.transpose(out, (1, 0, 2)), (-1, 1, h, c))  # [B, 1, H, C]
    return ops.einsum("bthd,hdc->bthc", x, w)  # [B, T, H, C]


class HeadwiseInitializer:
    """Initializes a ``[H, rows, cols]`` weight head by head.

    Each head gets its own fresh instance of `initializer`, called with the
    2-D shape ``(rows, cols)``: fan-in/fan-out are those of one head (a plain
    Keras initializer on a 3-D shape would count ``H`` as a receptive field),
    `Orthogonal` gives each head orthonormal rows (or columns when
    ``rows > cols``), and heads get different matrices. Seeds: with an
    integer base seed (the map's `seed`, else the initializer's own integer
    seed) head ``h`` of weight ``i`` uses ``base + i * H + h``; without one,
    each fresh instance draws its own seed.
    """

    def __init__(self, initializer, base_seed, weight_index):
        self.initializer = initializer
        self.base_seed = base_seed
        self.weight_index = weight_index

    def _head_initializer(self, head, num_heads):
        config = self.initializer.get_config()
        if "seed" not in config:
            return self.initializer.__class__.from_config(config)
        if isinstance(config["seed"], dict):
            # A SeedGenerator seed advances on every call: reuse the instance.
            return self.initializer
        base = self.base_seed if self.base_seed is not None else config["seed"]
        if base is not None:
            config["seed"] = base + self.weight_index * num_heads + head
        return self.initializer.__class__.from_config(config)

    def __call__(self, shape, dtype=None):
        num_heads, rows, cols = shape
        heads = [
            self._head_initializer(h, num_heads)((rows, cols), dtype=dtype) for h in range(num_heads)
        ]  # H x [rows, cols]
        return ops.stack(heads, axis=0)  # [H, rows, cols]


class TrainableFeatureMap(FeatureMap):
    """Base of the trainable head-wise maps: one set of weights per branch.

    Every trainable map (`hedgehog`, `ffn`, `glu`, `oglu`, `aoglu`) stands
    on it. With ``share_qk=True`` (the default of every trainable map)
    queries and keys go through the same weights (branch ``"qk"``);
    otherwise queries use branch ``"query"`` and keys branch ``"key"``.
    Weights are float32 ``[H, rows, cols]`` tensors initialized head by head
    (`add_headwise_weight`), whatever the compute dtype.

    The arguments `feature_dim`, `share_qk` and `seed` are keyword-only and
    checked here. ``feature_dim(D)`` returns the feature dim ``C``: the
    `feature_dim` argument when given, else `default_feature_dim(D)`
    (``D`` unless a subclass says otherwise). Subclasses implement
    `build_branch(prefix, num_heads, input_dim)` returning the branch's
    weights, and `apply_branch(inputs, weights)`.
    """

    def __init__(self, *, feature_dim=None, share_qk=True, seed=None, **kwargs):
        super().__init__(**kwargs)
        # `feature_dim(input_dim)` is the FeatureMap method giving C, so the
        # argument is kept under a private name and read through the method.
        self._feature_dim = check_optional_positive_int("feature_dim", feature_dim)
        self.share_qk = check_bool("share_qk", share_qk)
        self.seed = check_seed("seed", seed)

    # Maps whose `apply_branch` takes `is_query` and lifts underflowing queries
    # (`keras_linattn.feature_maps._stable`).
    lifts_queries = False

    def default_feature_dim(self, input_dim):
        """``C`` when no `feature_dim` argument is given: ``D``."""
        return input_dim

    def feature_dim(self, input_dim):
        if self._feature_dim is not None:
            return self._feature_dim
        return self.default_feature_dim(input_dim)

    def add_headwise_weight(self, name, shape, initializer, regularizer=None):
        """A float32 ``[H, rows, cols]`` weight initialized head by head."""
        index = self._num_headwise_weights
        self._num_headwise_weights += 1
        return self.add_weight(
            name=name,
            shape=shape,
            initializer=HeadwiseInitializer(initializer, self.seed, index),
            regularizer=regularizer,
            trainable=True,
            dtype="float32",
        )

    @staticmethod
    def orthogonal_regularizer(factor):
        return OrthogonalRegularizer(factor) if factor > 0 else None

    def build(self, input_shape):
        heads_dim = self.build_heads(input_shape)
        if heads_dim is None:
            return
        num_heads, input_dim = heads_dim
        self._num_headwise_weights = 0
        names = ("qk",) if self.share_qk else ("query", "key")
        self._branches = {name: self.build_branch(name, num_heads, input_dim) for name in names}

    def call(self, inputs, is_query=True, causal=False):
        # Token-wise map: causal needs no special treatment.
        self.check_heads(inputs)
        if self.share_qk:
            branch = "qk"
        else:
            branch = "query" if is_query else "key"
        if self.lifts_queries:
            return self.apply_branch(inputs, self._branches[branch], is_query=is_query)
        return self.apply_branch(inputs, self._branches[branch])

    def get_config(self):
        return {
            **super().get_config(),
            "feature_dim": self._feature_dim,
            "share_qk": self.share_qk,
            "seed": self.seed,
        }


class StackedFeatureMap(TrainableFeatureMap):
    """A trainable map made of `depth` head-wise layers or units (ffn, the GLU family).

    Adds the keyword-only `depth` (1 to 3) and `hidden_activation` (a key of
    `HIDDEN_ACTIVATIONS`) to the `TrainableFeatureMap` arguments; every
    hidden layer or unit has width ``C``.
    """

    def __init__(self, *, depth=1, hidden_activation="sigmoid", **kwargs):
        super().__init__(**kwargs)
        self.depth = check_int_in_range("depth", depth, 1, 3)
        self.hidden_activation = check_one_of("hidden_activation", hidden_activation, tuple(sorted(HIDDEN_ACTIVATIONS)))

    def get_config(self):
        return {
            **super().get_config(),
            "depth": self.depth,
            "hidden_activation": self.hidden_activation,
        }


def layer_dims(input_dim, feature_dim, depth):
    """(in, out) dims of the `depth` layers/units: ``D -> C`` then ``C -> C``."""
    return [(input_dim if i == 0 else feature_dim, feature_dim) for i in range(depth)]
