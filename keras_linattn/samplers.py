"""Token samplers for `LinearCausalLM.generate`.

A sampler turns next-token logits ``[B, V]`` into token ids ``[B]``. As in
keras-hub, a sampler is an object with a `temperature`, looked up by name
with `get`, serializable with `serialize` / `deserialize`; here it is simply
called with the logits::

    sampler = keras_linattn.samplers.get("top_k", k=10, temperature=0.7)
    next_ids = sampler(logits, seed=seed)   # [B] int32

Samplers are pure functions of ``(logits, seed)``: a ``seed`` is a ``[2]``
int32 tensor (the user's seed and the position of the token being drawn),
so sampling inside a compiled decoding loop is deterministic and needs no
random state. The random numbers come from a counter-based integer hash
(`uniform_noise`) written in `keras.ops`: TensorFlow (eager, graph, XLA),
JAX, a SavedModel and an ONNX graph draw exactly the same numbers for the
same seed, so they pick the same tokens for the same logits. Random
samplers draw with the Gumbel-max trick:
``argmax(logits / temperature + Gumbel noise)`` over the allowed tokens is a
sample of ``softmax(logits / temperature)`` restricted to them.

Every built-in sampler is one call of `sample` (temperature, top-k, top-p),
the kernel that the exported ``generate_sampled`` signatures run too.

Non-finite logits: a row whose logits hold a NaN or a +inf, or whose
logits are all -inf, has no distribution to draw from (the model produced
NaN/inf). Every sampler returns the sentinel `INVALID_TOKEN` (-1) for such a
row (`nonfinite_rows`), never a token id; -inf logits beside finite ones are
normal (filtered or masked tokens) and are never drawn.

Settings: one rule table (`keras_linattn._sampler_settings`, docs/decoding.md
"Sampler settings") for every front end. A temperature below float32's
smallest normal number ``2^-126`` (0 included) decodes greedily; NaN, +-inf,
negative temperatures, a negative `top_k`, and a `top_p` outside
``[2^-126, 1]`` are refused: `ValueError` for Python settings,
`INVALID_TOKEN` rows from `sample` for tensor settings (`settings_rules`).

Names (`available()`): ``greedy``, ``random`` (temperature sampling),
``top_k``, ``top_p``.
"""

import numpy as np

from keras_linattn import _lazy, _validation
from keras_linattn import _sampler_settings as rules
from keras_linattn._registry import NameRegistry

# Loaded on first use: the exported graphs' sampler arguments are read without Keras (keras_linattn.serving).
keras = _lazy.module("keras")
ops = _lazy.module("keras.ops")

__all__ = [
    "INVALID_TOKEN",
    "GreedySampler",
    "RandomSampler",
    "Sampler",
    "TopKSampler",
    "TopPSampler",
    "argmax",
    "available",
    "deserialize",
    "get",
    "gumbel_noise",
    "nonfinite_rows",
    "sample",
    "scale_logits",
    "serialize",
    "settings_rules",
    "uniform_from_bits",
    "uniform_noise",
]

# What a sampler returns for a row whose logits are not finite (`nonfinite_rows`):
# never a token id.
INVALID_TOKEN = -1


