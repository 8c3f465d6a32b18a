"""Random projections shared by the random-feature maps (FAVOR+, FAVOR-trig).

The projections are drawn with NumPy from an explicit seed, so that a map
built twice from the same seed gets the same matrix on every backend and
device. They are stored in non-trainable weights: a saved model keeps the
matrix it was trained with, whatever the seed.

Shape legend: H heads, m random features, D key dim.
"""

import numpy as np
from keras import ops

from keras_linattn import _compat
from keras_linattn._validation import check_one_of, check_positive_float, check_positive_int, check_seed
from keras_linattn.feature_maps.base import FeatureMap

__all__ = ["RandomFeatureMap"]


_KINDS = ("orthogonal", "iid")
_SCALINGS = ("chi", "sqrt")

# Upper bound of the exponent of a causal key's features, shared by FAVOR+
# (``w.x' - |x'|^2/2``) and FAVOR-trig (the amplitude ``|x'|^2/2``). For
# FAVOR+ ``w.x' - |x'|^2/2 <= |w|^2/2`` for every x', so with D <= 64 the
# bound is never reached in practice; it only keeps a key lying almost
# exactly on a random direction of a large-D projection (or a huge key for
# FAVOR-trig) from overflowing float32 (exp(50) ~ 5e21, leaving room to sum
# ~1e16 such keys).
_KEY_EXPONENT_CAP = 50.0


def _make_rng(seed, draw_index=0):
    """NumPy generator for draw number `draw_index` of a map seeded with `seed`.

    ``seed=None`` takes fresh entropy from the OS. Draw 0 is the one made in
    `build`; draws 1, 2, ... are the successive `redraw()` calls, so a seeded
    map redraws along a reproducible sequence.
    """
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([int(seed), int(draw_index)])


def _orthogonal_block(rng, dim):
    """A ``[dim, dim]`` Haar-distributed orthogonal matrix (QR of a Gaussian).

    The signs of ``diag(R)`` are folded into ``Q`` so that the distribution
    is uniform over the orthogonal group (a bare QR is biased).
    """
    gaussian = rng.standard_normal((dim, dim))  # [D, D]
    q, r = np.linalg.qr(gaussian)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs[None, :]  # [D, D], orthonormal rows and columns


