"""`LinearBackbone`'s configuration checks and each block's attention spec (seeds, per-layer arguments)."""

import numpy as np

from keras_linattn import _validation
from keras_linattn.layers.spec import PRETRAINED_ARGUMENTS, AttentionSpec
from keras_linattn.layers.transformer import _check_moe

__all__ = []


def _block_seed(seed, index):
    """The seed of block `index`'s feature map, derived from the template's `seed`.

    Block 0 keeps `seed` (a one-block model is the template); block ``i > 0``
    gets a hash of ``(seed, i)`` (NumPy's `SeedSequence`), below 2**30 so
    that seeds derived from it (per head, per weight) stay in int32. Seeds
    ``seed + i`` would give block 1 of seed s the matrix of block 0 of seed
    s + 1.
    """
    if seed is None or index == 0:
        return seed
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1)[0]) % (2**30)


def _block_spec(spec, index):
    """Block `index`'s spec: the backbone's, with a seeded feature map's seed replaced by `_block_seed`.

    Without it every block of a seeded LM drew the same random projection
    (favor+, favor_trig) or the same initial weights (trainable maps), and
    `RedrawRandomFeatures` redrew them equal.
    """
    feature_map = spec.make_feature_map()
    seed = None if feature_map is None else feature_map.seed
    if feature_map is None or seed is None or index == 0:
        return spec
    config = dict(feature_map.get_config(), seed=_block_seed(seed, index))
    return spec.replace(feature_map=type(feature_map).from_config(config))


# The attention arguments a `layer_attention` entry may replace in one block.
LAYER_ARGUMENTS = PRETRAINED_ARGUMENTS + ("recurrence",)


def _check_layer_attention(layer_attention, num_layers):
    """`layer_attention` as a tuple of `num_layers` dicts (or None), each with `LAYER_ARGUMENTS` keys only.

    Raises:
        ValueError: for another length, an entry that is not a dict, or a key
            that is not a per-layer attention argument.
    """
    if layer_attention is None:
        return None
    if not isinstance(layer_attention, (list, tuple)) or len(layer_attention) != num_layers:
        raise ValueError(
            f"`layer_attention` must be None or a list of {num_layers} dicts (one per layer). "
            f"Received: layer_attention={layer_attention!r}"
        )
    out = []
    for entry in layer_attention:
        if not isinstance(entry, dict) or set(entry) - set(LAYER_ARGUMENTS):
            raise ValueError(
                f"Each `layer_attention` entry is a dict of some of {list(LAYER_ARGUMENTS)}. Received: {entry!r}"
            )
        out.append(dict(entry))
    return tuple(out)


def _check_layer_moe(moe, num_layers):
    """`moe` as a tuple of `num_layers` entries (a dict of `MixtureOfExperts` arguments, or None), or None.

    A dict alone applies to every layer. Each dict is checked by the block
    (`keras_linattn.layers.transformer._check_moe`).

    Raises:
        ValueError: for a list of another length, or a value that is neither
            None, a dict nor a list.
    """
    if moe is None:
        return None
    if isinstance(moe, dict):
        return tuple(_check_moe(moe) for _ in range(num_layers))
    if not isinstance(moe, (list, tuple)) or len(moe) != num_layers:
        raise ValueError(
            f"`moe` must be None, a dict, or a list of {num_layers} entries (a dict or None per layer). "
            f"Received: moe={moe!r}"
        )
    return tuple(None if entry is None else _check_moe(entry) for entry in moe)


def _layer_spec(spec, index, layer_attention):
    """Block `index`'s spec: `_block_spec`, with its `layer_attention` entry's arguments replaced."""
    spec = _block_spec(spec, index)
    if layer_attention is None or not layer_attention[index]:
        return spec
    config = dict(spec.get_config(), **layer_attention[index])
    return AttentionSpec.from_config(config)


def _check_sizes(vocabulary_size, num_layers, hidden_dim, num_heads, intermediate_dim, key_dim, max_sequence_length):
    """Raises ValueError for a size that is not a positive int, or a width the heads do not divide."""
    for name, value in (
        ("vocabulary_size", vocabulary_size),
        ("num_layers", num_layers),
        ("hidden_dim", hidden_dim),
        ("num_heads", num_heads),
        ("intermediate_dim", intermediate_dim),
    ):
        _validation.check_positive_int(name, value)
    if max_sequence_length is not None:
        _validation.check_positive_int("max_sequence_length", max_sequence_length)
    if key_dim is not None:
        _validation.check_positive_int("key_dim", key_dim)
    elif hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads` when `key_dim` is None. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
