"""LinearAttention: multi-head kernelized attention in O(N) time and memory."""

import numbers

import keras
from keras import ops

from keras_linattn import _state, _validation
from keras_linattn import feature_maps as feature_maps_lib
from keras_linattn._docstrings import fill
from keras_linattn.layers import _attention_base
from keras_linattn.layers._mechanism_doc import MECHANISM_ARGS_DOC
from keras_linattn.layers._output_norm import OutputNorm
from keras_linattn.layers._short_conv import ShortConvolution
from keras_linattn.layers.spec import DEFAULT_FEATURE_MAP, AttentionSpec
from keras_linattn.ops import core as la_ops
from keras_linattn.ops import rotary as rotary_ops


def _get_map(feature_map):
    """A `FeatureMap`, or None for the identity (a recurrence that accepts it, e.g. the delta rule)."""
    return None if feature_map is None else feature_maps_lib.get(feature_map)


def _serialize_map(feature_map):
    return None if feature_map is None else feature_maps_lib.serialize(feature_map)


__all__ = ["LinearAttention"]


@keras.saving.register_keras_serializable(package="keras_linattn")
@_attention_base.document
@fill(mechanism_args=MECHANISM_ARGS_DOC)
class LinearAttention(_attention_base.ProjectedAttention):
    """Multi-head linear attention, a drop-in for `keras.layers.MultiHeadAttention`.

        Queries and keys are projected per head and mapped through a feature map
        ``phi``; attention is ``phi(q)^T S / phi(q)^T z`` with
        ``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)``, which costs
        ``O(N * C * M)`` instead of ``O(N^2)``. Causal attention uses the
        chunkwise-parallel algorithm. Features and the state ``(S, z)`` are
        accumulated in float32 under any dtype policy.

        The layer is a pipeline: projections -> short convolution (`conv_size`)
        -> feature map -> recurrence (`recurrence`, a
        `keras_linattn.recurrences.Recurrence`: additive, decay, delta, window
        or any registered one) -> output norm (when the recurrence's readout has
        no normalizer) -> output projection.

        Shapes: B batch, T query length, S key length, H heads, D key dim,
        C feature dim, M value dim.

        Args:
            num_heads: number of attention heads H.
            key_dim: size of each query/key head D.
            value_dim: size of each value head M; defaults to `key_dim`.
            feature_map: a registered name (`keras_linattn.feature_maps.available()`),
                a serialized feature-map config, or a `FeatureMap` instance.
                Default ``"taylor"`` (Based's second-order Taylor map) with
                the default ``conv_size=4``: the recommended attention
                (docs/results.md, "Which attention to pick"). Its feature
                dim is ``C = 1 + D + D^2``: at ``key_dim=16`` C = 273, at
                ``key_dim=64`` C = 4161, a state ``S [H, C, M]`` of 1.1 MB
                per head at M = 64 (float32), 65 times elu's; use a small
                key dim (16, as Based) with a wider `value_dim`. The seed
                map is one argument away: ``feature_map="elu"`` (elu + 1;
                add ``conv_size=None`` for plain linear attention). None is
                the identity (with ``update="delta"`` only, as in DeltaNet).
            chunk_size: chunk length of the causal algorithm. Default 64.
            epsilon: relative guard of the normalizer (see
                `keras_linattn.ops.linear_attention`). Keyword-only.
    {mechanism_args}
    {projection_args}
            seed: seed of the dropout. Keyword-only.

        Call arguments:
            query: ``[B, T, dim]``.
            value: ``[B, S, dim]``.
            key: optional ``[B, S, dim]``; defaults to `value`.
            key_mask: optional ``[B, S]`` padding mask of the keys (1 = keep).
                Keras masks (e.g. from ``Embedding(mask_zero=True)``) on `value`
                or `key` are used automatically.
            attention_mask: not supported: a full ``[B, T, S]`` mask has no
                linear-attention equivalent. Passing one raises ``ValueError``;
                use `key_mask` for padding and `use_causal_mask` for causality.
            use_causal_mask: causal self-attention (requires ``S == T``).
            training: Python boolean, for dropout and training-only behaviour of
                feature maps.
            return_state: also return the final state, a tuple with one entry
                per `state_spec` item (``(S [B, H, C, M], z [B, H, C])`` for
                plain linear attention).
            initial_state: optional state to continue from (e.g. from the
                previous piece of a long sequence with ``return_state=True``).

        Returns:
            ``[B, T, output_dim]`` with the query's Keras mask, and the state if
            `return_state`.

        Example:

        >>> layer = LinearAttention(num_heads=4, key_dim=16, feature_map="elu")
        >>> x = keras.random.normal((2, 100, 64))
        >>> tuple(layer(x, x, use_causal_mask=True).shape)
        (2, 100, 64)
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        value_dim=None,
        feature_map=DEFAULT_FEATURE_MAP,
        chunk_size=64,
        *,
        epsilon=la_ops.DEFAULT_EPSILON,
        spec=None,
        **kwargs,
    ):
        given_spec = spec is not None
        spec = AttentionSpec.pop(kwargs, feature_map, spec=spec, chunk_size=chunk_size, epsilon=epsilon)
        super().__init__(num_heads, key_dim, value_dim, **kwargs)
        spec.check_heads(num_heads, key_dim)
        self.attention_spec = spec
        self.num_key_value_heads = spec.num_key_value_heads
        self.rope_max_wavelength = spec.rope_max_wavelength
        self.rope_scaling_factor = spec.rope_scaling_factor
        self.rope_frequency_adjustment = spec.rope_frequency_adjustment
        self.rope_rotary_dim = spec.rope_rotary_dim
        self.qk_norm_epsilon = spec.qk_norm_epsilon
        self.logit_soft_cap = spec.logit_soft_cap  # read by a window recurrence (its softmax scores)
        self.query_norm = self.key_norm = None
        self.recurrence = spec.make_recurrence()
        self.conv_size = spec.conv_size
        self.short_conv = ShortConvolution(self.conv_size)
        self.output_norm = OutputNorm(enabled=not self.recurrence.normalize)
        # A `FeatureMap` instance passed directly is the layer's own; from a
        # spec (or a name or config) the layer builds a new one.
        adopt = not given_spec and isinstance(feature_map, feature_maps_lib.FeatureMap)
        self.feature_map = feature_map if adopt else spec.make_feature_map()
        self.chunk_size = spec.chunk_size
        self.epsilon = spec.epsilon
        self.feature_dim = key_dim if self.feature_map is None else self.feature_map.feature_dim(key_dim)
        self.recurrence.attach(self)
        self.short_conv.attach(self)
        if self.compute_dtype == "float16" and self.feature_map is not None and not self.feature_map.float16_safe:
            raise ValueError(
                f"Feature map {type(self.feature_map).__name__} gives outputs beyond the float16 "
                "range (inf/NaN) at ordinary input scales; use a float32 or bfloat16 policy. "
                f"Received: feature_map={getattr(self.feature_map, 'registry_name', self.feature_map.name)!r}, "
                f"dtype={self.dtype_policy.name!r}"
            )

    # ------------------------------------------------------------------ build
    def build(self, query_shape, value_shape, key_shape=None):
        super().build(query_shape, value_shape, key_shape)
        if self.feature_map is not None and not self.feature_map.built:
            self.feature_map.build((None, None, self.num_heads, self.key_dim))
        # The order of the weights is fixed (their index is their path in
        # `.keras` files): the recurrence's, the convolution's, the output norm's.
        self.recurrence.build(self)
        self.short_conv.build(self)
        self.output_norm.build(self)
        if self.qk_norm_epsilon is not None:  # last: the weights of layers without it keep their indices
            self.query_norm, self.key_norm = (
                keras.layers.RMSNormalization(epsilon=self.qk_norm_epsilon, dtype=self.dtype_policy, name=name)
                for name in ("query_norm", "key_norm")
            )
            self.query_norm.build((None, None, self.num_heads, self.key_dim))
            self.key_norm.build((None, None, self.key_value_heads, self.key_dim))

    def _normalize_heads(self, q, k):
        """The per-head q/k RMSNorm (`qk_norm_epsilon`) of ``q [..., H, D]`` and ``k [..., H, D]``, if any."""
        if self.query_norm is None:
            return q, k
        return self.query_norm(q), self.key_norm(k)

    def project(self, query, value, key=None):
        """`ProjectedAttention.project`, then the per-head q/k RMSNorm where `qk_norm_epsilon` is set."""
        q, k, v = super().project(query, value, key)
        q, k = self._normalize_heads(q, k)  # [B, T, H, D], [B, S, H, D]
        return q, k, v

    def project_step(self, query_t, value_t, key_t):
        """`ProjectedAttention.project_step`, then the per-head q/k RMSNorm where `qk_norm_epsilon` is set."""
        q, k, v = super().project_step(query_t, value_t, key_t)
        q, k = self._normalize_heads(q, k)  # [B, H, D]
        return q, k, v

    # ------------------------------------------------------------------- call
    def _compute_attention(
        self, query, key, value, key_mask=None, use_causal_mask=False, training=None, initial_state=None
    ):
        """Short convolution, recurrence (with the feature map), output norm; returns ``(out, state)``.

        ``state`` is a tuple with one entry per `state_spec` item.
        """
        self.recurrence.check_call(use_causal_mask)
        parts = None
        if initial_state is not None:
            _state.check_state(self.state_spec(), initial_state, name="initial_state")
            parts = self._split_state(initial_state)
        (query, key, value), gate_keys, unrotated, new_parts = self._before_recurrence(
            query, key, value, key_mask, use_causal_mask, parts
        )
        extra = {"unrotated": unrotated} if self.recurrence.reads_unrotated else {}
        out, recurrence_parts = self.recurrence.call(
            query, key, value, gate_keys, key_mask, parts, causal=use_causal_mask, training=training, **extra
        )  # [B, T, H, M]
        if use_causal_mask and self._checks_key_range():
            out, recurrence_parts = self._flag_keys_out_of_range(key, key_mask, out, recurrence_parts)
        new_parts.update(recurrence_parts)
        return self.output_norm(out), tuple(new_parts[entry.name] for entry in self.state_spec())

    def _before_recurrence(self, query, key, value, key_mask, causal, parts):
        """The stages between the projections and the recurrence: key padding, short convolution, RoPE.

        Returns ``((q, k, v), gate_keys, unrotated, new_parts)``, ``unrotated``
        the ``(q, k)`` before the rotary embedding (for recurrences that
        `reads_unrotated`; q and k themselves without one).
        """
        # Padded keys enter the map as zeros, so maps with statistics over
        # keys (the non-causal stabilizers of favor+/favor_trig) never see
        # padded junk; their features are masked again after the map.
        key = la_ops._mask_keys(key, key_mask)  # [B, S, H, D]
        gate_keys = key
        # The query sequence is the key sequence in causal self-attention:
        # its padding is the keys'.
        query_mask = key_mask if causal else None
        (query, key, value), new_parts = self.short_conv(query, key, value, key_mask, query_mask, parts)
        unrotated = (query, key)
        if self.rope_max_wavelength is not None:
            query, key, new_parts["position"] = self._rotate(query, key, key_mask, causal, parts)
        return (query, key, value), gate_keys, unrotated, new_parts

    def attention_inputs(self, query, value, key=None, key_mask=None, use_causal_mask=False):
        """The queries, keys and values the feature map and the recurrence see, from a fresh state.

        The projections (key/value heads repeated for grouped-query
        attention), the short convolution and the rotary embeddings: what a
        softmax teacher's attention is compared with (attention transfer,
        distillation). `project` stops before the convolution and RoPE.

        Args:
            query: ``[B, T, dim]``.
            value: ``[B, S, dim]``.
            key: optional ``[B, S, dim]``; defaults to `value`.
            key_mask: optional ``[B, S]`` (1 = real key).
            use_causal_mask: causal self-attention (decides the queries'
                padding and positions).

        Returns:
            ``(q [B, T, H, D], k [B, S, H, D], v [B, S, H, M])``; padded keys
            and values are zeros.
        """
        if not self.built:
            key_shape = None if key is None else key.shape
            self.build(query.shape, value.shape, key_shape)
        if key_mask is not None:
            key_mask = ops.cast(key_mask, "bool")
        q, k, v = self.project(query, value, key)
        (q, k, v), _, _, _ = self._before_recurrence(q, k, v, key_mask, use_causal_mask, None)
        return q, k, v

    def _rotate(self, query, key, key_mask, causal, parts):
        """Rotary embeddings on ``q [B, T, H, D]`` and ``k [B, S, H, D]``; returns ``(q, k, position [B])``.

        Causal self-attention: a token's position is the state's position
        plus the number of real tokens before it in the piece (padding takes
        no position, as the LM's positions), and the returned position adds
        the piece's real tokens. Non-causal attention: queries and keys take
        the state's position plus their index (padding counts; the relative
        position of query i and key j is ``i - j`` as given).
        """
        batch = ops.shape(key)[0]
        start = ops.zeros((batch,), "float32") if parts is None else parts["position"]  # [B]
        if causal and key_mask is not None:
            real = ops.cast(key_mask, "float32")  # [B, S]
            key_positions = start[:, None] + ops.cumsum(real, axis=1) - real  # [B, S]
            end = start + ops.sum(real, axis=1)  # [B]
        else:
            key_positions = start[:, None] + ops.arange(ops.shape(key)[1], dtype="float32")[None, :]  # [B, S]
            end = start + ops.cast(ops.shape(key)[1], "float32")  # [B]
        if causal:
            query_positions = key_positions
        else:
            query_positions = start[:, None] + ops.arange(ops.shape(query)[1], dtype="float32")[None, :]  # [B, T]
        rope = (
            self.rope_max_wavelength,
            self.rope_scaling_factor,
            self.rope_frequency_adjustment,
            self.rope_rotary_dim,
        )
        query = rotary_ops.rotary_embedding(query, query_positions, *rope)  # [B, T, H, D]
        key = rotary_ops.rotary_embedding(key, key_positions, *rope)  # [B, S, H, D]
        return query, key, end

    def _checks_key_range(self):
        """True if the feature map caps causal keys (favor_trig) and the recurrence does not cancel it."""
        fm = self.feature_map
        return fm is not None and fm.causal_key_out_of_range is not None and not self.recurrence.key_scale_free

    def _flag_keys_out_of_range(self, key, key_mask, out, parts):
        """Flags causal rows that attend to a key whose features a map had to cap (favor_trig).

        ``key [B, T, H, D]`` (after the short convolution), ``out [B, T, H, M]``.
        A row at or after such a key raises `KernelUnderflowError` eagerly and
        is NaN in a graph, and the recurrence's state (``S``, ``z``) of that
        (batch, head) is NaN, so that the next piece or step stays flagged
        (step == parallel). Called only where `_checks_key_range`.
        """
        bad = self.feature_map.causal_key_out_of_range(key)  # [B, T, H]
        if key_mask is not None:
            bad = ops.logical_and(bad, ops.cast(key_mask, "bool")[:, :, None])
        rows = ops.cumsum(ops.cast(bad, "float32"), axis=1) > 0  # [B, T, H]: at or after an out-of-range key
        if la_ops._is_eager(rows):
            count = int(ops.convert_to_numpy(ops.sum(ops.cast(rows, "int32"))))
            if count:
                raise la_ops.KernelUnderflowError(
                    f"{count} causal attention row(s) attend to a key whose {self.feature_map.name} amplitude "
                    "exp(|k'|^2/2) is past exp(50), where the causal features are capped (beyond, float32 "
                    "overflows): their kernel is not representable. Scale the keys down (e.g. a LayerNorm "
                    f"before attention) or use favor+. Received: {count} flagged row(s) of shape {tuple(out.shape)}"
                )
            return out, parts
        # NaN by sqrt(-1), -0 elsewhere (x + -0 == x bit for bit): the marker of `ops.core._mark_underflow`.
        out = out + ops.sqrt(-ops.cast(rows, out.dtype))[..., None]  # [B, T, H, M]
        seen = ops.any(bad, axis=1)  # [B, H]
        flagged = dict(parts)
        for entry in self.recurrence.state_spec():
            x = parts[entry.name]
            marker = ops.sqrt(-ops.cast(seen, x.dtype))  # [B, H]
            for _ in range(len(x.shape) - 2):
                marker = ops.expand_dims(marker, -1)  # [B, H, 1, ...]
            flagged[entry.name] = x + marker
        return out, flagged

    # -------------------------------------------------------- recurrent API
    def state_spec(self):
        """The recurrent state, described once: a list of `StateSpec` (shapes without the batch dim).

        The recurrence's summaries (``S [H, C, M]``, and ``z [H, C]`` for a
        normalized readout), then the short convolution's buffers (with
        `conv_size` K, the last ``K - 1`` inputs ``conv_q [K-1, H, D]``,
        ``conv_k [K-1, H, D]``, ``conv_v [K-1, H, M]``), then the
        recurrence's buffers (the window's ``window_k [W, H, D]``,
        ``window_v [W, H, M]`` and ``window_valid [W]``, 1 = a real key;
        the key/value heads instead of H under grouped-query attention
        without a short convolution),
        then, with rotary embeddings, ``position []``: the number of real
        tokens consumed (exact in float32 up to 2**24 tokens).
        All float32 and of a size that does not depend on the length.
        `get_initial_state`, the state checks, `LinearAttentionCell`'s flat
        state and the exported ``step`` signatures are derived from it.
        """
        spec = self.recurrence.state_spec() + self.short_conv.state_spec() + self.recurrence.buffer_spec()
        if self.rope_max_wavelength is not None:
            spec.append(_state.StateSpec("position", (), "float32"))
        return spec

    def _split_state(self, state):
        return {entry.name: ops.cast(x, "float32") for entry, x in zip(self.state_spec(), state, strict=True)}

    def get_initial_state(self, batch_size):
        """Empty state (`state_spec`): a tuple of float32 zeros, e.g. ``(S [B, H, C, M], z [B, H, C])``."""
        if isinstance(batch_size, (bool, numbers.Integral)):  # a symbolic batch size passes through
            batch_size = _validation.check_non_negative_int("batch_size", batch_size)
        return tuple(_state.zeros_state(self.state_spec(), batch_size))

    def step(self, query_t, value_t, state, key_t=None, training=None):
        """One causal decoding step, sharing weights with the parallel layer.

        Args:
            query_t: ``[B, dim]`` the query at step t.
            value_t: ``[B, dim]`` the value at step t.
            state: a tuple per `state_spec` from `get_initial_state` or a
                previous step (or from ``call(..., return_state=True)``).
            key_t: optional ``[B, dim]``; defaults to `value_t`.

        Returns:
            ``(output_t [B, output_dim], new_state)``.
        """
        if key_t is None:
            key_t = value_t
        for name, x in (("query_t", query_t), ("value_t", value_t), ("key_t", key_t)):
            if len(x.shape) != 2:
                raise ValueError(f"`{name}` must have rank 2 [batch, dim]. Received: {name}.shape={tuple(x.shape)}")
        batch = query_t.shape[0]
        _state.check_state(self.state_spec(), state, batch_size=batch, name="state")
        if not self.built:
            self.build((None, None, query_t.shape[-1]), (None, None, value_t.shape[-1]), (None, None, key_t.shape[-1]))
        parts = self._split_state(state)
        q, k, v = self.project_step(query_t, value_t, key_t)  # [B, H, D|D|M]
        # expand_dims rather than `[:, None]`: one ONNX node where indexing is two (an Unsqueeze and a
        # Slice); a step is mostly such small ops. Unused (and dropped from the graph) by most recurrences.
        gate_keys = ops.expand_dims(k, 1)  # [B, 1, H, D]
        (q, k, v), new_parts = self.short_conv.step(q, k, v, parts)
        extra = {"unrotated": (q, k)} if self.recurrence.reads_unrotated else {}
        if self.rope_max_wavelength is not None:
            position = parts["position"]  # [B]
            rope = (
                self.rope_max_wavelength,
                self.rope_scaling_factor,
                self.rope_frequency_adjustment,
                self.rope_rotary_dim,
            )
            q = rotary_ops.rotary_embedding(q, position, *rope)  # [B, H, D]
            k = rotary_ops.rotary_embedding(k, position, *rope)  # [B, H, D]
            new_parts["position"] = position + 1.0
        out, recurrence_parts = self.recurrence.step(q, k, v, gate_keys, parts, training=training, **extra)  # [B, H, M]
        if self._checks_key_range():
            out, recurrence_parts = self._flag_keys_out_of_range(k[:, None], None, out[:, None], recurrence_parts)
            out = out[:, 0]  # [B, H, M]
        new_parts.update(recurrence_parts)
        out = ops.cast(self.output_norm(out), self.compute_dtype)
        out = self.project_output_step(out, training)  # [B, out_dim]
        return out, tuple(new_parts[entry.name] for entry in self.state_spec())

    # ----------------------------------------------------------------- config
    def get_config(self):
        return {
            **super().get_config(),
            "feature_map": _serialize_map(self.feature_map),
            "chunk_size": self.chunk_size,
            "epsilon": self.epsilon,
            **self.attention_spec.mechanism_config(),
        }
