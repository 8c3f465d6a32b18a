"""The sliding-window hybrid: exact softmax over the last W tokens, linear attention over older ones.

Wraps `keras_linattn.ops.window_attention` (the buffered keys in front of
the piece), `window_attention_step` (a fixed ring of W keys and values;
the oldest joins ``(S, z)`` as it leaves) and `window_attention_reference`.
"""

import math

import keras
from keras import ops

from keras_linattn import _state, _validation
from keras_linattn.ops import window as window_ops
from keras_linattn.ops._common import _mask_keys
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.registry import register

__all__ = ["WindowRecurrence"]


# The largest accepted initial `linear_weight`: the square root of float32's largest number (about 2**128), so
# that the weight times a float32 feature or sum of up to the same size does not overflow. At 3e38 the weighted
# numerator and normalizer overflow to inf (NaN in every row). Small weights are accepted: one that underflows
# the linear terms toward 0 leaves the window's softmax, which is what a tiny weight asks for.
LINEAR_WEIGHT_MAX = 2.0**63


@register("window")
class WindowRecurrence(Recurrence):
    """Softmax attention over the last `window_size` tokens plus linear attention over every older token.

    One normalizer is shared by the two parts (so the readout is always
    normalized). The decode state is ``(S, z)`` of the keys older than the
    window and a fixed buffer of the last W keys and values.

    Args:
        window_size: W, a positive int (the query's own token included).
        gamma: None (default: the softmax and linear terms weigh the same)
            or the initial value, in (0, 1), of a learned per-head weight
            ``gamma = sigmoid(g)`` of the softmax terms (LoLCATs: 0.1). The
            weight ``window_gamma_logit [H]`` (g, float32) is trainable; with
            ``W >= T`` gamma cancels and the output is exact softmax attention.
        linear_weight: None (default: the linear terms weigh 1) or the
            initial value, in (0, 2**63], of a learned per-head weight
            ``lambda = exp(l)`` of the linear terms (in the numerator and
            the normalizer; the weight ``window_linear_weight_log [H]``,
            float32, trainable). It is applied to the query features, so it
            is one multiply per query. The softmax terms are at most 1 each
            (the largest is 1, or gamma), while the linear terms of a long
            past add up: with hedgehog maps at copy, 256 older tokens weigh
            about 16 and a sharp window match is lost. A small
            `linear_weight` (0.001 on `benchmarks/bench_recall.py`) lets a linearized student start close
            to its window's attention. With ``W >= T`` it cancels like gamma.
            ``0`` removes the linear terms (no weight is learned): the
            window alone, exact softmax attention over the last W tokens,
            for a teacher layer that is already local (Mistral's sliding
            window within the student's).
        linear_rope: True (default): with rotary embeddings on the layer,
            the linear part's features are those of the rotated queries and
            keys, as the window's softmax. False: the features of the
            queries and keys before the rotation (the window's softmax keeps
            its rotary embedding). The softmax window only ever sees
            relative distances below W, but the feature map of a rotated
            key depends on its absolute position, so positions past the
            training length reach the linear part; unrotated features do
            not depend on position. The window's buffer then also keeps the
            unrotated keys (``window_k_plain [W, H, D]`` in the state).
            Without rotary embeddings it changes nothing.
        linear_mean: False (default): the linear terms are a sum over the
            keys older than the window. True: their mean (the sum divided by
            the number of those keys, counted in the state as
            ``linear_count []``), so the linear part's share of the shared
            normalizer does not grow with the length of the past; the
            learned `linear_weight` then weighs the mean.

    Grouped-query attention: the G query heads of a group read the same key
    and value, so without a short convolution (whose per-head kernels would
    make them differ) the buffers keep the layer's key/value heads
    (`buffer_heads`, ``window_k [W, H / G, D]``) and repeat them when they
    are read: at Llama 3.2 1B's 32/8 heads, a quarter of the buffer.

    Logit soft cap: a layer with ``logit_soft_cap=c`` (`LinearAttention`,
    Gemma 2's attention) gets its window scores capped, ``c * tanh(s / c)``,
    before the softmax. The linear terms cannot be capped (they are a kernel
    of the query and the key, not of the score): with ``W >= T`` the output
    is the capped softmax exactly.
    """

    # The window's softmax scores take the layer's `logit_soft_cap` (the spec refuses it for other recurrences).
    caps_logits = True

    contract_configs = (
        {"window_size": 3},
        {"window_size": 3, "gamma": 0.25},
        {"window_size": 2, "gamma": 0.5, "linear_weight": 0.3},
        {"window_size": 3, "linear_rope": False, "linear_mean": True},
    )

    def __init__(self, window_size, gamma=None, linear_weight=None, linear_rope=True, linear_mean=False):
        super().__init__()
        self.window_size = _validation.check_positive_int("window_size", window_size)
        if gamma is not None and (not _validation._is_real(gamma) or not 0.0 < gamma < 1.0):
            raise ValueError(
                "`gamma` (the window's initial softmax weight, sigmoid of a learned logit) must be None or "
                f"a number in (0, 1). Received: gamma={gamma!r}"
            )
        self.gamma = None if gamma is None else float(gamma)
        if linear_weight is not None and (
            not _validation._is_real(linear_weight) or not 0.0 <= linear_weight <= LINEAR_WEIGHT_MAX
        ):
            raise ValueError(
                "`linear_weight` (the initial weight of the linear terms, exp of a learned float32 log) must be "
                "None, 0 (the window alone) or a number in (0, 2**63]: it multiplies float32 features and sums, "
                "and a weight above the square root of float32's largest number overflows them (NaN outputs). "
                f"Received: linear_weight={linear_weight!r}"
            )
        self.linear_weight = None if linear_weight is None else float(linear_weight)
        self.linear_rope = _validation.check_bool("linear_rope", linear_rope)
        self.linear_mean = _validation.check_bool("linear_mean", linear_mean)

    @property
    def reads_unrotated(self):
        """True when the linear part's features read the queries and keys before the rotary embedding."""
        return not self.linear_rope

    def get_config(self):
        config = {"window_size": self.window_size}
        if self.gamma is not None:  # configs without a gamma stay as they were
            config["gamma"] = self.gamma
        if self.linear_weight is not None:
            config["linear_weight"] = self.linear_weight
        if not self.linear_rope:  # configs with the defaults stay as they were
            config["linear_rope"] = False
        if self.linear_mean:
            config["linear_mean"] = True
        return config

    def build(self, layer):
        super().build(layer)
        self.gamma_logit = None
        if self.gamma is not None:
            logit = math.log(self.gamma / (1.0 - self.gamma))
            self.gamma_logit = self.add_weight(
                "window_gamma_logit", (self.num_heads,), keras.initializers.Constant(logit)
            )  # [H]
        self.linear_weight_log = None
        if self.linear_weight:  # None: weight 1; 0: no linear terms, nothing learned
            self.linear_weight_log = self.add_weight(
                "window_linear_weight_log",
                (self.num_heads,),
                keras.initializers.Constant(math.log(self.linear_weight)),
            )  # [H]

    def features(self, x, is_query, causal=True, training=None, key_mask=None):
        """``phi(x)``; a query's features times the linear weight ``exp(l) [H]`` when there is one."""
        f = super().features(x, is_query, causal, training, key_mask)
        if is_query and self.linear_weight == 0.0:
            return ops.zeros_like(f)  # the window alone: the linear terms add 0 to numerator and normalizer
        if not is_query or self.linear_weight_log is None:
            return f
        weight = ops.cast(ops.exp(self.linear_weight_log), f.dtype)  # [H]
        return f * weight[:, None]  # features [..., H, C]

    @property
    def buffer_heads(self):
        """The heads of the key/value buffers: the layer's key/value heads, or H with a short convolution."""
        heads = getattr(self.layer, "key_value_heads", self.num_heads)
        if heads == self.num_heads or getattr(self.layer, "conv_size", None) is not None:
            return self.num_heads
        return heads

    def _expand(self, x):
        """A buffer ``[B, W, buffer_heads, ...]`` as the H heads that read it (head h reads h // G)."""
        groups = self.num_heads // self.buffer_heads
        return x if groups == 1 else ops.repeat(x, groups, axis=2)

    def _shrink(self, x, axis=2):
        """Keys or values of the H heads (on `axis`: ``[B, W, H, ...]``) -> one head per group (a group's are equal)."""
        groups = self.num_heads // self.buffer_heads
        return x if groups == 1 else x[(slice(None),) * axis + (slice(None, None, groups),)]

    def _mean_scale(self, count, dtype):
        """``1 / max(count, 1)`` as ``[B, T, 1, 1]`` for ``count [B, T]`` (older keys per query)."""
        wide = "float64" if dtype == "float64" else "float32"  # counts are exact in both (below 2**24)
        scale = 1.0 / ops.maximum(ops.cast(count, wide), ops.cast(1.0, wide))  # [B, T]
        return ops.cast(scale, dtype)[:, :, None, None]

    def _older_scale(self, older, dtype):
        """The mean's ``1 / max(n, 1)`` for ``n`` older real keys ``[B, T]`` (the sparse cache subtracts its N)."""
        return self._mean_scale(older, dtype)

    def _piece_features(self, q, k, k_all, ok_all, state, training, unrotated):
        """``(qf [B, T, H, C], kf_all [B, W + S, H, C], new)`` of a piece, with the length options applied.

        ``k_all`` is the window buffer followed by the piece's keys and
        ``ok_all`` their validity. ``new`` holds the state entries the options
        add: ``window_k_plain`` (``linear_rope=False``: the features read the
        unrotated keys) and ``linear_count`` (``linear_mean=True``: the query
        features are scaled by `_older_scale` of the older real keys).
        """
        w = self.window_size
        q_lin, kp_all = q, k_all
        new = {}
        if not self.linear_rope:
            q_lin, k_plain = (q, k) if unrotated is None else unrotated
            plain = self._expand(ops.cast(state["window_k_plain"], k.dtype))
            kp_all = ops.concatenate([plain, k_plain], axis=1)  # [B, W + S, H, D]
            new["window_k_plain"] = self._shrink(ops.cast(kp_all[:, -w:], "float32"))
        qf = self.features(q_lin, True, True, training)  # [B, T, H, C]
        kf_all = self.features(kp_all, False, True, training)  # [B, W + S, H, C]
        if self.linear_mean:
            # Query i (slot W + i of k_all) reads the linear state of slots 0..i and the carried count.
            older = state["linear_count"][:, None] + ops.cumsum(ok_all, axis=1)[:, : ops.shape(q)[1]]  # [B, T]
            qf = qf * self._older_scale(older, qf.dtype)
            new["linear_count"] = state["linear_count"] + ops.sum(ok_all[:, :-w], axis=1)  # [B]
        return qf, kf_all, new

    def _step_features(self, q, k, oldest_k, state, training, unrotated):
        """``(qf [B, 1, H, C], kf_old [B, 1, H, C], new)`` of one step, with the length options applied.

        ``kf_old`` are the features of the oldest buffered key, the one that
        leaves the window now; ``oldest_k [B, 1, H, D]`` is that key, expanded
        to the H heads. ``new`` as in `_piece_features`.
        """
        q_lin, old_lin = q, oldest_k
        new = {}
        if not self.linear_rope:
            q_lin, k_plain = (q, k) if unrotated is None else unrotated
            plain = state["window_k_plain"]  # [B, W, buffer_heads, D]
            old_lin = self._expand(plain[:, :1])  # [B, 1, H, D]
            shifted = ops.concatenate([plain[:, 1:], self._shrink(ops.cast(k_plain, "float32")[:, None])], axis=1)
            new["window_k_plain"] = shifted  # [B, W, buffer_heads, D]
        qf = self.features(ops.expand_dims(q_lin, 1), True, True, training)  # [B, 1, H, C]
        kf_old = self.features(ops.cast(old_lin, q.dtype), False, True, training)  # [B, 1, H, C]
        if self.linear_mean:
            count = state["linear_count"] + state["window_valid"][:, 0]  # [B]
            qf = qf * self._older_scale(count[:, None], qf.dtype)
            new["linear_count"] = count
        return qf, kf_old, new

    def _soft_cap(self):
        """The layer's ``logit_soft_cap`` (None without one)."""
        return getattr(self.layer, "logit_soft_cap", None)

    def _gamma(self):
        """``sigmoid(g) [H]`` float32, or None without a gamma."""
        return None if self.gamma is None else ops.sigmoid(self.gamma_logit)

    def state_spec(self):
        h, c, m = self.num_heads, self.feature_dim, self.value_dim
        return [_state.StateSpec("S", (h, c, m), "float32"), _state.StateSpec("z", (h, c), "float32")]

    def buffer_spec(self):
        w, h, d, m = self.window_size, self.buffer_heads, self.key_dim, self.value_dim
        spec = [
            _state.StateSpec("window_k", (w, h, d), "float32"),
            _state.StateSpec("window_v", (w, h, m), "float32"),
            _state.StateSpec("window_valid", (w,), "float32"),
        ]
        if not self.linear_rope:
            spec.append(_state.StateSpec("window_k_plain", (w, h, d), "float32"))
        if self.linear_mean:
            spec.append(_state.StateSpec("linear_count", (), "float32"))
        return spec

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None, unrotated=None):
        """The parallel form; ``unrotated=(q, k)`` before the rotary embedding when `reads_unrotated`."""
        w = self.window_size
        if state is None:
            state = self.zeros_like_spec(self.buffer_spec(), ops.shape(k)[0])
            s0 = None
        else:
            s0 = (state["S"], state["z"])
        real = ops.ones(ops.shape(k)[:2], "float32") if key_mask is None else ops.cast(key_mask, "float32")
        k_all = ops.concatenate([self._expand(ops.cast(state["window_k"], k.dtype)), k], axis=1)  # [B, W + S, H, D]
        v_all = ops.concatenate([self._expand(ops.cast(state["window_v"], v.dtype)), v], axis=1)  # [B, W + S, H, M]
        ok_all = ops.concatenate([ops.cast(state["window_valid"], "float32"), real], axis=1)  # [B, W + S]
        qf, kf_all, new = self._piece_features(q, k, k_all, ok_all, state, training, unrotated)
        out, (s, z) = window_ops.window_attention(
            q,
            qf,
            k_all,
            kf_all,
            v_all,
            w,
            ok_all > 0,
            initial_state=s0,
            return_state=True,
            chunk_size=self.layer.chunk_size,
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            soft_cap=self._soft_cap(),
        )  # [B, T, H, M]
        return out, {
            "S": s,
            "z": z,
            "window_k": self._shrink(ops.cast(k_all[:, -w:], "float32")),
            "window_v": self._shrink(ops.cast(_mask_keys(v_all, ok_all > 0)[:, -w:], "float32")),
            "window_valid": ok_all[:, -w:],
            **new,
        }

    def step(self, q, k, v, gate_keys, state, training=None, unrotated=None):
        """One step; ``unrotated=(q, k) [B, H, D]`` before the rotary embedding when `reads_unrotated`."""
        # The oldest buffered key leaves the window now: its features join (S, z).
        oldest_k = self._expand(state["window_k"][:, :1])  # [B, 1, H, D]
        qf, kf_old, new = self._step_features(q, k, oldest_k, state, training, unrotated)
        # The buffers stay at their buffer_heads: the op reads them per group (never repeated to H).
        out, (s, z), (wk, wv, wok) = window_ops.window_attention_step(
            q,
            ops.squeeze(qf, axis=1),  # [B, H, C]
            self._shrink(k, axis=1),  # [B, buffer_heads, D]
            self._shrink(v, axis=1),  # [B, buffer_heads, M]
            ops.squeeze(kf_old, axis=1)
            if kf_old.shape[1] == 1
            else kf_old[:, 0],  # [B, H, C] (a buffer of unknown W: [:, 0])
            (state["window_k"], state["window_v"], state["window_valid"]),
            (state["S"], state["z"]),
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            soft_cap=self._soft_cap(),
        )  # [B, H, M]
        return out, {"S": s, "z": z, "window_k": wk, "window_v": wv, "window_valid": wok, **new}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None, unrotated=None):
        q_lin, k_lin = (q, k) if self.linear_rope or unrotated is None else unrotated
        qf = self.features(q_lin, True, True, training)
        kf = self.features(k_lin, False, True, training)
        if self.linear_mean:
            # Older keys of query i: the real keys at positions j <= i - W, counted from the [T, T] pattern.
            t = ops.shape(q)[1]
            i = ops.arange(t)[:, None]
            j = ops.arange(t)[None, :]
            real = ops.ones(ops.shape(q)[:2], qf.dtype) if key_mask is None else ops.cast(key_mask, qf.dtype)
            older = ops.cast(j <= i - self.window_size, qf.dtype)  # [T, T]
            qf = qf * self._mean_scale(ops.einsum("ts,bs->bt", older, real), qf.dtype)
        return window_ops.window_attention_reference(
            q,
            qf,
            k,
            kf,
            v,
            self.window_size,
            key_mask,
            eps=self.layer.epsilon,
            gamma=self._gamma(),
            soft_cap=self._soft_cap(),
        )
