"""Rotary position embeddings (RoPE, Su et al. 2021), in the rotate-half layout of keras-hub and Llama.

For a head vector ``x`` of even size D at position p::

    inv_j = max_wavelength ** (-2j / D) / scaling_factor,   j = 0 .. D/2 - 1
    theta = p * [inv, inv]                                  # [D], the halves repeat
    rope(x, p) = x * cos(theta) + [-x2, x1] * sin(theta)    # x = [x1, x2], halves of D/2

which is `keras_hub.layers.RotaryEmbedding` with ``rope_type="linear"``
(the default): ``scaling_factor`` divides the inverse frequencies, that is
it stretches positions.

Llama 3.1-3.3 adjust the frequencies further (``frequency_adjustment =
(factor, low_freq_factor, high_freq_factor, pretraining_length)``, keras-hub's
`LlamaRotaryEmbedding`, from a checkpoint's ``rope_scaling`` of type
"llama3")::

    wavelength_j = 2 pi / inv_j
    inv_j / factor                                   if wavelength_j > pretraining_length / low_freq_factor
    inv_j                                            if wavelength_j < pretraining_length / high_freq_factor
    (1 - s_j) inv_j / factor + s_j inv_j             otherwise, with
        s_j = (pretraining_length / wavelength_j - low_freq_factor) / (high_freq_factor - low_freq_factor)

Since a rotation preserves dot products up to the position difference,
``rope(q, i) . rope(k, j)`` depends on ``i - j`` only.

Shape legend: B batch, T length, H heads, D head dim.

Angles are computed in float32 (as keras-hub does) and the rotation in
float32 whatever the inputs' dtype; the result has the inputs' dtype.
"""

import math

from keras import ops

from keras_linattn import _validation

__all__ = ["rotary_embedding", "rotary_embedding_reference"]


def _check_rope_arguments(max_wavelength, scaling_factor):
    """Validates the two RoPE arguments; returns ``(max_wavelength or None, scaling_factor)`` as floats."""
    max_wavelength = _validation.check_positive_float("rope_max_wavelength", max_wavelength, allow_none=True)
    scaling_factor = _validation.check_positive_float("rope_scaling_factor", scaling_factor)
    return max_wavelength, scaling_factor


def _check_frequency_adjustment(value):
    """Validates Llama 3.1's RoPE frequency adjustment: None or 4 positive numbers, as a tuple of floats.

    Args:
        value: None, or ``(factor, low_freq_factor, high_freq_factor,
            pretraining_length)`` (a list from a JSON config is accepted).

    Returns:
        None or a tuple of 4 floats.

    Raises:
        ValueError: for another length, a non-positive entry, or
            ``high_freq_factor <= low_freq_factor``.
    """
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise ValueError(
            "`rope_frequency_adjustment` must be None or (factor, low_freq_factor, high_freq_factor, "
            f"pretraining_length). Received: rope_frequency_adjustment={value!r}"
        )
    names = ("factor", "low_freq_factor", "high_freq_factor", "pretraining_length")
    out = tuple(
        _validation.check_positive_float(f"rope_frequency_adjustment {n}", v) for n, v in zip(names, value, strict=True)
    )
    if out[2] <= out[1]:
        raise ValueError(
            "`rope_frequency_adjustment` needs high_freq_factor > low_freq_factor. "
            f"Received: rope_frequency_adjustment={value!r}"
        )
    return out


def _adjust_frequencies(inverse, adjustment):
    """Llama 3.1's frequency adjustment of ``inverse`` ``[D/2]`` (the module docstring), in its dtype.

    The same operations, in the same order, as keras-hub's `LlamaRotaryEmbedding._get_inverse_freq`.
    """
    factor, low, high, length = adjustment
    wavelength = 2 * math.pi / inverse  # [D/2]
    inverse = ops.where(ops.greater(wavelength, length / low), inverse / factor, inverse)
    smooth = ((length / wavelength) - low) / (high - low)  # [D/2]
    smoothed = (1 - smooth) * (inverse / factor) + smooth * inverse
    medium = ops.logical_and(ops.greater_equal(wavelength, length / high), ops.less_equal(wavelength, length / low))
    return ops.where(medium, smoothed, inverse)