def _gaussian_projection(rng, num_features, dim, kind="orthogonal", scaling="chi"):
    """Random projection ``W [m, D]`` whose rows ``w_i`` define the features.

    Args:
        rng: a `numpy.random.Generator`.
        num_features: m, the number of rows.
        dim: D, the input dim.
        kind: ``"orthogonal"``: rows come in blocks of D mutually orthogonal
            directions (each block the Q of a Gaussian matrix's QR, the last
            block truncated to ``m mod D`` rows); ``"iid"``: rows are
            independent ``N(0, I_D)`` vectors.
        scaling: row norms. ``"chi"``: each norm is drawn from the chi(D)
            distribution (the norm of a D-dim standard Gaussian), so every row
            is marginally ``N(0, I_D)`` and the softmax-kernel estimator is
            unbiased. ``"sqrt"``: every row has norm ``sqrt(D)`` (the
            "regularized" variant: lower variance, slightly biased).

    Returns:
        float32 array ``[m, D]``.
    """
    num_features = check_positive_int("num_features", num_features)
    dim = check_positive_int("dim", dim)
    check_one_of("kind", kind, _KINDS)
    check_one_of("scaling", scaling, _SCALINGS)
    if kind == "orthogonal":
        num_blocks = -(-num_features // dim)
        blocks = [_orthogonal_block(rng, dim) for _ in range(num_blocks)]  # each [D, D]
        directions = np.concatenate(blocks, axis=0)[:num_features]  # [m, D], unit rows
        if scaling == "chi":
            norms = np.linalg.norm(rng.standard_normal((num_features, dim)), axis=1)  # [m]
        else:
            norms = np.full((num_features,), np.sqrt(dim))  # [m]
        projection = directions * norms[:, None]  # [m, D]
    else:
        projection = rng.standard_normal((num_features, dim))  # [m, D]
        if scaling == "sqrt":
            projection *= np.sqrt(dim) / np.linalg.norm(projection, axis=1, keepdims=True)
    return projection.astype("float32")


def _headwise_projection(rng, num_heads, num_features, dim, kind="orthogonal", scaling="chi"):
    """Independent projections for each head: float32 ``[H, m, D]``."""
    check_positive_int("num_heads", num_heads)
    return np.stack(
        [_gaussian_projection(rng, num_features, dim, kind, scaling) for _ in range(num_heads)]
    )  # [H, m, D]


class RandomFeatureMap(FeatureMap):
    """Base of the feature maps built on a random Gaussian projection.

    Holds the projection ``W [H, m, D]`` (one independent draw per head) in a
    non-trainable float32 weight created in `build` from `seed`, and
    `redraw()` to replace it. Subclasses turn ``(x', W x')`` into features.

    The number of draws made so far is a second non-trainable weight,
    ``draw_index`` (int64, 0 after `build`): it is saved in ``.keras`` files,
    ``.weights.h5`` files, `BackupAndRestore` backups and `tf.train.Checkpoint`s
    with the projection, so a restored map continues its sequence of redraws
    where the saved one was (a resumed training run redraws exactly what an
    uninterrupted one would). Files saved before this weight existed load
    with ``draw_index = 0``.

    Args:
        num_features: m, the number of random features per head. It is not
            the feature dim C itself: each map says how C follows from m
            (FAVOR+: ``C = m``; FAVOR-trig: ``C = 2m``), and
            ``feature_dim(D)`` returns C.
        kind: ``"orthogonal"`` (blocks of orthogonal rows, lower variance) or
            ``"iid"`` (independent Gaussian rows).
        scaling: ``"chi"`` (chi(D)-distributed row norms, unbiased) or
            ``"sqrt"`` (every row norm ``sqrt(D)``).
        scale: multiplier of the inputs, ``x' = scale * x``; None means
            ``D^(-1/4)``, so that ``exp(q'.k') = exp(q.k / sqrt(D))``, the
            softmax kernel.
        seed: None or a non-negative int; the projection drawn in `build` is
            a function of the seed only. None draws from OS entropy.
        **kwargs: standard `keras.layers.Layer` arguments.
    """

    def __init__(self, num_features=256, kind="orthogonal", scaling="chi", scale=None, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.num_features = check_positive_int("num_features", num_features)
        self.kind = check_one_of("kind", kind, _KINDS)
        self.scaling = check_one_of("scaling", scaling, _SCALINGS)
        self.scale = check_positive_float("scale", scale, allow_none=True)
        self.seed = check_seed("seed", seed)

    def build(self, input_shape):
        heads_dim = self.build_heads(input_shape)
        if heads_dim is None:
            return
        self._num_heads, self._dim = heads_dim
        initial = _headwise_projection(
            _make_rng(self.seed, 0), self._num_heads, self.num_features, self._dim, self.kind, self.scaling
        )  # [H, m, D]
        self.projection = self.add_weight(
            name="projection",
            shape=(self._num_heads, self.num_features, self._dim),
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(initial, dtype=dtype),
            trainable=False,
            dtype="float32",
        )
        # How many `redraw()` calls produced the current projection (see the class docstring).
        self.draw_index = self.add_weight(
            name="draw_index", shape=(), initializer="zeros", trainable=False, dtype="int64"
        )

    def load_own_variables(self, store):
        """Loads the projection and, when present, ``draw_index``.

        Files written before ``draw_index`` existed hold the projection only;
        they load with ``draw_index = 0``.
        """
        own = _compat.own_variables(self)
        if self.built and len(store.keys()) == len(own) - 1:
            self.projection.assign(store["0"])
            self.draw_index.assign(0)
            return
        super().load_own_variables(store)

    def redraw(self, seed=None):
        """Draws a new projection and assigns it to the weight.

        Args:
            seed: None continues the map's reproducible sequence of draws (draw
                1, 2, ... of `self.seed`; fresh entropy when `self.seed` is
                None). An int draws the matrix that a map built with
                ``seed=seed`` has (``redraw(seed=self.seed)`` restores the
                initial projection).
        """
        if not self.built:
            raise ValueError(
                f"{type(self).__name__} must be built (called once) before `redraw()`. "
                f"Received: a map with built={self.built}"
            )
        if seed is None:
            index = int(self.draw_index.numpy()) + 1
            rng = _make_rng(self.seed, index)
        else:
            seed = check_seed("seed", seed)
            index = None  # an explicit seed leaves the sequence where it is
            rng = _make_rng(seed, 0)
        new = _headwise_projection(rng, self._num_heads, self.num_features, self._dim, self.kind, self.scaling)
        self.projection.assign(new)  # [H, m, D]
        if index is not None:
            self.draw_index.assign(index)

    def _project(self, inputs):
        """Returns ``(x' [B, T, H, D], W x' [B, T, H, m])`` in the compute dtype."""
        self.check_heads(inputs)
        x = ops.cast(inputs, self.compute_dtype)
        scale = self.scale if self.scale is not None else self._dim**-0.25
        x = x * scale  # [B, T, H, D]
        w = ops.cast(self.projection, self.compute_dtype)  # [H, m, D]
        return x, ops.einsum("bthd,hmd->bthm", x, w)  # [B, T, H, m]

    def get_config(self):
        return {
            **super().get_config(),
            "num_features": self.num_features,
            "kind": self.kind,
            "scaling": self.scaling,
            "scale": self.scale,
            "seed": self.seed,
        }
