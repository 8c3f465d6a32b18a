"""`AttentionSpec`: everything that defines one linear attention, validated once and passed down unchanged.

The user's arguments (feature map, recurrence, short convolution, rotary
positions, grouped-query heads, chunk size, epsilon) are read into one
immutable `AttentionSpec` where they enter the package: `LinearAttention`,
the transformer blocks, `LinearBackbone` / `LinearCausalLM` and
`keras_linattn.linearize`. The backbone hands its spec to its blocks and the
blocks to their attention layers (``spec=``); nothing below re-reads the
arguments. Each attention layer builds its own feature map and recurrence
from the spec (`make_feature_map`, `make_recurrence`), so no layer shares
weights or state with another.

The recurrence has two spellings, and both are first-class:

- the shorthand arguments ``decay``, ``normalize``, ``window_size``,
  ``update``, ``window_gamma`` and ``cache_size``, which name a built-in
  recurrence (`_shorthand_recurrence`);
- ``recurrence=``: a registered name, a serialized config or a `Recurrence`
  instance (``keras_linattn.recurrences.available()``), for every
  recurrence, built-in or registered by the user.
"""

import copy
import dataclasses

from keras_linattn import _validation
from keras_linattn import feature_maps as feature_maps_lib
from keras_linattn.ops import core as la_ops
from keras_linattn.ops.rotary import _check_frequency_adjustment, _check_rope_arguments
from keras_linattn.recurrences import registry
from keras_linattn.recurrences.additive import AdditiveRecurrence
from keras_linattn.recurrences.decay import DecayRecurrence
from keras_linattn.recurrences.delta import DeltaRecurrence
from keras_linattn.recurrences.sparse_cache import SparseCacheRecurrence
from keras_linattn.recurrences.window import WindowRecurrence

__all__ = ["AttentionSpec"]

DECAYS = (None, "fixed", "scalar", "channel")
UPDATES = ("add", "delta")
SHORTHAND_ARGUMENTS = (
    "decay",
    "normalize",
    "window_size",
    "update",
    "window_gamma",
    "cache_size",
    "linear_weight",
    "linear_rope",
    "linear_mean",
    "cache_distance",
    "cache_max_distance",
)
# Arguments for pretrained softmax models (rotary positions, grouped-query attention).
PRETRAINED_ARGUMENTS = (
    "num_key_value_heads",
    "rope_max_wavelength",
    "rope_scaling_factor",
    "rope_frequency_adjustment",
    "qk_norm_epsilon",
    "rope_rotary_dim",
    "logit_soft_cap",
)
# The keyword arguments `AttentionSpec.pop` takes out of a constructor's kwargs.
ARGUMENTS = ("recurrence", "conv_size") + SHORTHAND_ARGUMENTS + PRETRAINED_ARGUMENTS


def _shorthand_recurrence(
    decay=None,
    normalize=True,
    window_size=None,
    update="add",
    window_gamma=None,
    cache_size=None,
    linear_weight=None,
    linear_rope=None,
    linear_mean=None,
    cache_distance=None,
    cache_max_distance=None,
):
    """The built-in recurrence the shorthand arguments describe.

    ``decay`` -> `DecayRecurrence`, ``window_size`` -> `WindowRecurrence`,
    ``window_size`` and ``cache_size`` -> `SparseCacheRecurrence`,
    ``update="delta"`` -> `DeltaRecurrence`, none of them ->
    `AdditiveRecurrence`. The recurrence validates its own values (e.g. a
    positive `window_size`); this function checks the combinations.
    """
    if cache_size is not None and window_size is None:
        raise ValueError(
            "`cache_size` is the sparse cache beside a softmax window (LoLA): it needs `window_size`. "
            f"Received: cache_size={cache_size!r}, window_size=None"
        )
    for name, value in (("cache_distance", cache_distance), ("cache_max_distance", cache_max_distance)):
        if value is not None and cache_size is None:
            raise ValueError(
                f"`{name}` is an option of the sparse cache: it needs `cache_size` (and `window_size`). "
                f"Received: {name}={value!r}, cache_size=None"
            )
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
    if linear_weight is not None and window_size is None:
        raise ValueError(
            "`linear_weight` weights the linear terms beside a softmax window: it needs `window_size`. "
            f"Received: linear_weight={linear_weight!r}, window_size=None"
        )
    for name, value in (("linear_rope", linear_rope), ("linear_mean", linear_mean)):
        if value is not None and window_size is None:
            raise ValueError(
                f"`{name}` is an option of the softmax window's linear part: it needs `window_size`. "
                f"Received: {name}={value!r}, window_size=None"
            )
    decay = _validation.check_one_of("decay", decay, DECAYS)
    normalize = _validation.check_bool("normalize", normalize)
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
        options = {"linear_rope": linear_rope, "linear_mean": linear_mean}
        options = {name: value for name, value in options.items() if value is not None}
        if cache_size is not None:
            if cache_distance is not None:
                options["cache_distance"] = cache_distance
            if cache_max_distance is not None:
                options["cache_max_distance"] = cache_max_distance
            return SparseCacheRecurrence(
                window_size, cache_size, gamma=window_gamma, linear_weight=linear_weight, **options
            )
        return WindowRecurrence(window_size, gamma=window_gamma, linear_weight=linear_weight, **options)
    if decay is not None:
        return DecayRecurrence(gate=decay, normalize=normalize)
    return AdditiveRecurrence(normalize=normalize)