class Sampler:
    """Base class: next-token logits ``[B, V]`` -> token ids ``[B]`` (int32).

    Subclasses implement ``get_next_token(logits, seed)`` on logits already
    divided by the temperature (computed in float32, and shifted by the
    row's maximum first, which changes no softmax: `scale_logits`).

    Args:
        temperature: logits are divided by it before sampling; < 1 sharpens,
            > 1 flattens the distribution. A float32 number >= 0; below
            ``2^-126`` (0 included) every sampler decodes greedily (the
            rule table of docs/decoding.md, "Sampler settings"). Greedy
            decoding ignores it.

    Call arguments:
        logits: ``[B, V]`` next-token logits.
        seed: ``[2]`` int32 stateless seed; required by random samplers.

    Returns:
        ``[B]`` int32 token ids; `INVALID_TOKEN` (-1) for a row whose logits
        are not finite (`nonfinite_rows`), whatever the subclass draws.

    Raises:
        ValueError: for a temperature the rule table refuses (NaN, +-inf,
            negative), naming the value received.
    """

    is_random = True
    # GreedySampler: argmax of the logits as given, whatever the temperature.
    _greedy = False

    def __init__(self, temperature=1.0):
        self.temperature = rules.check_temperature(temperature)

    def __call__(self, logits, seed=None):
        if len(logits.shape) != 2:
            raise ValueError(
                f"`logits` must have shape [batch, vocabulary]. Received: logits.shape={tuple(logits.shape)}"
            )
        if self.is_random and seed is None:
            raise ValueError(
                f"{type(self).__name__} draws random tokens and needs a `seed` ([2] int32). Received: seed=None"
            )
        logits = ops.cast(logits, "float32")  # [B, V]
        bad = nonfinite_rows(logits)  # [B]
        if self._greedy or rules.is_greedy_temperature(self.temperature):
            ids = argmax(logits)  # [B]: the rule table's greedy temperatures, in every sampler
        else:
            ids = ops.cast(self.get_next_token(scale_logits(logits, self.temperature), seed), "int32")  # [B]
        return ops.where(bad, INVALID_TOKEN, ids)

    def get_next_token(self, logits, seed):
        raise TypeError(f"{type(self).__name__} must define get_next_token(logits, seed).")

    def sampling_params(self):
        """``(temperature, top_k, top_p)`` of `sample` for this sampler, or None.

        The exported ``generate_sampled`` signatures take these three values;
        a custom sampler that is not one call of `sample` returns None (it
        runs in Keras' `generate` only).
        """
        return None

    def get_config(self):
        return {"temperature": self.temperature}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


# lowbias32 (a 32-bit integer finalizer), written with int32 arithmetic that
# wraps on overflow; a logical right shift is an arithmetic one masked to the
# low bits, which every backend and ONNX compute alike.
_MIX_1 = 0x7FEB352D
_MIX_2 = 0x846CA68B - 2**32  # as int32
_GOLDEN = 0x9E3779B9 - 2**32  # as int32


def _as_int32(value):
    return ops.convert_to_tensor(np.int32(value))


def _mix(x):
    """lowbias32 finalizer on int32 tensors (wrapping arithmetic)."""
    x = ops.bitwise_xor(x, ops.bitwise_and(ops.right_shift(x, 16), 0xFFFF))
    x = ops.multiply(x, _as_int32(_MIX_1))
    x = ops.bitwise_xor(x, ops.bitwise_and(ops.right_shift(x, 15), 0x1FFFF))
    x = ops.multiply(x, _as_int32(_MIX_2))
    x = ops.bitwise_xor(x, ops.bitwise_and(ops.right_shift(x, 16), 0xFFFF))
    return x


UNIFORM_BITS = 23  # random bits per uniform number


def uniform_from_bits(bits):
    """Maps ``UNIFORM_BITS``-bit integers ``m`` in ``[0, 2^23)`` to ``(2 m + 1) / 2^24`` (float32).

    Every value is exact in float32 (``2 m + 1 < 2^24``), centred in its bin
    of width ``2^-23`` and in ``[2^-24, 1 - 2^-24]``: never 0 and never 1,
    so the Gumbel noise ``-log(-log(u))`` is finite (`gumbel_noise`).
    (24 bits as ``(m + 0.5) / 2^24`` would need 25 bits of mantissa: it
    rounds to exactly 1.0 at ``m = 2^24 - 1``.)
    """
    return ops.cast(ops.add(ops.multiply(bits, 2), 1), "float32") * (2.0**-24)


def _hash_bits(seed, shape):
    """32 random bits (int32) per entry of a ``[B, V]`` shape: a hash of (seed[0], seed[1], row, column)."""
    seed = ops.cast(seed, "int32")
    rows, cols = shape[0], shape[1]
    counter = ops.add(
        ops.multiply(ops.arange(rows, dtype="int32")[:, None], ops.cast(cols, "int32")),
        ops.arange(cols, dtype="int32")[None, :],
    )  # [B, V]
    key = _mix(ops.bitwise_xor(seed[0], _mix(ops.add(ops.multiply(seed[1], _as_int32(_GOLDEN)), 1))))  # []
    return _mix(ops.bitwise_xor(_mix(counter), key))  # [B, V]


