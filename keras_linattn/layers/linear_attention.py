"""LinearAttention: multi-head kernelized attention in O(N) time and memory."""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_linattn import _state, _validation
from keras_linattn import feature_maps as feature_maps_lib
from keras_linattn.layers import _projections
from keras_linattn.ops import core as la_ops
from keras_linattn.ops import decay as decay_ops
from keras_linattn.ops import delta as delta_ops
from keras_linattn.ops import short_conv as conv_ops
from keras_linattn.ops import window as window_ops

DECAYS = (None, "fixed", "scalar", "channel")
UPDATES = ("add", "delta")
# GLA's gate-logit normalizer: log a = logsigmoid(x W) / 16 keeps gates near 1 at initialization.
CHANNEL_GATE_TEMPERATURE = 16.0
# Rank of the low-rank projection of the per-channel gates (as in GLA).
CHANNEL_GATE_RANK = 16
# Output RMSNorm epsilon (normalize=False).
OUTPUT_NORM_EPSILON = 1e-6


def _check_mechanisms(decay, normalize, conv_size, window_size, causal=True, update="add", feature_map="elu"):
    """The rules of `LinearAttention`'s recall mechanisms, shared by the blocks and the LM.

    Returns ``(decay, normalize, conv_size, window_size, update)`` normalized.

    Raises:
        ValueError: naming the argument, for a value outside its rule or a
            combination that is not supported (a window with a decay or
            without the normalizer; a decay or window where attention is not
            causal, `causal=False`).
    """
    decay = _validation.check_one_of("decay", decay, DECAYS)
    normalize = _validation.check_bool("normalize", normalize)
    conv_size = _validation.check_optional_positive_int("conv_size", conv_size)
    if conv_size is not None and conv_size < 2:
        raise ValueError(
            "`conv_size` must be None or an integer >= 2 (a size-1 convolution is a per-channel "
            f"scale, which the projections already have). Received: conv_size={conv_size!r}"
        )
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
    if not causal and (decay is not None or window_size is not None or update == "delta"):
        raise ValueError(
            "`decay`, `window_size` and `update='delta'` define a causal recurrence; this attention is not "
            f"causal. Received: decay={decay!r}, window_size={window_size!r}, update={update!r}"
        )
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
    elif feature_map is None:
        raise ValueError(
            "`feature_map=None` (the identity, a signed kernel) needs `update='delta'`, which has no "
            f"normalizer. Received: feature_map=None, update={update!r}"
        )
    return decay, normalize, conv_size, window_size, update


def _l2_normalize(x):
    """Unit L2 norm over the last axis, in float32 (the delta rule's keys and queries)."""
    x = ops.cast(x, "float32")
    return x * ops.rsqrt(ops.sum(ops.square(x), axis=-1, keepdims=True) + 1e-12)


def _get_map(feature_map):
    """A `FeatureMap`, or None for the identity (``update="delta"`` only)."""
    return None if feature_map is None else feature_maps_lib.get(feature_map)


def _serialize_map(feature_map):
    return None if feature_map is None else feature_maps_lib.serialize(feature_map)


def _fixed_log_decay(num_heads):
    """RetNet's per-head decay, as logs: ``log(1 - 2 ** (-5 - h))`` for ``h = 0 .. H - 1``."""
    return np.log1p(-(2.0 ** (-5.0 - np.arange(num_heads, dtype="float64")))).astype("float32")


def _inverse_softplus_of_log_uniform(low, high, seed):
    """Initializer: ``softplus^{-1}(dt)`` with ``dt`` log-uniform in ``[low, high]`` (Mamba2's ``dt_bias``)."""
    uniform = keras.initializers.RandomUniform(math.log(low), math.log(high), seed=seed)

    def init(shape, dtype=None):
        dt = ops.exp(uniform(shape, dtype="float32"))
        return dt + ops.log(-ops.expm1(-dt))  # softplus^{-1}(dt) = log(exp(dt) - 1)

    return init


__all__ = ["LinearAttention"]


