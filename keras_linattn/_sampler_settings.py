"""The rule table of sampler settings, checked in Python (NumPy only: no TensorFlow, no Keras).

Every front end that samples takes the same four settings: `temperature`,
`top_k`, `top_p` (`keras_linattn.samplers.sample`, the built-in samplers,
the SavedModel ``generate_sampled`` signature, ``<model>_generate.onnx`` and
`OnnxGenerator.generate`) and the generate `seed`. The exported graphs
receive them as float32 / int32 / int64 scalars, so every rule is stated on
those values: a Python number is first rounded to the graphs' type
(``1e39`` is float32 +inf, ``1e-50`` is float32 -0.0).

- ``temperature`` (float32):
  ``2^-126 <= t <= 3.4028235e38`` samples from ``softmax(logits / t)``;
  ``+0 <= t < 2^-126`` (0 and the subnormals) is greedy (argmax, the first
  of ties); refused: NaN, +-inf, ``t < 0``, -0.0.
- ``top_k`` (int32): 0 is no top-k filter; ``1 <= k <= 2^31 - 1`` keeps the
  k most likely tokens (``k >= V`` keeps all); refused: ``k < 0``, larger
  integers, bools, non-integers.
- ``top_p`` (float32): ``2^-126 <= p <= 1`` keeps the smallest set of most
  likely tokens whose mass reaches p (1 keeps all); refused: NaN, +-inf,
  ``p < 2^-126`` (0 included), ``p > 1``.
- ``seed`` (int64): ``0 <= s <= 2^63 - 1`` (None in Python: a fresh seed);
  token t is drawn with ``[s mod (2^31 - 1), t]``; refused: ``s < 0``,
  ``s >= 2^63``, bools, non-integers.

The floor ``2^-126`` (`FLOAT32_TINY`, float32's smallest normal number):
TensorFlow's CPU kernels flush subnormal float32 inputs to zero (DAZ) and
onnxruntime and NumPy do not, so no graph can tell a subnormal setting from
0 -- and 0 is the graphs' greedy switch (``temperature=0``). Treating every
temperature below the floor as greedy is the one rule all runtimes compute
alike, and it is the limit of sampling as ``t -> 0+``. At and above the
floor nothing overflows: the kernel divides ``logits - max(logits)`` (<= 0)
by ``t``, so a tiny ``t`` makes the other tokens -inf, never the best one
+inf. A ``top_p`` below the floor would be 0 in TensorFlow and not in
onnxruntime: it is refused with 0. A negative temperature that float32
rounds to -0.0, or a negative subnormal, is refused like any negative one.

Python front ends raise ``ValueError`` naming the setting and the value
received (`check_temperature`, `check_top_k`, `check_top_p`, `check_seed`).
The graphs check the same table with `keras_linattn.samplers.settings_rules`
(the SavedModel's run-time assertion names the setting; the ONNX generate
graph answers ``output_ids`` full of -1; `samplers.sample` with tensor
settings answers -1 rows).
"""

import math
import numbers

import numpy as np

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT32_MAX",
    "INT64_MAX",
    "MESSAGES",
    "check_seed",
    "check_settings",
    "check_temperature",
    "check_top_k",
    "check_top_p",
    "is_greedy_temperature",
]

FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, the smallest normal float32
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# What each setting must be: the same words in the Python errors and the graphs' assertions.
MESSAGES = {
    "temperature": "a float32 number in [0, 3.4028235e+38] (not -0.0; below 2**-126 it decodes greedily)",
    "top_k": "an integer in [0, 2**31 - 1] (0: no top-k filter)",
    "top_p": "a float32 number in [2**-126, 1] (1: no top-p filter)",
    "seed": "an integer in [0, 2**63 - 1]",
}


def _refuse(name, setting, value):
    raise ValueError(f"`{name}` must be {MESSAGES[setting]}. Received: {name}={value!r}")


def _as_float32(name, setting, value):
    """`value` as the float32 a graph would receive; bools, strings and arrays are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _refuse(name, setting, value)
    with np.errstate(over="ignore"):
        return np.float32(value)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_temperature(value, name="temperature"):
    """Checks a temperature (rule table above); returns it as a Python float.

    Args:
        value: a Python or NumPy real number.
        name: the argument's name in the error message.

    Returns:
        ``float(value)``; `is_greedy_temperature` tells whether it decodes greedily.

    Raises:
        ValueError: for NaN, +-inf (also a finite number that overflows float32), a negative number or -0.0,
            a bool or a non-number, naming `name` and the value received.
    """
    t = _as_float32(name, "temperature", value)
    if not (math.isfinite(t) and t >= 0 and not math.copysign(1.0, t) < 0):
        _refuse(name, "temperature", value)
    return float(value)


def is_greedy_temperature(value):
    """True for a checked temperature that decodes greedily: below `FLOAT32_TINY` in float32 (0 included)."""
    return float(np.float32(value)) < FLOAT32_TINY


def check_top_k(value, name="top_k"):
    """Checks a top-k setting: an integer in ``[0, 2^31 - 1]`` (0: no filter); returns an `int`.

    Raises:
        ValueError: for a negative or too large integer, a bool or a non-integer, naming `name` and the value.
    """
    if not _is_int(value) or not 0 <= value <= INT32_MAX:
        _refuse(name, "top_k", value)
    return int(value)


def check_top_p(value, name="top_p"):
    """Checks a top-p setting: a float32 number in ``[2^-126, 1]``; returns a Python float.

    Raises:
        ValueError: for NaN, +-inf, a number below ``2^-126`` (0 included) or above 1, a bool or a
            non-number, naming `name` and the value received.
    """
    p = _as_float32(name, "top_p", value)
    if not FLOAT32_TINY <= p <= 1.0:  # NaN fails both comparisons
        _refuse(name, "top_p", value)
    return float(value)


def check_seed(value, name="seed"):
    """Checks a generate seed: None (a fresh seed is drawn) or an integer in ``[0, 2^63 - 1]``.

    Returns:
        None or an `int`.

    Raises:
        ValueError: for a negative integer, one of 2^63 or more, a bool or a non-integer, naming `name`
            and the value received.
    """
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= INT64_MAX:
        _refuse(name, "seed", value)
    return int(value)


def check_settings(temperature, top_k, top_p):
    """All three sampling settings: ``(float temperature, int top_k, float top_p)``.

    Raises:
        ValueError: naming the first setting refused (see `check_temperature`, `check_top_k`, `check_top_p`).
    """
    return check_temperature(temperature), check_top_k(top_k), check_top_p(top_p)