def uniform_noise(seed, shape):
    """Uniform numbers in (0, 1) for a ``[2]`` int32 `seed` and a ``[B, V]`` shape.

    A counter-based hash of (seed[0], seed[1], row, column): the same numbers
    on every backend, in XLA, in an exported SavedModel and in ONNX. The top
    23 bits of the hash become ``(2 m + 1) / 2^24`` (`uniform_from_bits`):
    exact float32 values in ``[2^-24, 1 - 2^-24]``, centred in their bins.
    """
    shift = 32 - UNIFORM_BITS
    bits = ops.right_shift(_hash_bits(seed, shape), shift)  # [B, V], arithmetic shift
    return uniform_from_bits(ops.bitwise_and(bits, 2**UNIFORM_BITS - 1))  # [B, V]


# The smallest exponential variate -log(u) for u <= 1 - 2^-24 is ~2^-24; the
# floor below it changes nothing where `log` is correctly rounded and keeps
# the Gumbel noise finite where a backend's `log` rounds log(1 - 2^-24) to 0.
_MIN_EXPONENTIAL = 2.0**-25


def gumbel_noise(uniform):
    """``-log(-log(u))`` for `uniform_noise` values: finite, in about [-2.82, 17.33]."""
    exponential = ops.maximum(-ops.log(uniform), _MIN_EXPONENTIAL)  # [B, V], > 0
    return -ops.log(exponential)


def nonfinite_rows(logits):
    """``[B, V] -> [B]`` bool: rows that hold a NaN or a +inf logit, or whose logits are all -inf.

    Such a row has no distribution to sample (softmax is NaN or undefined):
    the model produced NaN/inf. A row with some -inf logits beside finite
    ones is normal (masked or filtered tokens) and is not flagged.
    """
    logits = ops.cast(logits, "float32")  # [B, V]
    inf = float("inf")
    top = ops.max(ops.where(ops.isnan(logits), inf, logits), axis=-1)  # [B]: +inf if any NaN or +inf
    return ops.logical_not(ops.logical_and(top < inf, top > -inf))  # [B]


def argmax(x):
    """First index of the largest value on the last axis, ``[B, V] -> [B]`` int32.

    Written as a max and a min so that it lowers to the same plain ops on
    every backend and in ONNX (`keras.ops.argmax` on TensorFlow bit-casts
    floats to handle -0.0, which ONNX cannot express). A row where no value
    compares ``>=`` the maximum (NaN) gives `INVALID_TOKEN`, never ``V``.
    """
    vocab = ops.shape(x)[-1]
    top = ops.max(x, axis=-1, keepdims=True)  # [B, 1]
    columns = ops.arange(vocab, dtype="int32")[None, :]  # [1, V]
    first = ops.min(ops.where(x >= top, columns, vocab), axis=-1)  # [B]; V where nothing matched
    return ops.where(first < vocab, first, INVALID_TOKEN)  # [B]


def _is_static(*values):
    """Whether every value is a Python or NumPy number (not a tensor)."""
    return all(isinstance(v, (int, float, np.number)) for v in values)


def _gumbel_argmax(logits, seed):
    """A sample of softmax(logits) per row; -inf logits are never drawn."""
    gumbel = gumbel_noise(uniform_noise(seed, ops.shape(logits)))  # [B, V], finite
    return argmax(logits + gumbel)  # [B]


def scale_logits(logits, temperature):
    """``(logits - max(logits)) / temperature`` per row, ``[B, V]`` float32.

    The shift changes no softmax and no Gumbel-max draw, and keeps the
    division from overflowing: every value is <= 0, so a tiny temperature
    sends the other tokens to -inf, never the best one to +inf.
    """
    logits = ops.cast(logits, "float32")  # [B, V]
    return (logits - ops.max(logits, axis=-1, keepdims=True)) / temperature