@keras.saving.register_keras_serializable(package="keras_linattn")
@_projections.document
class LinearAttention(_projections.ProjectedAttention):
    """Multi-head linear attention, a drop-in for `keras.layers.MultiHeadAttention`.

    Queries and keys are projected per head and mapped through a feature map
    ``phi``; attention is ``phi(q)^T S / phi(q)^T z`` with
    ``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)``, which costs
    ``O(N * C * M)`` instead of ``O(N^2)``. Causal attention uses the
    chunkwise-parallel algorithm. Features and the state ``(S, z)`` are
    accumulated in float32 under any dtype policy.

    Shapes: B batch, T query length, S key length, H heads, D key dim,
    C feature dim, M value dim.

    Args:
        num_heads: number of attention heads H.
        key_dim: size of each query/key head D.
        value_dim: size of each value head M; defaults to `key_dim`.
        feature_map: a registered name (`keras_linattn.feature_maps.available()`),
            a serialized feature-map config, or a `FeatureMap` instance.
            Default ``"elu"`` (elu + 1). None is the identity (with
            ``update="delta"`` only, as in DeltaNet).
        chunk_size: chunk length of the causal algorithm. Default 64.
        epsilon: relative guard of the normalizer (see
            `keras_linattn.ops.linear_attention`). Keyword-only.
        decay: None (default), ``"fixed"``, ``"scalar"`` or ``"channel"``: a
            decaying state ``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` (causal
            only). ``"fixed"``: RetNet's ``a = 1 - 2^(-5-h)`` for head h.
            ``"scalar"``: one data-dependent gate per head and token,
            ``a_t = exp(-exp(A_log) * softplus(w . k_t + b))`` (Mamba2's
            form; it starts slow and token-independent: ``w = 0``,
            ``A_log = 0``, ``softplus(b)`` log-uniform in [1e-3, 1e-2]).
            ``"channel"``: one gate per head and feature channel,
            ``log a_t = logsigmoid(k_t W_1 W_2 + b) / 16`` (GLA, low-rank 16).
            The gates read the projected keys of all heads, which are a
            linear function of the key input. Keyword-only.
        normalize: True (default) divides by ``phi(q) . z``; False drops
            that denominator and normalizes each head's output with an
            RMSNorm (learned scale) instead. Keyword-only.
        conv_size: None (default) or an int K >= 2: a causal depthwise
            convolution of size K over time on the projected q, k and v,
            before the feature map (Based, "short convolution"). Padded
            positions enter it as zeros. Its last ``K - 1`` inputs are part
            of the decode state. Keyword-only.
        window_size: None (default) or an int W: exact softmax attention over
            the last W tokens (the query's own included) plus linear
            attention over every older token, with one shared normalizer
            (causal only; not with `decay` or ``normalize=False``). The
            decode state keeps a fixed buffer of the last W keys and values.
            Keyword-only.
        update: ``"add"`` (default): the state only accumulates,
            ``S_t = S_{t-1} + phi(k_t) v_t^T``. ``"delta"``: the delta rule
            (DeltaNet), ``S_t = S_{t-1} + b_t k_t (v_t - S_{t-1}^T k_t)^T``
            with ``phi(q)``, ``phi(k)`` L2-normalized per head and
            ``b_t = sigmoid(w . k_t + c)`` per head: a key's old value is
            overwritten instead of added to. With ``decay="fixed"`` or
            ``"scalar"`` it is Gated DeltaNet. Needs ``normalize=False``
            (no denominator); no window. Keyword-only.
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
        feature_map="elu",
        chunk_size=64,
        *,
        epsilon=la_ops.DEFAULT_EPSILON,
        decay=None,
        normalize=True,
        conv_size=None,
        window_size=None,
        update="add",
        **kwargs,
    ):
        super().__init__(num_heads, key_dim, value_dim, **kwargs)
        _validation.check_positive_int("chunk_size", chunk_size)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < float("inf"):
            raise ValueError(f"`epsilon` must be a non-negative finite number. Received: epsilon={epsilon!r}")
        self.decay, self.normalize, self.conv_size, self.window_size, self.update = _check_mechanisms(
            decay, normalize, conv_size, window_size, update=update, feature_map=feature_map
        )
        self.feature_map = _get_map(feature_map)
        self.chunk_size = chunk_size
        self.epsilon = float(epsilon)
        self.feature_dim = key_dim if self.feature_map is None else self.feature_map.feature_dim(key_dim)
        if self.compute_dtype == "float16" and not getattr(self.feature_map, "float16_safe", True):
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
        h, d, m, c = self.num_heads, self.key_dim, self.value_dim, self.feature_dim
        seed = self.seed
        if self.update == "delta":
            self.beta_kernel = self.add_weight(
                name="beta_kernel", shape=(h, d, h), initializer=self._fresh(self.kernel_initializer),
                dtype="float32", autocast=False,
            )
            self.beta_bias = self.add_weight(
                name="beta_bias", shape=(h,), initializer="zeros", dtype="float32", autocast=False
            )
        if self.decay == "scalar":
            # The gate starts slow and the same for every token: w = 0, A = 1 and
            # dt = softplus(b) log-uniform in [1e-3, 1e-2], so a head starts out
            # remembering about 100 to 1,000 tokens. Forgetting faster is easy to
            # learn; remembering longer is not, because the gradient reaching an
            # old token goes through the product of the decays since. Mamba2's
            # initialization (A in [1, 16], dt in [1e-3, 1e-1], a random w) gives a
            # single head a memory of 1.4 to 14 tokens in the MQAR model, and the
            # one-head Gated DeltaNet + conv4 stayed at chance at T=256 (docs/quality.md).
            self.gate_kernel = self.add_weight(
                name="gate_kernel", shape=(h, d, h), initializer="zeros", dtype="float32", autocast=False,
            )
            self.gate_bias = self.add_weight(
                name="gate_bias", shape=(h,), initializer=_inverse_softplus_of_log_uniform(1e-3, 1e-2, seed),
                dtype="float32", autocast=False,
            )
            self.a_log = self.add_weight(
                name="a_log", shape=(h,), initializer="zeros", dtype="float32", autocast=False,
            )
        elif self.decay == "channel":
            self.gate_down = self.add_weight(
                name="gate_down", shape=(h, d, CHANNEL_GATE_RANK), initializer=self._fresh(self.kernel_initializer),
                dtype="float32", autocast=False,
            )
            self.gate_up = self.add_weight(
                name="gate_up", shape=(CHANNEL_GATE_RANK, h, c), initializer=self._fresh(self.kernel_initializer),
                dtype="float32", autocast=False,
            )
            self.gate_bias = self.add_weight(
                name="gate_bias", shape=(h, c), initializer="zeros", dtype="float32", autocast=False
            )
        if self.conv_size is not None:
            bound = self.conv_size**-0.5  # PyTorch's Conv1d default, as fla's short convolutions

            def conv_init(index):
                return keras.initializers.RandomUniform(-bound, bound, seed=None if seed is None else seed + 10 + index)

            self.conv_q = self.add_weight(
                name="conv_q", shape=(self.conv_size, h, d), initializer=conv_init(0), dtype="float32",
                autocast=False,
            )
            self.conv_k = self.add_weight(
                name="conv_k", shape=(self.conv_size, h, d), initializer=conv_init(1), dtype="float32",
                autocast=False,
            )
            self.conv_v = self.add_weight(
                name="conv_v", shape=(self.conv_size, h, m), initializer=conv_init(2), dtype="float32",
                autocast=False,
            )
        if not self.normalize:
            self.output_norm_scale = self.add_weight(
                name="output_norm_scale", shape=(h, m), initializer="ones", dtype="float32", autocast=False
            )

    # ------------------------------------------------------------------- call
    def _features(self, q, k, causal, training, key_mask=None):
        """Feature-maps projected heads: ``q [B, T, H, D], k [B, S, H, D]`` -> ``[B, T, H, C], [B, S, H, C]``."""
        if self.feature_map is None:
            qf, kf = q, k  # the identity (update="delta")
        else:
            qf = self.feature_map(q, is_query=True, causal=causal, training=training)  # [B, T, H, C]
            # Maps with statistics over keys (favor+'s non-causal stabilizer) take the padding mask.
            params = getattr(self.feature_map, "call_signature_parameters", ())
            masked = {"key_mask": key_mask} if key_mask is not None and "key_mask" in params else {}
            kf = self.feature_map(k, is_query=False, causal=causal, training=training, **masked)  # [B, S, H, C]
        if self.update == "delta":
            qf, kf = _l2_normalize(qf), _l2_normalize(kf)
        return qf, kf

    def _compute_attention(self, query, key, value, key_mask=None, use_causal_mask=False, training=None,
                           initial_state=None):
        """Convolutions, feature maps, gates, then the attention of `ops`; returns ``(out, state)``.

        ``state`` is a tuple with one entry per `state_spec` item.
        """
        if not use_causal_mask and (self.decay is not None or self.window_size is not None or self.update == "delta"):
            raise ValueError(
                "`decay`, `window_size` and `update='delta'` define a causal recurrence: call the layer with "
                f"`use_causal_mask=True`. Received: decay={self.decay!r}, window_size={self.window_size!r}, "
                f"update={self.update!r}, use_causal_mask=False"
            )
        if initial_state is not None:
            _state.check_state(self.state_spec(), initial_state, name="initial_state")
            parts = self._split_state(initial_state)
        else:
            parts = {}
        # Padded keys enter the map as zeros, so maps with statistics over
        # keys (the non-causal stabilizers of favor+/favor_trig) never see
        # padded junk; their features are masked again after the map.
        key = la_ops._mask_keys(key, key_mask)  # [B, S, H, D]
        gate_input = key
        new_parts = {}
        if self.conv_size is not None:
            # The query sequence is the key sequence in causal self-attention:
            # its padding is the keys'.
            query_mask = key_mask if use_causal_mask else None
            query, new_parts["conv_q"] = conv_ops.causal_conv(
                query, self.conv_q, parts.get("conv_q"), query_mask, return_buffer=True
            )  # [B, T, H, D]
            key, new_parts["conv_k"] = conv_ops.causal_conv(
                key, self.conv_k, parts.get("conv_k"), key_mask, return_buffer=True
            )  # [B, S, H, D]
            value, new_parts["conv_v"] = conv_ops.causal_conv(
                value, self.conv_v, parts.get("conv_v"), key_mask, return_buffer=True
            )  # [B, S, H, M]
        s0 = None if initial_state is None or self.update == "delta" else (parts["S"], parts["z"])
        if self.window_size is not None:
            out, (s, z), buffers = self._window_attention(query, key, value, key_mask, parts, s0, training)
            new_parts.update(buffers)
        else:
            qf, kf = self._features(query, key, use_causal_mask, training, key_mask)  # [B, T, H, C], [B, S, H, C]
            if self.update == "delta":
                log_decay = None if self.decay is None else self._log_decay(gate_input)[..., 0]  # [B, S, H]
                out, s = delta_ops.delta_rule_attention(
                    qf, kf, value, self._beta(gate_input), log_decay,
                    key_mask=key_mask, chunk_size=self.chunk_size, initial_state=parts.get("S"), return_state=True,
                )  # [B, T, H, M]
                z = None
            elif self.decay is not None:
                out, (s, z) = decay_ops.gated_linear_attention(
                    qf, kf, value, self._log_decay(gate_input),
                    key_mask=key_mask, chunk_size=self.chunk_size, initial_state=s0, return_state=True,
                    normalize=self.normalize, eps=self.epsilon,
                )  # [B, T, H, M]
            else:
                out, (s, z) = la_ops.linear_attention(
                    qf, kf, value, causal=use_causal_mask, key_mask=key_mask, chunk_size=self.chunk_size,
                    initial_state=s0, return_state=True, eps=self.epsilon, normalize=self.normalize,
                )  # [B, T, H, M]
        new_parts.update(S=s, z=z)
        return self._output_norm(out), tuple(new_parts[entry.name] for entry in self.state_spec())

    def _beta(self, keys):
        """Delta-rule write strengths ``sigmoid(w . k + c)`` from the projected keys ``[B, S, H, D]``: ``[B, S, H]``."""
        x = ops.cast(keys, "float32")  # [B, S, H, D]
        return ops.sigmoid(ops.einsum("bshd,hdg->bsg", x, self.beta_kernel) + self.beta_bias)  # [B, S, H]

    def _window_attention(self, query, key, value, key_mask, parts, s0, training):
        """The sliding-window hybrid over a piece, with the buffered keys in front."""
        w = self.window_size
        batch = ops.shape(key)[0]
        h, d, m = self.num_heads, self.key_dim, self.value_dim
        if "window_k" in parts:
            buf_k, buf_v, buf_ok = parts["window_k"], parts["window_v"], parts["window_valid"]
        else:
            buf_k = ops.zeros((batch, w, h, d), "float32")
            buf_v = ops.zeros((batch, w, h, m), "float32")
            buf_ok = ops.zeros((batch, w), "float32")
        real = ops.ones(ops.shape(key)[:2], "float32") if key_mask is None else ops.cast(key_mask, "float32")
        k_all = ops.concatenate([ops.cast(buf_k, key.dtype), key], axis=1)  # [B, W + S, H, D]
        v_all = ops.concatenate([ops.cast(buf_v, value.dtype), value], axis=1)  # [B, W + S, H, M]
        ok_all = ops.concatenate([ops.cast(buf_ok, "float32"), real], axis=1)  # [B, W + S]
        qf, kf_all = self._features(query, k_all, True, training)  # [B, T, H, C], [B, W + S, H, C]
        out, state = window_ops.window_attention(
            query, qf, k_all, kf_all, v_all, w, ok_all > 0, initial_state=s0, return_state=True,
            chunk_size=self.chunk_size, eps=self.epsilon,
        )  # [B, T, H, M]
        buffers = {
            "window_k": ops.cast(k_all[:, -w:], "float32"),
            "window_v": ops.cast(la_ops._mask_keys(v_all, ok_all > 0)[:, -w:], "float32"),
            "window_valid": ok_all[:, -w:],
        }
        return out, state, buffers

    def _log_decay(self, keys):
        """``log a_t`` from the projected keys ``[B, S, H, D]``: ``[B, S, H, 1]`` or ``[B, S, H, C]`` (float32)."""
        if self.decay == "fixed":
            log_gamma = ops.convert_to_tensor(_fixed_log_decay(self.num_heads))  # [H]
            return ops.zeros(ops.shape(keys)[:3], "float32")[..., None] + log_gamma[:, None]  # [B, S, H, 1]
        x = ops.cast(keys, "float32")  # [B, S, H, D]
        if self.decay == "scalar":
            dt = ops.softplus(ops.einsum("bshd,hdg->bsg", x, self.gate_kernel) + self.gate_bias)  # [B, S, H]
            return (-ops.exp(self.a_log) * dt)[..., None]  # [B, S, H, 1]
        low = ops.einsum("bshd,hdr->bsr", x, self.gate_down)  # [B, S, R]
        logits = ops.einsum("bsr,rhc->bshc", low, self.gate_up) + self.gate_bias  # [B, S, H, C]
        return ops.log_sigmoid(logits) / CHANNEL_GATE_TEMPERATURE  # [B, S, H, C]

    def _output_norm(self, out):
        """``normalize=False``: per-head RMSNorm of ``[..., H, M]`` with a learned scale (float32)."""
        if self.normalize:
            return out
        x = ops.cast(out, "float32")
        x = x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + OUTPUT_NORM_EPSILON)
        return x * self.output_norm_scale

    # -------------------------------------------------------- recurrent API
    def state_spec(self):
        """The recurrent state, described once: a list of `StateSpec` (shapes without the batch dim).

        ``S [H, C, M]``, and ``z [H, C]`` unless ``update="delta"``; with `conv_size` K, the
        last ``K - 1`` convolution inputs ``conv_q [K-1, H, D]``,
        ``conv_k [K-1, H, D]``, ``conv_v [K-1, H, M]``; with `window_size` W,
        the window's buffer ``window_k [W, H, D]``, ``window_v [W, H, M]``
        and ``window_valid [W]`` (1 = a real key). All float32 and of a size
        that does not depend on the length. `get_initial_state`, the state
        checks, `LinearAttentionCell`'s flat state and the exported ``step``
        signatures are derived from it.
        """
        h, c, m, d = self.num_heads, self.feature_dim, self.value_dim, self.key_dim
        spec = [_state.StateSpec("S", (h, c, m), "float32")]
        if self.update == "add":
            spec.append(_state.StateSpec("z", (h, c), "float32"))
        if self.conv_size is not None:
            k = self.conv_size - 1
            spec += [
                _state.StateSpec("conv_q", (k, h, d), "float32"),
                _state.StateSpec("conv_k", (k, h, d), "float32"),
                _state.StateSpec("conv_v", (k, h, m), "float32"),
            ]
        if self.window_size is not None:
            w = self.window_size
            spec += [
                _state.StateSpec("window_k", (w, h, d), "float32"),
                _state.StateSpec("window_v", (w, h, m), "float32"),
                _state.StateSpec("window_valid", (w,), "float32"),
            ]
        return spec

    def _split_state(self, state):
        return {entry.name: ops.cast(x, "float32") for entry, x in zip(self.state_spec(), state)}

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
                raise ValueError(
                    f"`{name}` must have rank 2 [batch, dim]. Received: {name}.shape={tuple(x.shape)}"
                )
        batch = query_t.shape[0]
        _state.check_state(self.state_spec(), state, batch_size=batch, name="state")
        if not self.built:
            self.build(
                (None, None, query_t.shape[-1]), (None, None, value_t.shape[-1]), (None, None, key_t.shape[-1])
            )
        parts = self._split_state(state)
        new_parts = {}
        q, k, v = self.project(query_t[:, None], value_t[:, None], key_t[:, None])  # [B, 1, H, D|D|M]
        gate_input = k
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [B, H, D|D|M]
        if self.conv_size is not None:
            q, new_parts["conv_q"] = conv_ops.causal_conv_step(q, self.conv_q, parts["conv_q"])  # [B, H, D]
            k, new_parts["conv_k"] = conv_ops.causal_conv_step(k, self.conv_k, parts["conv_k"])  # [B, H, D]
            v, new_parts["conv_v"] = conv_ops.causal_conv_step(v, self.conv_v, parts["conv_v"])  # [B, H, M]
        state_sz = (parts["S"], parts.get("z"))
        if self.update == "delta":
            qf, kf = self._features(q[:, None], k[:, None], True, training)  # [B, 1, H, C]
            log_decay = None if self.decay is None else self._log_decay(gate_input)[:, 0, :, 0]  # [B, H]
            out, s_new = delta_ops.delta_rule_step(
                qf[:, 0], kf[:, 0], v, self._beta(gate_input)[:, 0], parts["S"], log_decay
            )  # [B, H, M]
            state_sz = (s_new, None)
        elif self.window_size is not None:
            buf_k = parts["window_k"]  # [B, W, H, D]
            # The oldest buffered key leaves the window now: its features join (S, z).
            qf, kf_old = self._features(q[:, None], ops.cast(buf_k[:, :1], q.dtype), True, training)
            out, state_sz, (wk, wv, wok) = window_ops.window_attention_step(
                q, qf[:, 0], k, v, kf_old[:, 0], (buf_k, parts["window_v"], parts["window_valid"]), state_sz,
                eps=self.epsilon,
            )  # [B, H, M]
            new_parts.update(window_k=wk, window_v=wv, window_valid=wok)
        else:
            qf, kf = self._features(q[:, None], k[:, None], True, training)  # [B, 1, H, C], [B, 1, H, C]
            if self.decay is not None:
                out, state_sz = decay_ops.gated_linear_attention_step(
                    qf[:, 0], kf[:, 0], v, self._log_decay(gate_input)[:, 0], state_sz,
                    normalize=self.normalize, eps=self.epsilon,
                )  # [B, H, M]
            else:
                out, state_sz = la_ops.linear_attention_step(
                    qf[:, 0], kf[:, 0], v, state_sz, eps=self.epsilon, normalize=self.normalize
                )  # [B, H, M]
        new_parts["S"], new_parts["z"] = state_sz
        out = ops.cast(self._output_norm(out), self.compute_dtype)
        out = self.project_output(out[:, None], training)  # [B, 1, out_dim]
        return out[:, 0], tuple(new_parts[entry.name] for entry in self.state_spec())

    # ----------------------------------------------------------------- config
    def get_config(self):
        return {
            **super().get_config(),
            "feature_map": _serialize_map(self.feature_map),
            "chunk_size": self.chunk_size,
            "epsilon": self.epsilon,
            "decay": self.decay,
            "normalize": self.normalize,
            "conv_size": self.conv_size,
            "window_size": self.window_size,
            "update": self.update,
        }
