"""Recurrent state described once: `StateSpec` entries, their zeros and their check.

Every layer or model with a recurrent form describes its state as a list of
`StateSpec` (name, per-example shape without the batch dim, dtype). Its
initial state, its state checks, the RNN cell's flat state sizes and the
exported ``step`` signatures are all derived from that list, so a new kind of
state (a decay-gated state, a convolution buffer, a window ring) is declared
in one place: the layer's ``state_spec()``.
"""

import collections
import math

from keras_linattn import _lazy

ops = _lazy.module("keras.ops")  # loaded on first use (keras_linattn.serving imports this module without Keras)

StateSpec = collections.namedtuple("StateSpec", ["name", "shape", "dtype"])
StateSpec.__doc__ = """One tensor of a recurrent state: ``name``, per-example ``shape`` (no batch dim), ``dtype``."""


def zeros_state(spec, batch_size):
    """The initial state of `spec`: zeros ``[batch_size, *shape]`` per entry, as a list."""
    return [ops.zeros((batch_size,) + tuple(s.shape), dtype=s.dtype) for s in spec]


def flat_size(entry):
    """Number of values of one example in a `StateSpec` entry."""
    return math.prod(entry.shape)


def check_state(spec, state, batch_size=None, name="state"):
    """Raises ValueError (naming `name` and the entry) unless `state` matches `spec`.

    Static dims are compared; a ``None`` batch (a symbolic trace) is accepted.
    """
    if not isinstance(state, (list, tuple)) or len(state) != len(spec):
        got = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
        names = ", ".join(s.name for s in spec)
        raise ValueError(
            f"`{name}` must be a list of {len(spec)} tensors [{names}] as returned by "
            f"`get_initial_state`. Received: {name} with {got} entries"
        )
    for i, (s, x) in enumerate(zip(spec, state, strict=True)):
        shape = tuple(getattr(x, "shape", ()))
        expected = ((batch_size,) if batch_size is not None else (None,)) + tuple(s.shape)
        ok = len(shape) == len(expected) and all(
            a is None or b is None or a == b for a, b in zip(shape, expected, strict=True)
        )
        if not ok:
            shown = tuple("B" if d is None else d for d in expected)
            raise ValueError(f"`{name}[{i}]` ({s.name}) must have shape {shown}. Received: {name}[{i}].shape={shape}")