def settings_rules(temperature, top_k, top_p, seed=None):
    """The rule table of sampler settings as graph conditions: a list of ``(ok, message, value)``.

    The graph-side twin of `keras_linattn._sampler_settings` (the Python
    checks), written in `keras.ops`: `sample` with tensor settings and the
    exported ``generate_sampled`` / ONNX generate graphs run it.

    Args:
        temperature: float32 scalar tensor.
        top_k: int32 scalar tensor.
        top_p: float32 scalar tensor.
        seed: optional int64 scalar tensor (the generate seed).

    Returns:
        A list of ``(ok, message, value)``: ``ok`` a scalar bool tensor,
        ``message`` the rule as the Python checks word it, ``value`` the
        setting as received.
    """
    t = ops.cast(temperature, "float32")
    k = ops.cast(top_k, "int32")
    p = ops.cast(top_p, "float32")
    # TensorFlow's kernels flush subnormal inputs to zero: a negative subnormal compares >= 0 there, so the
    # sign comes from 1 / t (-inf for -0.0), which the flush leaves negative.
    signed = ops.logical_or(t > 0, ops.divide(1.0, t) > 0)
    t_ok = ops.logical_and(ops.logical_and(t >= 0, t <= rules.FLOAT32_MAX), signed)
    p_ok = ops.logical_and(p >= rules.FLOAT32_TINY, p <= 1.0)  # NaN fails both
    found = [
        (t_ok, f"`temperature` must be {rules.MESSAGES['temperature']}", t),
        (k >= 0, f"`top_k` must be {rules.MESSAGES['top_k']}", k),
        (p_ok, f"`top_p` must be {rules.MESSAGES['top_p']}", p),
    ]
    if seed is not None:
        found.append((seed >= 0, f"`seed` must be {rules.MESSAGES['seed']}", seed))
    return found


def _check_static_settings(temperature, top_k, top_p):
    """The Python rules for the settings given as numbers (tensors are checked in the graph)."""
    if _is_static(temperature):
        rules.check_temperature(temperature)
    if _is_static(top_k):
        rules.check_top_k(top_k)
    if _is_static(top_p):
        rules.check_top_p(top_p)


def sample(logits, seed, temperature=1.0, top_k=0, top_p=1.0):
    """The sampling kernel: temperature, then top-k, then top-p, then a draw.

    Every argument may be a tensor, so one exported graph serves every
    setting; built-in samplers call this with their own settings. The
    settings follow one rule table (docs/decoding.md, "Sampler settings";
    `keras_linattn._sampler_settings`).

    Args:
        logits: ``[B, V]`` next-token logits.
        seed: ``[2]`` int32 (the user's seed, the position of the token).
        temperature: a float32 number >= 0; logits are divided by it (after
            a shift by their maximum: `scale_logits`). Below ``2^-126``
            (0 included) the draw is greedy (argmax).
        top_k: keep the `top_k` most likely tokens; 0 (or >= V) keeps all.
        top_p: in ``[2^-126, 1]``: then keep the smallest set of most
            likely tokens whose probability (renormalized over the top-k)
            reaches `top_p`; 1 keeps all.

    Returns:
        ``[B]`` int32 token ids in ``[0, V)``, or `INVALID_TOKEN` (-1) for a
        row whose logits hold a NaN or +inf or are all -inf
        (`nonfinite_rows`), greedy or sampled, and for every row when a
        tensor setting breaks the rule table (`settings_rules`).

    Raises:
        ValueError: for a setting given as a Python or NumPy number that the
            rule table refuses (NaN, +-inf or negative `temperature`,
            negative `top_k`, `top_p` outside ``[2^-126, 1]``), naming it.
    """
    _check_static_settings(temperature, top_k, top_p)
    logits = ops.cast(logits, "float32")  # [B, V]
    bad = nonfinite_rows(logits)  # [B]
    valid = None
    if not _is_static(temperature, top_k, top_p):
        valid = ops.all(ops.stack([ok for ok, _, _ in settings_rules(temperature, top_k, top_p)]))  # []
    if _is_static(temperature) and rules.is_greedy_temperature(temperature):
        drawn = argmax(logits)  # [B]
    else:
        drawn = _filtered_draw(logits, seed, temperature, top_k, top_p)  # [B]
    if valid is not None:
        drawn = ops.where(valid, drawn, INVALID_TOKEN)
    return ops.where(bad, INVALID_TOKEN, drawn)


