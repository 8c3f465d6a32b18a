"""The argument rules of the package: one function per kind of argument.

Every constructor and function of `keras_linattn` checks its arguments with
these rules, so that the same bad value is refused the same way everywhere,
with a message in the Keras style naming the argument::

    ValueError: `num_heads` must be a positive integer. Received: num_heads=0

Each rule takes the argument's name first and its value second, raises
`ValueError` when the value is refused, and returns the value normalized to
a plain Python type (a NumPy integer becomes an `int`, a number a `float`),
which is what a layer should store and serialize in its config.

Common conventions:

- `bool` is never a number: ``True`` is refused wherever an int or a float
  is expected (``dropout=True`` is a mistake, not a rate of 1).
- NumPy integers (``np.int64(3)``) are accepted wherever an int is, and
  NumPy floats wherever a float is.
- Floats must be finite (no NaN, no Inf) unless a rule says otherwise.

Not here: checks of files, states and saved artifacts (digests, manifests,
attention states), which are not argument rules and live with the code that
owns those artifacts.

Inside traced graphs values cannot be checked in Python: `graph_assert` adds
the rule as a run-time assertion there (TensorFlow graphs: `tf.function`,
`fit`/`predict`, SavedModel signatures). XLA and tf2onnx drop assertion ops,
so a caller that can be compiled or converted also defines what its graph
computes when the rule is broken (docs/decoding.md, "One rule set").
"""

import math
import numbers

__all__ = [
    "check_bool",
    "check_dtype_name",
    "check_epsilon",
    "check_int_in_range",
    "check_non_negative_float",
    "check_non_negative_int",
    "check_one_of",
    "check_optional_positive_int",
    "check_positive_float",
    "check_positive_int",
    "check_rank",
    "check_rate",
    "check_seed",
    "check_same_batch",
    "check_wide_ids",
    "graph_assert",
    "refuse_attention_scores",
]


def _refuse(name, expected, value):
    raise ValueError(f"`{name}` must be {expected}. Received: {name}={value!r}")


def _is_int(value):
    """True for Python and NumPy integers, False for bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    """True for Python and NumPy ints and floats, False for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(name, value):
    """Checks that `value` is an integer ``>= 1``; returns it as an `int`.

    Bools are refused; NumPy integers are accepted.

    Raises:
        ValueError: "`name` must be a positive integer. Received: name=..."
    """
    if not _is_int(value) or value <= 0:
        _refuse(name, "a positive integer", value)
    return int(value)


def check_optional_positive_int(name, value):
    """Like `check_positive_int`, but None is accepted (and returned).

    Raises:
        ValueError: "`name` must be a positive integer or None. Received: ..."
    """
    if value is None:
        return None
    if not _is_int(value) or value <= 0:
        _refuse(name, "a positive integer or None", value)
    return int(value)


def check_non_negative_int(name, value):
    """Checks that `value` is an integer ``>= 0``; returns it as an `int`.

    Raises:
        ValueError: "`name` must be a non-negative integer. Received: ..."
    """
    if not _is_int(value) or value < 0:
        _refuse(name, "a non-negative integer", value)
    return int(value)


def check_int_in_range(name, value, low, high):
    """Checks that `value` is an integer in ``[low, high]`` (both included).

    Raises:
        ValueError: "`name` must be an integer in [low, high]. Received: ..."
    """
    if not _is_int(value) or not low <= value <= high:
        _refuse(name, f"an integer in [{low}, {high}]", value)
    return int(value)


def check_rate(name, value):
    """Checks a probability or rate (dropout): a number in ``[0, 1)``.

    Returns it as a `float`. Bools are refused (``dropout=True`` is not a
    rate of 1, which would drop everything).

    Raises:
        ValueError: "`name` must be a number in [0, 1). Received: ..."
    """
    if not _is_real(value) or not 0.0 <= value < 1.0:
        _refuse(name, "a number in [0, 1)", value)
    return float(value)


def check_seed(name, value):
    """Checks a seed: None or a non-negative integer (NumPy integers too).

    Returns None or an `int`. Bools are refused.

    Raises:
        ValueError: "`name` must be None or a non-negative integer. Received: ..."
    """
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        _refuse(name, "None or a non-negative integer", value)
    return int(value)