def _inverse_frequencies(dim, max_wavelength, scaling_factor=1.0, frequency_adjustment=None):
    """``max_wavelength ** (-2j / dim) / scaling_factor`` for ``j < dim / 2``: ``[dim / 2]`` float32.

    With a `frequency_adjustment`, Llama 3.1's adjustment instead of the scaling, computed with the float32
    operations of keras-hub's `LlamaRotaryEmbedding` (``1 / wavelength ** (2j / dim)``, then the
    adjustment), so that the angles are the teacher's bit for bit; it ignores its position scaling factor:
    `scaling_factor` must then be 1.
    """
    index = ops.arange(0, dim, 2, dtype="float32")  # [D/2]
    if frequency_adjustment is not None:
        inverse = 1.0 / ops.power(ops.cast(max_wavelength, "float32"), index / ops.cast(dim, "float32"))  # [D/2]
        return _adjust_frequencies(inverse, frequency_adjustment)
    inverse = ops.power(ops.cast(max_wavelength, "float32"), -(index / float(dim)))  # [D/2]
    return inverse / float(scaling_factor)


def rotary_embedding(
    x, positions, max_wavelength=10000.0, scaling_factor=1.0, frequency_adjustment=None, rotary_dim=None
):
    """Rotates each head vector of `x` by its position.

    Args:
        x: ``[B, T, H, D]`` (or ``[B, H, D]`` for one step), D even.
        positions: ``[B, T]`` (or ``[B]``): the position of each token, any
            int or float dtype.
        max_wavelength: the base of the frequencies (10000 in Llama 2).
        scaling_factor: positions are divided by it (linear RoPE scaling).
        frequency_adjustment: None, or Llama 3.1's ``(factor,
            low_freq_factor, high_freq_factor, pretraining_length)`` (the
            module docstring; `scaling_factor` must then be 1).
        rotary_dim: None (default: all of D) or an even ``r < D``: only the
            first r entries of each head vector are rotated, with the
            frequencies of a vector of size r; the rest pass unchanged
            (partial rotary, GPT-NeoX).

    Returns:
        ``x``'s shape and dtype.

    Raises:
        ValueError: for an odd head dim, a bad argument, or a
            `frequency_adjustment` with a `scaling_factor` other than 1.
    """
    if rotary_dim is not None and rotary_dim != x.shape[-1]:
        if not 0 < rotary_dim < (x.shape[-1] or 0) or rotary_dim % 2:
            raise ValueError(
                f"`rotary_dim` must be an even number below the head dim. Received: rotary_dim={rotary_dim}, "
                f"x.shape={x.shape}"
            )
        rotated = rotary_embedding(x[..., :rotary_dim], positions, max_wavelength, scaling_factor, frequency_adjustment)
        return ops.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
    dim = x.shape[-1]
    if dim is None or dim % 2:
        raise ValueError(
            f"Rotary embeddings need an even head dim (the vector is split in halves). Received: x.shape={x.shape}"
        )
    _validation.check_rank("positions", positions, len(x.shape) - 2)
    max_wavelength, scaling_factor = _check_rope_arguments(max_wavelength, scaling_factor)
    frequency_adjustment = _check_frequency_adjustment(frequency_adjustment)
    if frequency_adjustment is not None and scaling_factor != 1.0:
        raise ValueError(
            "Llama 3.1's `frequency_adjustment` replaces the linear scaling: pass scaling_factor=1. "
            f"Received: scaling_factor={scaling_factor}, frequency_adjustment={frequency_adjustment}"
        )
    inverse = _inverse_frequencies(dim, max_wavelength, scaling_factor, frequency_adjustment)  # [D/2]
    angles = ops.cast(positions, "float32")[..., None, None] * inverse  # [B, T, 1, D/2]
    angles = ops.concatenate([angles, angles], axis=-1)  # [B, T, 1, D]
    xf = ops.cast(x, "float32")
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2 :]  # [B, T, H, D/2] each
    rotated = ops.concatenate([-x2, x1], axis=-1)  # [B, T, H, D]
    return ops.cast(xf * ops.cos(angles) + rotated * ops.sin(angles), x.dtype)


def rotary_embedding_reference(
    x, positions, max_wavelength=10000.0, scaling_factor=1.0, compute_dtype="float64", frequency_adjustment=None
):
    """The oracle of `rotary_embedding`: frequencies, angles and rotation in ``compute_dtype`` (float64)."""
    dim = x.shape[-1]
    index = ops.arange(0, dim, 2, dtype=compute_dtype)  # [D/2]
    inverse = ops.power(ops.cast(max_wavelength, compute_dtype), -(index / dim)) / scaling_factor  # [D/2]
    if frequency_adjustment is not None:
        inverse = _adjust_frequencies(inverse, _check_frequency_adjustment(frequency_adjustment))
    angles = ops.cast(positions, compute_dtype)[..., None, None] * inverse  # [B, T, 1, D/2]
    cos, sin = ops.cos(angles), ops.sin(angles)
    xf = ops.cast(x, compute_dtype)
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2 :]
    return ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, H, D]