def _filtered_draw(logits, seed, temperature, top_k, top_p):
    """`sample`'s draw for settings that passed their checks: scale, top-k, top-p, Gumbel-max."""
    greedy = None
    if not _is_static(temperature):
        temperature = ops.cast(temperature, "float32")
        # Compared with a normal number: a subnormal temperature decodes greedily in every runtime,
        # whether it flushes subnormals to zero or not.
        sampling = temperature >= rules.FLOAT32_TINY  # []
        greedy = argmax(logits)  # [B]
        temperature = ops.where(sampling, temperature, 1.0)
    logits = scale_logits(logits, temperature)  # [B, V], <= 0
    static_all = (
        isinstance(top_k, (int, np.integer)) and top_k == 0 and isinstance(top_p, (int, float)) and top_p >= 1.0
    )
    if not static_all:
        static_settings = _is_static(top_k, top_p)
        vocab = ops.shape(logits)[-1]
        top_k = ops.cast(top_k, "int32")
        k = ops.where(ops.logical_or(top_k <= 0, top_k > vocab), vocab, top_k)  # []
        top_p = ops.cast(top_p, "float32")
        filters = ops.logical_or(k < vocab, top_p < 1.0)  # []
        if keras.backend.backend() == "tensorflow" and not static_settings:
            # Settings given as tensors (one exported graph serves them all): rank only as many
            # tokens as the settings read -- all of them for top-p, `k` for top-k alone, one
            # where nothing filters -- so that greedy and plain sampling skip the sort over the
            # vocabulary. (Other backends need a static `k`; they rank all tokens.)
            ranked_size = ops.where(top_p < 1.0, vocab, ops.where(k < vocab, k, 1))  # []
            ranked = ops.top_k(logits, ranked_size)[0]  # [B, ranked_size], descending
        else:
            ranked_size = vocab
            ranked = -ops.sort(-logits, axis=-1)  # [B, V], descending
        in_top_k = ops.arange(ranked_size, dtype="int32")[None, :] < k  # [1, ranked_size]
        probs = ops.softmax(ops.where(in_top_k, ranked, -float("inf")), axis=-1)  # [B, ranked_size]
        before = ops.cumsum(probs, axis=-1) - probs  # [B, ranked_size]: mass of the more likely tokens
        keep = ops.logical_and(in_top_k, ops.logical_or(before < top_p, top_p >= 1.0))  # [B, ranked_size]
        threshold = ops.min(ops.where(keep, ranked, float("inf")), axis=-1, keepdims=True)  # [B, 1]
        threshold = ops.where(filters, threshold, -float("inf"))  # [B, 1]: nothing filtered
        logits = ops.where(logits >= threshold, logits, -float("inf"))  # [B, V]
    drawn = ops.cast(_gumbel_argmax(logits, seed), "int32")  # [B]
    if greedy is not None:
        drawn = ops.where(sampling, drawn, greedy)
    return drawn


_REGISTRY = NameRegistry("sampler", "sampler", Sampler)
_register = _REGISTRY.register


@_register("greedy")
class GreedySampler(Sampler):
    """Picks the most likely token (argmax); deterministic, ignores `seed`.

    Example:

    >>> import numpy as np
    >>> np.asarray(GreedySampler()(np.array([[0.1, 2.0, -1.0]], "float32"))).tolist()
    [1]
    """

    is_random = False
    _greedy = True

    def __init__(self, **kwargs):
        kwargs.setdefault("temperature", 1.0)
        super().__init__(**kwargs)

    def get_next_token(self, logits, seed):
        return argmax(logits)  # [B]


@_register("random")
class RandomSampler(Sampler):
    """Samples from ``softmax(logits / temperature)`` over the whole vocabulary.

    Example:

    >>> import numpy as np
    >>> logits = np.array([[0.0, 1.0, 2.0], [2.0, 2.0, -1e9]], "float32")  # [B, V]; token 2 of row 1 is ruled out
    >>> sampler, seed = RandomSampler(temperature=0.7), np.array([1, 2], "int32")
    >>> tokens = np.asarray(sampler(logits, seed=seed))
    >>> again = np.asarray(sampler(logits, seed=seed))
    >>> bool(tokens[1] in (0, 1)), bool(np.array_equal(tokens, again))  # same seed, same draw
    (True, True)
    """

    def get_next_token(self, logits, seed):
        return sample(logits, seed)

    def sampling_params(self):
        return (self.temperature, 0, 1.0)


