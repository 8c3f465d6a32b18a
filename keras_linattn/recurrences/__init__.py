"""Recurrences of `LinearAttention`: state updates and readouts as plug-ins, and their registry.

>>> from keras_linattn import recurrences
>>> {"additive", "decay", "delta", "window"} <= set(recurrences.available())
True
>>> recurrences.get("decay", gate="scalar")
DecayRecurrence(gate='scalar', normalize=True)

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those. CONTRIBUTING.md lists what a new recurrence needs.
"""

from keras_linattn.recurrences import additive, base, decay, delta, registry, sparse_cache, window
from keras_linattn.recurrences.additive import AdditiveRecurrence
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.decay import DecayRecurrence
from keras_linattn.recurrences.delta import DeltaRecurrence
from keras_linattn.recurrences.registry import available, deserialize, get, get_class, register, serialize
from keras_linattn.recurrences.sparse_cache import SparseCacheRecurrence
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = [
    *additive.__all__,
    *base.__all__,
    *decay.__all__,
    *delta.__all__,
    *registry.__all__,
    *sparse_cache.__all__,
    *window.__all__,
]
