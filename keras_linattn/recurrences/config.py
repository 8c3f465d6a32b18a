"""The attention config: a recurrence and a short-convolution size, validated once.

`LinearAttention`, the transformer blocks and `LinearCausalLM` take the same
mechanism arguments. They are read here, once, into an `AttentionConfig`
that the LM hands to its blocks and the blocks to their attention layers.

Two spellings are accepted:

- ``recurrence=`` a registered name, a serialized config or a `Recurrence`
  instance (``keras_linattn.recurrences.available()``), with ``conv_size``;
- the round-2 arguments ``decay``, ``normalize``, ``window_size`` and
  ``update`` (with ``conv_size``), translated to a built-in recurrence by
  `_round2_recurrence`. Old `.keras` configs use them and still load.
"""

from keras_linattn import _validation
from keras_linattn.recurrences import registry
from keras_linattn.recurrences.additive import AdditiveRecurrence
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.decay import DecayRecurrence
from keras_linattn.recurrences.delta import DeltaRecurrence
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = ["AttentionConfig"]

DECAYS = (None, "fixed", "scalar", "channel")
UPDATES = ("add", "delta")
ROUND2_ARGUMENTS = ("decay", "normalize", "window_size", "update")
ARGUMENTS = ("recurrence", "conv_size") + ROUND2_ARGUMENTS

# The mechanism arguments of `LinearAttention`, the blocks and the LM,
# documented once (see `keras_linattn._docstrings.fill`).
MECHANISM_ARGS_DOC = """\
        recurrence: the state update and readout: a registered name
            (`keras_linattn.recurrences.available()`: ``"additive"``,
            ``"decay"``, ``"delta"``, ``"window"``), a serialized config or
            a `Recurrence` instance (used as a template: each attention
            layer owns a copy). Default: the additive recurrence, or the
            one the round-2 arguments below describe. Keyword-only.
        conv_size: None (default) or an int K >= 2: a causal depthwise
            convolution of size K over time on the projected q, k and v,
            before the feature map (Based, "short convolution"). Padded
            positions enter it as zeros. Its last ``K - 1`` inputs are part
            of the decode state. Keyword-only.
        decay, normalize, window_size, update: the round-2 spelling of the
            recurrence (not with `recurrence`). `decay`: None, ``"fixed"``
            (RetNet), ``"scalar"`` (Mamba2) or ``"channel"`` (GLA) gates,
            `keras_linattn.recurrences.DecayRecurrence`. `normalize`: True
            (default) divides by ``phi(q) . z``; False puts an RMSNorm on
            each head's output instead. `window_size`: softmax over the last
            W tokens plus linear attention over older ones
            (`WindowRecurrence`; not with `decay` or ``normalize=False``).
            `update`: ``"add"`` (default) or ``"delta"`` (DeltaNet,
            `DeltaRecurrence`; needs ``normalize=False``, gates ``"fixed"``
            or ``"scalar"`` only, no window). `decay`, `window_size` and the
            delta rule are causal. Keyword-only."""


def _round2_recurrence(decay, normalize, window_size, update):
    """The built-in recurrence the round-2 arguments describe, with round 2's checks and messages."""
    decay = _validation.check_one_of("decay", decay, DECAYS)
    normalize = _validation.check_bool("normalize", normalize)
    window_size = _validation.check_optional_positive_int("window_size", window_size)
    if window_size is not None and decay is not None:
        raise ValueError(
            "`window_size` cannot be combined with `decay`: the window's linear part holds the keys "
            f"older than the window undecayed. Received: window_size={window_size!r}, decay={decay!r}"
        )
    if window_size is not None and not normalize:
        raise ValueError(
            "`window_size` needs `normalize=True`: the softmax window and the linear part share one "
            f"normalizer. Received: window_size={window_size!r}, normalize={normalize!r}"
        )
    update = _validation.check_one_of("update", update, UPDATES)
    if update == "delta":
        if normalize:
            raise ValueError(
                "`update='delta'` has no normalizer (its state is not a sum of positive weights): pass "
                "`normalize=False`, which puts an RMSNorm on each head's output. "
                f"Received: update={update!r}, normalize={normalize!r}"
            )
        if window_size is not None or decay == "channel":
            raise ValueError(
                "`update='delta'` takes `decay=None`, 'fixed' or 'scalar' (one gate per head: Gated "
                f"DeltaNet) and no window. Received: decay={decay!r}, window_size={window_size!r}"
            )
        return DeltaRecurrence(gate=decay)
    if window_size is not None:
        return WindowRecurrence(window_size)
    if decay is not None:
        return DecayRecurrence(gate=decay, normalize=normalize)
    return AdditiveRecurrence(normalize=normalize)


class AttentionConfig:
    """A recurrence and a short-convolution size, validated once.

    Args:
        recurrence: a `Recurrence` (a template: `make_recurrence` gives each
            attention layer its own copy).
        conv_size: None or an int K >= 2.
        feature_map: the feature map the attention will use (None is the
            identity), for the recurrence's check.
        causal: whether the attention is causal, for the recurrence's check.
    """

    def __init__(self, recurrence, conv_size=None, feature_map="elu", causal=True):
        if not isinstance(recurrence, Recurrence):
            raise ValueError(f"`recurrence` must be a Recurrence. Received: recurrence={recurrence!r}")
        conv_size = _validation.check_optional_positive_int("conv_size", conv_size)
        if conv_size is not None and conv_size < 2:
            raise ValueError(
                "`conv_size` must be None or an integer >= 2 (a size-1 convolution is a per-channel "
                f"scale, which the projections already have). Received: conv_size={conv_size!r}"
            )
        recurrence.check(feature_map, causal=causal)
        self.recurrence = recurrence
        self.conv_size = conv_size

    @classmethod
    def pop(cls, kwargs, feature_map="elu", causal=True):
        """Removes the mechanism arguments (`ARGUMENTS`) from `kwargs` and validates them into a config."""
        given = {name: kwargs.pop(name) for name in ARGUMENTS if name in kwargs}
        round2 = {name: given[name] for name in ROUND2_ARGUMENTS if name in given}
        recurrence = given.get("recurrence")
        if recurrence is None:
            defaults = {"decay": None, "normalize": True, "window_size": None, "update": "add"}
            recurrence = _round2_recurrence(**{**defaults, **round2})
        elif round2:
            raise ValueError(
                "Pass either `recurrence` or the round-2 arguments (decay, normalize, window_size, update), "
                f"not both. Received: recurrence={recurrence!r}, " + ", ".join(f"{k}={v!r}" for k, v in round2.items())
            )
        else:
            recurrence = registry.get(recurrence).copy()
        return cls(recurrence, given.get("conv_size"), feature_map=feature_map, causal=causal)

    def make_recurrence(self):
        """A fresh copy of the recurrence, for one attention layer."""
        return self.recurrence.copy()

    def get_config(self):
        """``{"recurrence": <serialized>, "conv_size": K}``: the arguments that rebuild this config."""
        return {"recurrence": registry.serialize(self.recurrence), "conv_size": self.conv_size}