@_register("top_k")
class TopKSampler(Sampler):
    """Samples among the `k` most likely tokens (renormalized).

    Args:
        k: number of candidate tokens (clipped to the vocabulary size).
        temperature: see `Sampler`.

    Example:

    >>> import numpy as np
    >>> logits = np.array([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 0.0]], "float32")  # [B, V]
    >>> np.asarray(TopKSampler(k=1)(logits, seed=np.array([1, 2], "int32"))).tolist()  # k=1 is greedy
    [1, 0]
    >>> tokens = np.asarray(TopKSampler(k=2)(logits, seed=np.array([1, 2], "int32")))
    >>> bool(tokens[0] in (1, 3))  # one of the two most likely tokens of row 0
    True
    """

    def __init__(self, k=5, temperature=1.0):
        super().__init__(temperature=temperature)
        if rules.check_top_k(k, name="k") == 0:
            _validation.check_positive_int("k", k)  # 0 is `sample`'s "no filter"; a top-k sampler needs a k
        self.k = int(k)

    def get_next_token(self, logits, seed):
        return sample(logits, seed, top_k=self.k)

    def sampling_params(self):
        return (self.temperature, self.k, 1.0)

    def get_config(self):
        return {**super().get_config(), "k": self.k}


@_register("top_p")
class TopPSampler(Sampler):
    """Nucleus sampling: samples among the smallest set of most likely tokens
    whose probabilities sum to at least `p` (renormalized).

    Args:
        p: cumulative probability of the nucleus, in (0, 1].
        k: optional cap on the number of candidates considered.
        temperature: see `Sampler`.

    Example:

    >>> import numpy as np
    >>> logits = np.log(np.array([[0.05, 0.9, 0.05], [0.6, 0.3, 0.1]], "float32"))  # [B, V]
    >>> tokens = np.asarray(TopPSampler(p=0.8)(logits, seed=np.array([1, 2], "int32")))
    >>> int(tokens[0]), bool(tokens[1] in (0, 1))  # nucleus {1} for row 0, {0, 1} for row 1
    (1, True)
    """

    def __init__(self, p=0.9, k=None, temperature=1.0):
        super().__init__(temperature=temperature)
        self.p = rules.check_top_p(p, name="p")
        if k is not None and rules.check_top_k(k, name="k") == 0:
            _validation.check_optional_positive_int("k", k)  # None, not 0, is "no cap"
        self.k = None if k is None else int(k)

    def get_next_token(self, logits, seed):
        return sample(logits, seed, top_k=self.k or 0, top_p=self.p)

    def sampling_params(self):
        return (self.temperature, self.k or 0, self.p)

    def get_config(self):
        return {**super().get_config(), "p": self.p, "k": self.k}


def available():
    """Sorted list of sampler names."""
    return _REGISTRY.available()


def get(identifier, **kwargs):
    """Returns a `Sampler` for a name, a serialized config or an instance.

    Args:
        identifier: ``"greedy"``, ``"random"``, ``"top_k"``, ``"top_p"``, a
            dict from `serialize`, or a `Sampler` (returned as is).
        **kwargs: constructor arguments when `identifier` is a name,
            e.g. ``get("top_k", k=10, temperature=0.8)``.
    """
    return _REGISTRY.get(identifier, kwargs, deserialize)


def serialize(sampler):
    """``{"class_name": ..., "config": ...}`` of a sampler."""
    return {"class_name": type(sampler).__name__, "config": sampler.get_config()}


def deserialize(config):
    """Inverse of `serialize`."""
    by_class = _REGISTRY.by_class_name()
    cls = by_class.get(config.get("class_name")) if isinstance(config, dict) else None
    if cls is None:
        raise ValueError(f"Unknown sampler config. Received: config={config!r}. Known: {sorted(by_class)}")
    return cls.from_config(config.get("config", {}))
