"""Rotary position embeddings (RoPE, Su et al. 2021), in the rotate-half layout of keras-hub and Llama.

For a head vector ``x`` of even size D at position p::

    inv_j = max_wavelength ** (-2j / D) / scaling_factor,   j = 0 .. D/2 - 1
    theta = p * [inv, inv]                                  # [D], the halves repeat
    rope(x, p) = x * cos(theta) + [-x2, x1] * sin(theta)    # x = [x1, x2], halves of D/2

which is `keras_hub.layers.RotaryEmbedding` with ``rope_type="linear"``
(the default): ``scaling_factor`` divides the inverse frequencies, that is
it stretches positions. Since a rotation preserves dot products up to the
position difference, ``rope(q, i) . rope(k, j)`` depends on ``i - j`` only.

Shape legend: B batch, T length, H heads, D head dim.

Angles are computed in float32 (as keras-hub does) and the rotation in
float32 whatever the inputs' dtype; the result has the inputs' dtype.
"""

from keras import ops

from keras_linattn import _validation

__all__ = ["rotary_embedding", "rotary_embedding_reference"]


def _check_rope_arguments(max_wavelength, scaling_factor):
    """Validates the two RoPE arguments; returns ``(max_wavelength or None, scaling_factor)`` as floats."""
    max_wavelength = _validation.check_positive_float("rope_max_wavelength", max_wavelength, allow_none=True)
    scaling_factor = _validation.check_positive_float("rope_scaling_factor", scaling_factor)
    return max_wavelength, scaling_factor


def _inverse_frequencies(dim, max_wavelength, scaling_factor=1.0):
    """``max_wavelength ** (-2j / dim) / scaling_factor`` for ``j < dim / 2``: ``[dim / 2]`` float32."""
    index = ops.arange(0, dim, 2, dtype="float32")  # [D/2]
    inverse = ops.power(ops.cast(max_wavelength, "float32"), -(index / float(dim)))  # [D/2]
    return inverse / float(scaling_factor)


def rotary_embedding(x, positions, max_wavelength=10000.0, scaling_factor=1.0):
    """Rotates each head vector of `x` by its position.

    Args:
        x: ``[B, T, H, D]`` (or ``[B, H, D]`` for one step), D even.
        positions: ``[B, T]`` (or ``[B]``): the position of each token, any
            int or float dtype.
        max_wavelength: the base of the frequencies (10000 in Llama 2).
        scaling_factor: positions are divided by it (linear RoPE scaling).

    Returns:
        ``x``'s shape and dtype.
    """
    dim = x.shape[-1]
    if dim is None or dim % 2:
        raise ValueError(
            f"Rotary embeddings need an even head dim (the vector is split in halves). Received: x.shape={x.shape}"
        )
    _validation.check_rank("positions", positions, len(x.shape) - 2)
    max_wavelength, scaling_factor = _check_rope_arguments(max_wavelength, scaling_factor)
    inverse = _inverse_frequencies(dim, max_wavelength, scaling_factor)  # [D/2]
    angles = ops.cast(positions, "float32")[..., None, None] * inverse  # [B, T, 1, D/2]
    angles = ops.concatenate([angles, angles], axis=-1)  # [B, T, 1, D]
    xf = ops.cast(x, "float32")
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2 :]  # [B, T, H, D/2] each
    rotated = ops.concatenate([-x2, x1], axis=-1)  # [B, T, H, D]
    return ops.cast(xf * ops.cos(angles) + rotated * ops.sin(angles), x.dtype)


def rotary_embedding_reference(x, positions, max_wavelength=10000.0, scaling_factor=1.0, compute_dtype="float64"):
    """The oracle of `rotary_embedding`: frequencies, angles and rotation in ``compute_dtype`` (float64)."""
    dim = x.shape[-1]
    index = ops.arange(0, dim, 2, dtype=compute_dtype)  # [D/2]
    inverse = ops.power(ops.cast(max_wavelength, compute_dtype), -(index / dim)) / scaling_factor  # [D/2]
    angles = ops.cast(positions, compute_dtype)[..., None, None] * inverse  # [B, T, 1, D/2]
    cos, sin = ops.cos(angles), ops.sin(angles)
    xf = ops.cast(x, compute_dtype)
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2 :]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, H, D]
