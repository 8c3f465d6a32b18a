"""`Recurrence`: one state update and its readout, in the three forms every recurrence has.

A recurrence is the part of `LinearAttention` between the feature map and
the output norm: ``S_t = update(S_{t-1}, phi(k_t), v_t)`` and
``o_t = readout(phi(q_t), S_t)``. It owns

- its weights (gates, write strengths), created on the attention layer by
  `build` so that they are saved with the layer's own variables;
- its decode state, `state_spec` (the summaries, e.g. ``S``, ``z``) and
  `buffer_spec` (recent inputs it keeps, e.g. a window ring);
- its chunkwise-parallel form `call`, its recurrent form `step` and its
  float64 `oracle`, each a thin wrapper of the ops in ``keras_linattn.ops``.

The attention layer is a pipeline (projections -> short convolution ->
recurrence, which applies the feature map -> output norm) and never asks
which recurrence it runs. A recurrence is registered by name with
`keras_linattn.recurrences.register`; the contract battery in
tests/contracts runs every registered recurrence.

Why a plain class and not a `keras.layers.Layer`: the weights stay the
attention layer's own variables, at the paths older `.keras` files and
exported SavedModels name them (``.../linear_attention/vars/<i>``); a
sublayer would move them to ``.../linear_attention/recurrence/vars/<i>``
and old files would no longer load.
"""

from keras import ops

__all__ = ["Recurrence"]


