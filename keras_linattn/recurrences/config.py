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
from keras_linattn.ops.rotary import _check_rope_arguments
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
# Arguments for pretrained softmax models (rotary positions, grouped-query
# attention, the window's softmax weight): None / 1.0 leave round-2 layers unchanged.
PRETRAINED_ARGUMENTS = ("num_key_value_heads", "rope_max_wavelength", "rope_scaling_factor")
ARGUMENTS = ("recurrence", "conv_size") + ROUND2_ARGUMENTS + ("window_gamma",) + PRETRAINED_ARGUMENTS

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
            delta rule are causal. Keyword-only.
        window_gamma: None (default) or a number in (0, 1), with
            `window_size` only: the window's softmax terms are weighted by a
            learned per-head ``gamma = sigmoid(g)`` (g initialized so that
            gamma starts at `window_gamma`; LoLCATs uses 0.1) and the linear
            terms by 1, under the one shared normalizer. With a window at
            least as long as the sequence the gamma cancels (exact softmax
            attention). With `recurrence`, pass ``gamma=`` in the window
            recurrence's config instead. Keyword-only.
        num_key_value_heads: None (default: `num_heads`) or a divisor of
            `num_heads` (grouped-query attention, as in Llama): the key and
            value projections have that many heads (kernels
            ``[dim, kv_heads, D]``), each shared by ``num_heads /
            num_key_value_heads`` consecutive query heads. The state keeps
            `num_heads` heads. Keyword-only.
        rope_max_wavelength: None (default: no rotary embedding) or the base
            of rotary position embeddings (10000 in Llama 2, 500000 in
            Llama 3), applied to the queries and keys after the short
            convolution and before the feature map (and the window's
            softmax), in keras-hub's rotate-half layout. Positions count the
            real tokens before a token (padded tokens take no position, so a
            left-padded sequence gets the positions of the unpadded one);
            the decode state carries the count (``position [B]``, float32).
            Non-causal attention numbers queries and keys by their index.
            Needs an even `key_dim`. Keyword-only.
        rope_scaling_factor: positive number, default 1.0: positions are
            divided by it (keras-hub's linear RoPE scaling). Keyword-only."""


def _round2_recurrence(decay, normalize, window_size, update, window_gamma=None):
    """The built-in recurrence the round-2 arguments describe, with round 2's checks and messages."""
    if window_gamma is not None and window_size is None:
        raise ValueError(
            "`window_gamma` weights the softmax window's terms: it needs `window_size`. "
            f"Received: window_gamma={window_gamma!r}, window_size=None"
        )
    if window_gamma is not None and (not _validation._is_real(window_gamma) or not 0.0 < window_gamma < 1.0):
        raise ValueError(
            "`window_gamma` (the initial weight of the window's softmax terms, a sigmoid) must be None or a "
            f"number in (0, 1). Received: window_gamma={window_gamma!r}"
        )
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
        return WindowRecurrence(window_size, gamma=window_gamma)
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

    def __init__(
        self,
        recurrence,
        conv_size=None,
        feature_map="elu",
        causal=True,
        *,
        num_key_value_heads=None,
        rope_max_wavelength=None,
        rope_scaling_factor=1.0,
    ):
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
        self.num_key_value_heads = _validation.check_optional_positive_int("num_key_value_heads", num_key_value_heads)
        self.rope_max_wavelength, self.rope_scaling_factor = _check_rope_arguments(
            rope_max_wavelength, rope_scaling_factor
        )

    def check_heads(self, num_heads, key_dim=None):
        """Raises ValueError unless `num_key_value_heads` divides `num_heads` and RoPE gets an even `key_dim`."""
        kv = self.num_key_value_heads
        if kv is not None and num_heads % kv:
            raise ValueError(
                "`num_key_value_heads` must divide `num_heads` (each key/value head serves a group of "
                f"query heads). Received: num_key_value_heads={kv}, num_heads={num_heads}"
            )
        if self.rope_max_wavelength is not None and key_dim is not None and key_dim % 2:
            raise ValueError(
                "Rotary position embeddings (`rope_max_wavelength`) need an even `key_dim` (each head "
                f"vector is rotated in halves). Received: key_dim={key_dim}, "
                f"rope_max_wavelength={self.rope_max_wavelength!r}"
            )

    @classmethod
    def pop(cls, kwargs, feature_map="elu", causal=True):
        """Removes the mechanism arguments (`ARGUMENTS`) from `kwargs` and validates them into a config."""
        given = {name: kwargs.pop(name) for name in ARGUMENTS if name in kwargs}
        round2 = {name: given[name] for name in ROUND2_ARGUMENTS + ("window_gamma",) if name in given}
        if round2.get("window_gamma", 0) is None:
            del round2["window_gamma"]  # the default, e.g. from a config
        recurrence = given.get("recurrence")
        if recurrence is None:
            defaults = {"decay": None, "normalize": True, "window_size": None, "update": "add", "window_gamma": None}
            recurrence = _round2_recurrence(**{**defaults, **round2})
        elif round2:
            raise ValueError(
                "Pass either `recurrence` or the round-2 arguments (decay, normalize, window_size, update, "
                "window_gamma), "
                f"not both. Received: recurrence={recurrence!r}, " + ", ".join(f"{k}={v!r}" for k, v in round2.items())
            )
        else:
            recurrence = registry.get(recurrence).copy()
        pretrained = {name: given[name] for name in PRETRAINED_ARGUMENTS if name in given}
        return cls(recurrence, given.get("conv_size"), feature_map=feature_map, causal=causal, **pretrained)

    def make_recurrence(self):
        """A fresh copy of the recurrence, for one attention layer."""
        return self.recurrence.copy()

    def get_config(self):
        """``{"recurrence": <serialized>, "conv_size": K, ...}``: the arguments that rebuild this config."""
        return {
            "recurrence": registry.serialize(self.recurrence),
            "conv_size": self.conv_size,
            "num_key_value_heads": self.num_key_value_heads,
            "rope_max_wavelength": self.rope_max_wavelength,
            "rope_scaling_factor": self.rope_scaling_factor,
        }