def _check_adjustment(adjustment, max_wavelength, scaling_factor):
    """`_check_frequency_adjustment`, and its requirements: rotary embeddings on, no linear scaling."""
    adjustment = _check_frequency_adjustment(adjustment)
    if adjustment is not None and (max_wavelength is None or scaling_factor != 1.0):
        raise ValueError(
            "`rope_frequency_adjustment` adjusts rotary frequencies: it needs `rope_max_wavelength` and "
            f"rope_scaling_factor=1. Received: rope_max_wavelength={max_wavelength!r}, "
            f"rope_scaling_factor={scaling_factor!r}, rope_frequency_adjustment={adjustment!r}"
        )
    return adjustment


def _check_soft_cap(logit_soft_cap, recurrence):
    """`logit_soft_cap` as a float (or None); only a recurrence with a softmax window (`caps_logits`) takes one."""
    cap = _validation.check_positive_float("logit_soft_cap", logit_soft_cap, allow_none=True)
    if cap is not None and not getattr(recurrence, "caps_logits", False):
        raise ValueError(
            "`logit_soft_cap` caps the scores of a softmax window: it needs a recurrence with one "
            f"(`window_size`, `WindowRecurrence`). Received: logit_soft_cap={logit_soft_cap!r}, "
            f"recurrence={type(recurrence).__name__}"
        )
    return cap


def _check_conv_size(conv_size):
    conv_size = _validation.check_optional_positive_int("conv_size", conv_size)
    if conv_size is not None and conv_size < 2:
        raise ValueError(
            "`conv_size` must be None or an integer >= 2 (a size-1 convolution is a per-channel "
            f"scale, which the projections already have). Received: conv_size={conv_size!r}"
        )
    return conv_size


def _check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < float("inf"):
        raise ValueError(f"`epsilon` must be a non-negative finite number. Received: epsilon={epsilon!r}")
    return float(epsilon)


def _frozen(config):
    """A private deep copy of a serialized config (the spec never hands it out; `_thawed` gives copies)."""
    return copy.deepcopy(config)


def _thawed(config):
    return copy.deepcopy(config)


