"""Token samplers for `LinearCausalLM.generate`.

A sampler turns next-token logits ``[B, V]`` into token ids ``[B]``. As in
keras-hub, a sampler is an object with a `temperature`, looked up by name
with `get`, serializable with `serialize` / `deserialize`; here it is simply
called with the logits::

    sampler = keras_linattn.samplers.get("top_k", k=10, temperature=0.7)
    next_ids = sampler(logits, seed=seed)   # [B] int32

Samplers are pure functions of ``(logits, seed)``: a ``seed`` is a ``[2]``
int32 tensor (a stateless-random seed), so sampling inside an XLA-compiled
decoding loop is deterministic for a given seed and needs no random state.
(TensorFlow's stateless generators draw different numbers under XLA and in
eager mode, so the same seed gives the same tokens within one of the two.)
Random samplers draw with the Gumbel-max trick:
``argmax(logits / temperature + Gumbel noise)`` over the allowed tokens is a
sample of ``softmax(logits / temperature)`` restricted to them.

Names (`available()`): ``greedy``, ``random`` (temperature sampling),
``top_k``, ``top_p``.
"""

import keras
import tensorflow as tf
from keras import ops

from keras_linattn._registry import NameRegistry

def _check_positive_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"`{name}` must be a positive finite number. Received: {name}={value!r}")


class Sampler:
    """Base class: next-token logits ``[B, V]`` -> token ids ``[B]`` (int32).

    Subclasses implement ``get_next_token(logits, seed)`` on logits already
    divided by the temperature (computed in float32).

    Args:
        temperature: logits are divided by it before sampling; < 1 sharpens,
            > 1 flattens the distribution. Greedy decoding ignores it.

    Call arguments:
        logits: ``[B, V]`` next-token logits.
        seed: ``[2]`` int32 stateless seed; required by random samplers.

    Returns:
        ``[B]`` int32 token ids.
    """

    is_random = True

    def __init__(self, temperature=1.0):
        _check_positive_number("temperature", temperature)
        self.temperature = float(temperature)

    def __call__(self, logits, seed=None):
        if len(logits.shape) != 2:
            raise ValueError(
                f"`logits` must have shape [batch, vocabulary]. Received: logits.shape={tuple(logits.shape)}"
            )
        if self.is_random and seed is None:
            raise ValueError(
                f"{type(self).__name__} draws random tokens and needs a `seed` ([2] int32). "
                "Received: seed=None"
            )
        logits = ops.cast(logits, "float32") / self.temperature  # [B, V]
        return ops.cast(self.get_next_token(logits, seed), "int32")  # [B]

    def get_next_token(self, logits, seed):
        raise TypeError(f"{type(self).__name__} must define get_next_token(logits, seed).")

    def get_config(self):
        return {"temperature": self.temperature}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


def _gumbel_argmax(logits, seed):
    """A sample of softmax(logits) per row; -inf logits are never drawn."""
    uniform = tf.random.stateless_uniform(
        ops.shape(logits), seed=seed, minval=1e-20, maxval=1.0, dtype="float32"
    )  # [B, V]
    gumbel = -ops.log(-ops.log(uniform))  # [B, V]
    return ops.argmax(logits + gumbel, axis=-1)  # [B]



_REGISTRY = NameRegistry("sampler", "sampler", Sampler)
_register = _REGISTRY.register

@_register("greedy")
class GreedySampler(Sampler):
    """Picks the most likely token (argmax); deterministic, ignores `seed`.

    Example:

    >>> GreedySampler()(np.array([[0.1, 2.0, -1.0]])).numpy()
    array([1], dtype=int32)
    """

    is_random = False

    def __init__(self, **kwargs):
        kwargs.setdefault("temperature", 1.0)
        super().__init__(**kwargs)

    def get_next_token(self, logits, seed):
        return ops.argmax(logits, axis=-1)  # [B]


@_register("random")
class RandomSampler(Sampler):
    """Samples from ``softmax(logits / temperature)`` over the whole vocabulary.

    Example:

    >>> RandomSampler(temperature=0.7)(logits, seed=tf.constant([1, 2]))
    """

    def get_next_token(self, logits, seed):
        return _gumbel_argmax(logits, seed)


@_register("top_k")
class TopKSampler(Sampler):
    """Samples among the `k` most likely tokens (renormalized).

    Args:
        k: number of candidate tokens (clipped to the vocabulary size).
        temperature: see `Sampler`.

    Example:

    >>> TopKSampler(k=5)(logits, seed=tf.constant([1, 2]))
    """

    def __init__(self, k=5, temperature=1.0):
        super().__init__(temperature=temperature)
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"`k` must be a positive integer. Received: k={k!r}")
        self.k = k

    def get_next_token(self, logits, seed):
        k = min(self.k, logits.shape[-1]) if logits.shape[-1] is not None else self.k
        top_logits, _ = ops.top_k(logits, k=k)  # [B, k]
        threshold = top_logits[:, -1:]  # [B, 1]
        masked = ops.where(logits >= threshold, logits, -float("inf"))  # [B, V]
        return _gumbel_argmax(masked, seed)

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

    >>> TopPSampler(p=0.9)(logits, seed=tf.constant([1, 2]))
    """

    def __init__(self, p=0.9, k=None, temperature=1.0):
        super().__init__(temperature=temperature)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"`p` must be in (0, 1]. Received: p={p!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
            raise ValueError(f"`k` must be a positive integer or None. Received: k={k!r}")
        self.p = float(p)
        self.k = k

    def get_next_token(self, logits, seed):
        vocab = logits.shape[-1]
        k = vocab if self.k is None else min(self.k, vocab)
        sorted_logits, _ = ops.top_k(logits, k=k)  # [B, k], descending
        probs = ops.softmax(sorted_logits, axis=-1)  # [B, k]
        cumulative = ops.cumsum(probs, axis=-1)  # [B, k]
        # Keep a token if the mass before it is < p: the first token always stays.
        keep = (cumulative - probs) < self.p  # [B, k]
        threshold = ops.min(ops.where(keep, sorted_logits, float("inf")), axis=-1, keepdims=True)  # [B, 1]
        masked = ops.where(logits >= threshold, logits, -float("inf"))  # [B, V]
        return _gumbel_argmax(masked, seed)

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