def check_epsilon(name, value, allow_zero=False):
    """Checks a small constant added for numerical safety: a finite number > 0.

    Used for every ``epsilon``/``eps`` of the package. With
    ``allow_zero=True`` zero is accepted too, for the constants whose value
    0 is meaningful (the attention denominator guard, which has its own
    tiny floor; the ReLU feature floor, where 0 is a plain ReLU).

    Returns it as a `float`.

    Raises:
        ValueError: "`name` must be a finite positive number. Received: ..."
            (or "a finite non-negative number" with ``allow_zero=True``).
    """
    if allow_zero:
        return check_non_negative_float(name, value)
    return check_positive_float(name, value)


def check_positive_float(name, value, allow_none=False):
    """Checks a finite number > 0 (a scale, a temperature); returns a `float`.

    With ``allow_none=True``, None is accepted and returned.

    Raises:
        ValueError: "`name` must be a finite positive number. Received: ..."
    """
    if value is None and allow_none:
        return None
    if not _is_real(value) or not math.isfinite(value) or not value > 0:
        _refuse(name, "a finite positive number" + (" or None" if allow_none else ""), value)
    return float(value)


def check_non_negative_float(name, value):
    """Checks a finite number >= 0 (a penalty factor); returns a `float`.

    Raises:
        ValueError: "`name` must be a finite non-negative number. Received: ..."
    """
    if not _is_real(value) or not math.isfinite(value) or not value >= 0:
        _refuse(name, "a finite non-negative number", value)
    return float(value)


def check_bool(name, value):
    """Checks a flag: exactly ``True`` or ``False`` (not 0/1, not None).

    Raises:
        ValueError: "`name` must be a bool. Received: ..."
    """
    if not isinstance(value, bool):
        _refuse(name, "a bool", value)
    return value


def check_one_of(name, value, choices):
    """Checks that `value` is one of `choices` (a tuple of names).

    Raises:
        ValueError: "`name` must be one of (...). Received: ..."
    """
    if isinstance(value, bool) or value not in tuple(choices):
        _refuse(name, f"one of {tuple(choices)}", value)
    return value


def check_dtype_name(name, value, allowed=None):
    """Checks a dtype given by name (``"float32"``, ``"int64"`` ...).

    Accepts what `keras.backend.standardize_dtype` understands (strings,
    NumPy dtypes) and returns the standardized name; with `allowed`, the
    standardized name must be one of them.

    Raises:
        ValueError: "`name` must be a dtype name (...). Received: ..."
    """
    import keras

    expected = "a dtype name" if allowed is None else f"a dtype name in {tuple(allowed)}"
    if value is None or isinstance(value, bool):
        _refuse(name, expected, value)
    try:
        standard = keras.backend.standardize_dtype(value)
    except (ValueError, TypeError, AttributeError):
        _refuse(name, expected, value)
    if allowed is not None and standard not in tuple(allowed):
        _refuse(name, expected, value)
    return standard


def check_rank(name, x, rank):
    """Checks that tensor `x` has rank `rank` (one int, or a tuple of ints).

    Raises:
        ValueError: "`name` must have rank R. Received: name.shape=(...)"
    """
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if len(x.shape) not in ranks:
        expected = str(ranks[0]) if len(ranks) == 1 else " or ".join(map(str, ranks))
        raise ValueError(f"`{name}` must have rank {expected}. Received: {name}.shape={tuple(x.shape)}")


def check_same_batch(names_and_tensors):
    """Checks that tensors of one call have the same (static) batch size.

    `names_and_tensors` is a sequence of ``(name, tensor)``; unknown batch
    dims are skipped. A batch of 1 is not broadcast against a larger one
    (as in `keras.layers.MultiHeadAttention`, which raises too).

    Raises:
        ValueError: "... must have the same batch size. Received: query.shape=..., value.shape=..."
    """
    # A symbolic dim (JAX's shape polymorphism while Keras infers output specs) is unknown too.
    known = [
        (name, x) for name, x in names_and_tensors if x is not None and len(x.shape) and isinstance(x.shape[0], int)
    ]
    if len({x.shape[0] for _, x in known}) > 1:
        received = ", ".join(f"{name}.shape={tuple(x.shape)}" for name, x in known)
        names = ", ".join(f"`{name}`" for name, _ in known)
        raise ValueError(f"{names} must have the same batch size. Received: {received}")