# The values of the layer's own arguments when no spec-holding value is given. The default attention is
# the recommended one: taylor + a short convolution leads associative recall (MQAR) with DeltaNet + conv
# (docs/results.md, "Which attention to pick"), and unlike the delta rule it also runs non-causally.
# The seed maps stay one argument away (``feature_map="elu"``; ``conv_size=None`` turns the convolution off).
DEFAULT_FEATURE_MAP = "taylor"
DEFAULT_CONV_SIZE = 4
DEFAULT_CHUNK_SIZE = 64


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What defines one linear attention: built once from the user's arguments, then passed down unchanged.

    `LinearAttention`, `LinearTransformerEncoder` / `LinearTransformerDecoder`
    and `keras_linattn.models.LinearBackbone` / `LinearCausalLM` accept one
    as ``spec=`` in place of the separate arguments. A backbone gives its
    spec to every block and each block to its attention layer; each layer
    builds its own feature map and recurrence from it. The spec holds
    configs, not layers: it has no weights and never changes (its fields are
    frozen; `replace` returns a new spec).

    Build one with `AttentionSpec.create` (the arguments are validated
    there, once).

    Example:

    >>> from keras_linattn.layers import AttentionSpec, LinearAttention
    >>> spec = AttentionSpec.create(feature_map="hedgehog", window_size=16, conv_size=4)
    >>> spec.recurrence["class_name"], spec.conv_size
    ('WindowRecurrence', 4)
    >>> layer = LinearAttention(num_heads=4, key_dim=16, spec=spec)
    >>> layer.recurrence
    WindowRecurrence(window_size=16)
    """

    # Serialized configs, private copies: read them through `feature_map` /
    # `recurrence` (fresh copies), build from them with `make_*`.
    feature_map_config: dict | str | None = dataclasses.field(repr=False)
    recurrence_config: dict = dataclasses.field(repr=False)
    conv_size: int | None = None
    num_key_value_heads: int | None = None
    rope_max_wavelength: float | None = None
    rope_scaling_factor: float = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    epsilon: float = la_ops.DEFAULT_EPSILON
    rope_frequency_adjustment: tuple | None = None
    qk_norm_epsilon: float | None = None
    rope_rotary_dim: int | None = None
    logit_soft_cap: float | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def create(
        cls,
        feature_map=DEFAULT_FEATURE_MAP,
        *,
        chunk_size=DEFAULT_CHUNK_SIZE,
        epsilon=la_ops.DEFAULT_EPSILON,
        causal=True,
        **arguments,
    ):
        """Validates the attention arguments into a spec.

        Args:
            feature_map: a registered name, a serialized config, a
                `FeatureMap` (its config is kept; each layer builds its own)
                or None (the identity, for recurrences without a normalizer).
            chunk_size: chunk length of the causal algorithm.
            epsilon: relative guard of the normalizer.
            causal: whether the attention that will use the spec is causal
                (a causal-only recurrence raises for ``causal=False``).
            **arguments: the mechanism arguments (`ARGUMENTS`): the shorthand
                ``decay``, ``normalize``, ``window_size``, ``update``,
                ``window_gamma``, ``cache_size``, ``linear_weight``, ``linear_rope``,
                ``linear_mean``, ``cache_distance``, ``cache_max_distance``, or ``recurrence``; and ``conv_size``,
                ``num_key_value_heads``, ``rope_max_wavelength``,
                ``rope_scaling_factor``. ``conv_size`` absent is
                `DEFAULT_CONV_SIZE` (4); ``conv_size=None`` is no convolution.

        Raises:
            TypeError: for an argument that is not an attention argument.
            ValueError: for a bad value or combination, naming the argument.
        """
        unknown = sorted(set(arguments) - set(ARGUMENTS))
        if unknown:
            raise TypeError(f"Unknown attention arguments: {unknown}. Expected some of {list(ARGUMENTS)}")
        shorthand = {name: arguments[name] for name in SHORTHAND_ARGUMENTS if name in arguments}
        for name in SHORTHAND_ARGUMENTS[4:]:  # window_gamma ... cache_max_distance
            if name in shorthand and shorthand[name] is None:
                del shorthand[name]  # the default, e.g. from a config
        recurrence = arguments.get("recurrence")
        if recurrence is None:
            recurrence = _shorthand_recurrence(**shorthand)
        elif shorthand:
            raise ValueError(
                "Pass either `recurrence` or the shorthand arguments (decay, normalize, window_size, update, "
                "window_gamma, cache_size, linear_weight, linear_rope, linear_mean, cache_distance, "
                "cache_max_distance), "
                f"not both. Received: recurrence={recurrence!r}, "
                + ", ".join(f"{k}={v!r}" for k, v in shorthand.items())
            )
        else:
            recurrence = registry.get(recurrence)
        feature_map = None if feature_map is None else feature_maps_lib.get(feature_map)
        recurrence.check(feature_map, causal=causal)
        logit_soft_cap = _check_soft_cap(arguments.get("logit_soft_cap"), recurrence)
        rope_max_wavelength, rope_scaling_factor = _check_rope_arguments(
            arguments.get("rope_max_wavelength"), arguments.get("rope_scaling_factor", 1.0)
        )
        return cls(
            feature_map_config=_frozen(None if feature_map is None else feature_maps_lib.serialize(feature_map)),
            recurrence_config=_frozen(registry.serialize(recurrence)),
            conv_size=_check_conv_size(arguments.get("conv_size", DEFAULT_CONV_SIZE)),
            num_key_value_heads=_validation.check_optional_positive_int(
                "num_key_value_heads", arguments.get("num_key_value_heads")
            ),
            rope_max_wavelength=rope_max_wavelength,
            rope_scaling_factor=rope_scaling_factor,
            rope_frequency_adjustment=_check_adjustment(
                arguments.get("rope_frequency_adjustment"), rope_max_wavelength, rope_scaling_factor
            ),
            qk_norm_epsilon=_validation.check_positive_float(
                "qk_norm_epsilon", arguments.get("qk_norm_epsilon"), allow_none=True
            ),
            rope_rotary_dim=_validation.check_optional_positive_int(
                "rope_rotary_dim", arguments.get("rope_rotary_dim")
            ),
            logit_soft_cap=logit_soft_cap,
            chunk_size=_validation.check_positive_int("chunk_size", chunk_size),
            epsilon=_check_epsilon(epsilon),
        )

    @classmethod
    def pop(cls, kwargs, feature_map=DEFAULT_FEATURE_MAP, *, spec=None, causal=True, **arguments):
        """The spec of a constructor: `spec` itself, or one built from the attention arguments in `kwargs`.

        Removes the mechanism arguments (`ARGUMENTS`) from `kwargs`.
        `arguments` holds the constructor's own `chunk_size` / `epsilon`.
        With a `spec`, any mechanism argument or a non-default
        `feature_map`, `chunk_size` or `epsilon` raises ValueError (the
        spec already holds them), and the spec is checked for `causal`.
        """
        given = {name: kwargs.pop(name) for name in ARGUMENTS if name in kwargs}
        if spec is None:
            return cls.create(feature_map, causal=causal, **arguments, **given)
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"`spec` must be an AttentionSpec. Received: spec={type(spec).__name__}")
        defaults = {"chunk_size": DEFAULT_CHUNK_SIZE, "epsilon": la_ops.DEFAULT_EPSILON}
        conflicting = sorted(given) + sorted(k for k, v in arguments.items() if v != defaults.get(k, v))
        if feature_map != DEFAULT_FEATURE_MAP:
            conflicting.insert(0, "feature_map")
        if conflicting:
            raise ValueError(
                f"With `spec`, the spec holds the attention arguments: do not pass {conflicting} as well. "
                f"Received: spec={spec!r}"
            )
        spec.check(causal=causal)
        return spec

    @classmethod
    def from_config(cls, config):
        """The spec of a `get_config` dict (extra keys are ignored)."""
        config = dict(config)
        feature_map = config.pop("feature_map", DEFAULT_FEATURE_MAP)
        chunk_size = config.pop("chunk_size", DEFAULT_CHUNK_SIZE)
        epsilon = config.pop("epsilon", la_ops.DEFAULT_EPSILON)
        arguments = {name: config[name] for name in ARGUMENTS if name in config}
        return cls.create(feature_map, chunk_size=chunk_size, epsilon=epsilon, **arguments)

    def replace(self, **changes):
        """A new spec with some fields changed (`feature_map=` takes a name, config or `FeatureMap`)."""
        if "feature_map" in changes:
            feature_map = changes.pop("feature_map")
            if feature_map is not None:
                feature_map = feature_maps_lib.serialize(feature_maps_lib.get(feature_map))
            changes["feature_map_config"] = _frozen(feature_map)
        return dataclasses.replace(self, **changes)

    def __hash__(self):
        return hash(repr(dataclasses.astuple(self)))

    # ------------------------------------------------------------- reading
    @property
    def feature_map(self):
        """The feature map's serialized config (a fresh dict), or None for the identity."""
        return _thawed(self.feature_map_config)

    @property
    def recurrence(self):
        """The recurrence's serialized config (a fresh dict)."""
        return _thawed(self.recurrence_config)

    def make_feature_map(self):
        """A new `FeatureMap` (unbuilt, its own weights) from the spec, or None for the identity."""
        config = self.feature_map
        return None if config is None else feature_maps_lib.deserialize(config)

    def make_recurrence(self):
        """A new `Recurrence` from the spec (each attention layer owns one)."""
        return registry.deserialize(self.recurrence)

    def check(self, causal=True):
        """Raises ValueError if the recurrence cannot run in a ``causal`` (or not) attention with this map."""
        self.make_recurrence().check(self.make_feature_map(), causal=causal)

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

    def mechanism_config(self):
        """``{"recurrence": <serialized>, "conv_size": K, <RoPE/GQA>}``: the mechanism part of `get_config`.

        ``rope_frequency_adjustment`` and ``qk_norm_epsilon`` are keys only
        when set, so configs without them stay as they were.
        """
        config = {
            "recurrence": self.recurrence,
            "conv_size": self.conv_size,
            "num_key_value_heads": self.num_key_value_heads,
            "rope_max_wavelength": self.rope_max_wavelength,
            "rope_scaling_factor": self.rope_scaling_factor,
        }
        if self.rope_frequency_adjustment is not None:
            config["rope_frequency_adjustment"] = list(self.rope_frequency_adjustment)
        if self.qk_norm_epsilon is not None:
            config["qk_norm_epsilon"] = self.qk_norm_epsilon
        if self.rope_rotary_dim is not None:
            config["rope_rotary_dim"] = self.rope_rotary_dim
        if self.logit_soft_cap is not None:
            config["logit_soft_cap"] = self.logit_soft_cap
        return config

    def get_config(self):
        """Every field as the constructor arguments that rebuild it (`from_config`)."""
        return {
            "feature_map": self.feature_map,
            "chunk_size": self.chunk_size,
            "epsilon": self.epsilon,
            **self.mechanism_config(),
        }

    def __repr__(self):
        feature_map = self.feature_map
        if isinstance(feature_map, dict):
            feature_map = feature_map.get("registered_name") or feature_map.get("class_name")
        recurrence = self.recurrence
        parts = [f"feature_map={feature_map!r}", f"recurrence={recurrence.get('class_name')}{recurrence.get('config')}"]
        for name in ("conv_size", "num_key_value_heads", "rope_max_wavelength", "rope_frequency_adjustment"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        return f"AttentionSpec({', '.join(parts)})"