class Recurrence:
    """Base class of the recurrences of `LinearAttention`.

    Subclasses set the class attributes below, implement `call`, `step` and
    `oracle`, and override `build`, `state_spec`, `buffer_spec` and
    `get_config` when they have weights, state or arguments.

    Class attributes:
        causal_only: True (default) if the recurrence is defined only for
            causal attention (the layer refuses ``use_causal_mask=False``
            and the encoder refuses the recurrence).
        accepts_identity_map: True if ``feature_map=None`` (the identity, a
            signed kernel) is allowed: only for a readout without a
            normalizer.
        contract_configs: a tuple of constructor-argument dicts, each run
            through the contract battery of tests/contracts.
        key_scale_free: True if a positive per-key factor of the key
            features cancels in the recurrence (the delta rule normalizes
            them): then a feature map's capped key amplitude (favor_trig,
            causal) changes nothing and is not flagged.

    Instance attributes:
        normalize: True if the readout divides by ``phi(q) . z``; False puts
            the layer's per-head output RMSNorm after the recurrence.
    """

    causal_only = True
    accepts_identity_map = False
    key_scale_free = False
    # The constructor arguments the contract battery (tests/contracts) runs.
    contract_configs = ({},)
    normalize = True
    registry_name = None  # set by `register`

    # True when `call`, `step` and `oracle` take ``unrotated=(q, k)``: the
    # queries and keys before the layer's rotary embedding (the same as q and
    # k on a layer without one). `WindowRecurrence(linear_rope=False)` feeds
    # its linear part from them.
    reads_unrotated = False

    def __init__(self):
        self.layer = None

    # ----------------------------------------------------------- config
    def get_config(self):
        """The constructor arguments, JSON-serializable."""
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def copy(self):
        """A fresh, unbuilt recurrence with the same config (each attention layer owns one)."""
        return type(self).from_config(self.get_config())

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def check(self, feature_map, causal=True):
        """Raises ValueError if the recurrence cannot run with `feature_map` and `causal` (validated once)."""
        if self.causal_only and not causal:
            raise ValueError(
                f"The {self.registry_name!r} recurrence ({self!r}) is a causal recurrence; this attention is "
                "not causal. Received: causal=False"
            )
        if feature_map is None and not self.accepts_identity_map:
            raise ValueError(
                "`feature_map=None` (the identity, a signed kernel) needs `update='delta'` or another "
                f"recurrence without a normalizer. Received: feature_map=None, recurrence={self!r}"
            )

    def check_call(self, use_causal_mask):
        """Raises ValueError when a causal-only recurrence is called without `use_causal_mask`."""
        if self.causal_only and not use_causal_mask:
            raise ValueError(
                f"The {self.registry_name!r} recurrence ({self!r}) is a causal recurrence: call the layer "
                "with `use_causal_mask=True`. Received: use_causal_mask=False"
            )

    # ------------------------------------------------------------ build
    def attach(self, layer):
        """Binds the recurrence to its attention `layer` (its dims, feature map, chunk size, epsilon)."""
        self.layer = layer

    def build(self, layer):
        """Creates the recurrence's weights on its attention `layer` (`add_weight`); subclasses extend it."""
        self.layer = layer

    def add_weight(self, name, shape, initializer):
        """A float32 weight of the attention layer (never autocast: gates and state stay float32)."""
        return self.layer.add_weight(name=name, shape=shape, initializer=initializer, dtype="float32", autocast=False)

    @property
    def num_heads(self):
        return self.layer.num_heads

    @property
    def key_dim(self):
        return self.layer.key_dim

    @property
    def value_dim(self):
        return self.layer.value_dim

    @property
    def feature_dim(self):
        return self.layer.feature_dim

    # ------------------------------------------------------------ state
    def state_spec(self):
        """The summaries of the past: a list of `StateSpec` (shapes without the batch dim)."""
        return []

    def buffer_spec(self):
        """Recent inputs the recurrence keeps (after the short convolution's buffers in the layer's state)."""
        return []

    # ------------------------------------------------------------ forms
    def features(self, x, is_query, causal=True, training=None, key_mask=None):
        """``phi(x)`` by the layer's feature map (the identity for ``feature_map=None``).

        ``key_mask`` (``[B, S]`` or None) reaches maps whose ``call`` takes it:
        the ones with statistics over keys (favor+'s non-causal stabilizer),
        so that padded keys never enter those statistics.
        """
        feature_map = self.layer.feature_map
        if feature_map is None:
            return x
        takes_mask = "key_mask" in feature_map.call_signature_parameters
        masked = {"key_mask": key_mask} if key_mask is not None and takes_mask else {}
        return feature_map(x, is_query=is_query, causal=causal, training=training, **masked)

    def feature_pair(self, q, k, causal=True, training=None, key_mask=None):
        """``(phi(q), phi(k))`` of one call.

        Non-causal, a map whose `FeatureMap.noncausal_pair` is a method
        (favor+) maps queries and keys together (a stabilizer per feature
        that needs the keys' statistics); otherwise `features` maps each on
        its own.
        """
        feature_map = self.layer.feature_map
        if not causal and feature_map is not None and feature_map.noncausal_pair is not None:
            return feature_map.noncausal_pair(q, k, key_mask=key_mask)
        return self.features(q, True, causal, training), self.features(k, False, causal, training, key_mask)

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        """The chunkwise-parallel form over a piece.

        Args:
            q: ``[B, T, H, D]`` queries (after the short convolution).
            k: ``[B, S, H, D]`` keys (after it; padded keys are zeros).
            v: ``[B, S, H, M]`` values.
            gate_keys: ``[B, S, H, D]`` the projected keys before the
                convolution, padded keys zeroed: what gates read.
            key_mask: ``[B, S]`` or None.
            state: ``{name: tensor}`` of `state_spec` and `buffer_spec`
                (float32), or None for a fresh sequence.
            causal: Python bool.
            training: Python bool.

        Returns:
            ``(out [B, T, H, M], new_state)``, ``new_state`` a dict with
            every name of `state_spec` and `buffer_spec`.
        """
        raise NotImplementedError

    def step(self, q, k, v, gate_keys, state, training=None):
        """One decoding step: ``q, k [B, H, D]``, ``v [B, H, M]``, ``gate_keys [B, 1, H, D]``.

        Returns ``(out [B, H, M], new_state)`` as `call`.
        """
        raise NotImplementedError

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        """The causal float64 reference of `call` from a fresh state: ``[B, T, H, M]``."""
        raise NotImplementedError

    def conditioning(self, gate_keys):
        """Factor by which the parallel form's rounding grows (1 without decay); used by error bounds."""
        return 1.0

    # ---------------------------------------------------------- helpers
    @staticmethod
    def zeros_like_spec(spec, batch):
        """``{name: zeros [batch, *shape]}`` for a list of `StateSpec`."""
        return {s.name: ops.zeros((batch,) + tuple(s.shape), s.dtype) for s in spec}
