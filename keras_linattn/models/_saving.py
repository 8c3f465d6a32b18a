"""`.keras` files of large `LinearBackbone` / `LinearCausalLM` models: weights streamed through a file on disk.

Keras writes a ``.keras`` archive's weights into an in-memory HDF5 buffer
(and reads them back into one at load) whenever the weights take less than
half the memory the machine has free (``saving_lib.is_memory_sufficient``).
On a large shared machine that is nearly always: a save then holds the
weights about three times (variables, the HDF5 buffer, the copy written into
the zip) and a load twice. At the Llama 3.2 1B shape (4.62 GiB) that is a
save past 17 GB and a load of 15.3 GiB.

Keras' own other branch writes the HDF5 file beside the target and adds it
to the archive (and at load extracts it beside the archive and reads it one
weight at a time): one weight held at a time. `install` makes Keras take
that branch for this package's models once their weights reach
`STREAM_BYTES`; every other model is answered by Keras' own rule. Where the
directory cannot take the temporary file, Keras falls back to its in-memory
path (save) or reads from the archive on the fly (load).
"""

import math

import numpy as np

from keras_linattn import _compat

__all__ = ["STREAM_BYTES", "install", "streams_weights"]

# Weights of at least this many bytes go through a file on disk in a `.keras` save or load: above it, an
# in-memory copy of the weights costs more than the disk round trip (a GPT-2 base, 0.5 GiB, streams).
STREAM_BYTES = 256 * 2**20

_MARK = "_keras_linattn_streams"
_BACKBONE_CLASSES = []  # `LinearBackbone`, given by `install` (backbone.py imports this module, not the reverse)


def _weight_bytes(model):
    return sum(math.prod(v.shape) * np.dtype(str(v.dtype)).itemsize for v in model.variables)


def streams_weights(model):
    """True where a `.keras` save or load of `model` goes through a file on disk (this package's models only).

    Args:
        model: any Keras model.

    Returns:
        True for a `LinearBackbone` or `LinearCausalLM` whose variables hold
        at least `STREAM_BYTES` bytes, False for any other model.
    """
    backbones = tuple(_BACKBONE_CLASSES)
    if not backbones or (
        not isinstance(model, backbones) and not isinstance(getattr(model, "backbone", None), backbones)
    ):
        return False
    return _weight_bytes(model) >= STREAM_BYTES


def install(backbone_class):
    """Makes Keras' `.keras` save and load stream this package's large models' weights (idempotent).

    Args:
        backbone_class: `LinearBackbone`: its instances, and models whose
            ``backbone`` is one, are this package's models.
    """
    if backbone_class not in _BACKBONE_CLASSES:
        _BACKBONE_CLASSES.append(backbone_class)
    try:
        original = _compat.keras_file_memory_check()
    except RuntimeError:  # another Keras layout: its own rule stays
        return
    if getattr(original, _MARK, False):
        return

    def is_memory_sufficient(model):
        if streams_weights(model):
            return False
        return original(model)

    setattr(is_memory_sufficient, _MARK, True)
    is_memory_sufficient.__wrapped__ = original
    _compat.set_keras_file_memory_check(is_memory_sufficient)