def refuse_attention_scores(value):
    """`return_attention_scores` of `keras.layers.MultiHeadAttention`: False is accepted.

    Linear attention never forms the T x S score matrix, so True is refused.

    Raises:
        ValueError: "`return_attention_scores=True` is not supported ... Received: return_attention_scores=True"
    """
    if value is False or value is None:
        return
    raise ValueError(
        "`return_attention_scores=True` is not supported: linear attention never forms the T x S "
        "attention matrix (`keras_linattn.ops.kernel_attention_weights` computes it for inspection). "
        f"Received: return_attention_scores={value!r}"
    )


def graph_assert(x, condition, message):
    """`x`, made to depend on a run-time check of `condition` in TensorFlow graphs.

    Eagerly (the caller checks concrete values in Python) and on other
    backends, `x` is returned unchanged. In a TensorFlow graph, ops that use
    the returned tensor run after ``tf.debugging.Assert(condition)``, which
    raises ``InvalidArgumentError`` with `message`. XLA (``jit_compile=True``)
    and the ONNX conversion drop the assertion.

    Args:
        x: the tensor the checked computation reads.
        condition: a scalar boolean tensor, True when the rule holds.
        message: the error message (name the argument).
    """
    import keras

    if keras.backend.backend() != "tensorflow":
        return x
    import tensorflow as tf

    if tf.executing_eagerly():
        return x
    check = tf.debugging.Assert(condition, [message])
    with tf.control_dependencies([check]):
        return tf.identity(x)


# Integer dtypes with values an int32 does not hold: a cast to int32 would wrap them.
_WIDE_INTS = ("int64", "uint32", "uint64")


def check_wide_ids(token_ids, name, vocabulary_size, concrete):
    """Wide integer token ids (int64, uint32, uint64) as int32, their range checked before the cast.

    A model's id input is int32, and a cast of wider ids (int64, uint32,
    uint64) keeps the low bits: ``2**32 + 3`` became 3, a valid id, and an
    error reported the wrapped value. Narrow ids are returned unchanged (the
    model's own range check sees their true values), and so is anything
    that is not an integer array (the caller's form checks name it). Wide
    ids are checked in their own dtype, before any conversion (a NumPy
    array too: JAX's conversion would wrap it):

    - concrete ids (`concrete` True) outside ``[0, vocabulary_size)`` raise;
    - in a TensorFlow graph, a run-time assertion prints the smallest and
      largest id received; where assertions are dropped (XLA), an id
      outside the range becomes -1, an id the model marks invalid (NaN
      outputs), never another valid id.

    Args:
        token_ids: an integer tensor.
        name: the argument's name, for the message.
        vocabulary_size: V; valid ids are ``[0, V)``.
        concrete: whether `token_ids` holds values (eager), not a traced tensor.

    Returns:
        Wide ids as int32; anything else unchanged.

    Raises:
        ValueError: "`name` must be in [0, V). Received: min=..., max=... (name.dtype=int64)".
    """
    import keras
    from keras import ops

    if not hasattr(token_ids, "dtype"):
        return token_ids
    dtype = keras.backend.standardize_dtype(token_ids.dtype)
    if dtype not in _WIDE_INTS:
        return token_ids
    if concrete:
        values = ops.convert_to_numpy(token_ids)
        if values.size:
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= vocabulary_size:
                received = f"min={low}, max={high} ({name}.dtype={dtype})"
                raise ValueError(f"`{name}` must be in [0, {vocabulary_size}). Received: {received}")
        return ops.cast(token_ids, "int32")
    ok = ops.logical_and(token_ids >= 0, token_ids < vocabulary_size)  # the ids' shape, compared in their dtype
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            # The values as the assertion's data: a formatted string would not compile under XLA.
            message = f"`{name}` must be in [0, {vocabulary_size}) ({name}.dtype={dtype}). Received: min, max ="
            data = [message, tf.reduce_min(token_ids), tf.reduce_max(token_ids)]
            with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(ok), data)]):
                token_ids = tf.identity(token_ids)
    return ops.cast(ops.where(ok, token_ids, -1), "int32")
