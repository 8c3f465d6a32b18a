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
            initial value, > 0, of a learned per-head weight
            ``lambda = exp(l)`` of the linear terms (in the numerator and
            the normalizer; the weight ``window_linear_weight_log [H]``,
            float32, trainable). It is applied to the query features, so it
            is one multiply per query. The softmax terms are at most 1 each
            (the largest is 1, or gamma), while the linear terms of a long
            past add up: with hedgehog maps at copy, 256 older tokens weigh
            about 16 and a sharp window match is lost. A small
            `linear_weight` (0.001 on `benchmarks/bench_recall.py`) lets a linearized student start close
            to its window's attention. With ``W >= T`` it cancels like gamma.
    """

    contract_configs = (
        {"window_size": 3},
        {"window_size": 3, "gamma": 0.25},
        {"window_size": 2, "gamma": 0.5, "linear_weight": 0.3},
    )

    def __init__(self, window_size, gamma=None, linear_weight=None):
        super().__init__()
        self.window_size = _validation.check_positive_int("window_size", window_size)
        if gamma is not None and (not _validation._is_real(gamma) or not 0.0 < gamma < 1.0):
            raise ValueError(
                "`gamma` (the window's initial softmax weight, sigmoid of a learned logit) must be None or "
                f"a number in (0, 1). Received: gamma={gamma!r}"
            )
        self.gamma = None if gamma is None else float(gamma)
        if linear_weight is not None and (
            not _validation._is_real(linear_weight) or not 0.0 < linear_weight < math.inf
        ):
            raise ValueError(
                "`linear_weight` (the initial weight of the linear terms, exp of a learned log) must be None "
                f"or a finite number > 0. Received: linear_weight={linear_weight!r}"
            )
        self.linear_weight = None if linear_weight is None else float(linear_weight)

    def get_config(self):
        config = {"window_size": self.window_size}
        if self.gamma is not None:  # configs without a gamma stay as they were
            config["gamma"] = self.gamma
        if self.linear_weight is not None:
            config["linear_weight"] = self.linear_weight
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
        if self.linear_weight is not None:
            self.linear_weight_log = self.add_weight(
                "window_linear_weight_log",
                (self.num_heads,),
                keras.initializers.Constant(math.log(self.linear_weight)),
            )  # [H]

    def features(self, x, is_query, causal=True, training=None, key_mask=None):
        """``phi(x)``; a query's features times the linear weight ``exp(l) [H]`` when there is one."""
        f = super().features(x, is_query, causal, training, key_mask)
        if not is_query or self.linear_weight_log is None:
            return f
        weight = ops.cast(ops.exp(self.linear_weight_log), f.dtype)  # [H]
        return f * weight[:, None]  # features [..., H, C]

    def _gamma(self):
        """``sigmoid(g) [H]`` float32, or None without a gamma."""
        return None if self.gamma is None else ops.sigmoid(self.gamma_logit)

    def state_spec(self):
        h, c, m = self.num_heads, self.feature_dim, self.value_dim
        return [_state.StateSpec("S", (h, c, m), "float32"), _state.StateSpec("z", (h, c), "float32")]

    def buffer_spec(self):
        w, h, d, m = self.window_size, self.num_heads, self.key_dim, self.value_dim
        return [
            _state.StateSpec("window_k", (w, h, d), "float32"),
            _state.StateSpec("window_v", (w, h, m), "float32"),
            _state.StateSpec("window_valid", (w,), "float32"),
        ]

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        w = self.window_size
        if state is None:
            state = self.zeros_like_spec(self.buffer_spec(), ops.shape(k)[0])
            s0 = None
        else:
            s0 = (state["S"], state["z"])
        real = ops.ones(ops.shape(k)[:2], "float32") if key_mask is None else ops.cast(key_mask, "float32")
        k_all = ops.concatenate([ops.cast(state["window_k"], k.dtype), k], axis=1)  # [B, W + S, H, D]
        v_all = ops.concatenate([ops.cast(state["window_v"], v.dtype), v], axis=1)  # [B, W + S, H, M]
        ok_all = ops.concatenate([ops.cast(state["window_valid"], "float32"), real], axis=1)  # [B, W + S]
        qf = self.features(q, True, True, training)  # [B, T, H, C]
        kf_all = self.features(k_all, False, True, training)  # [B, W + S, H, C]
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
        )  # [B, T, H, M]
        return out, {
            "S": s,
            "z": z,
            "window_k": ops.cast(k_all[:, -w:], "float32"),
            "window_v": ops.cast(_mask_keys(v_all, ok_all > 0)[:, -w:], "float32"),
            "window_valid": ok_all[:, -w:],
        }

    def step(self, q, k, v, gate_keys, state, training=None):
        buf_k = state["window_k"]  # [B, W, H, D]
        # The oldest buffered key leaves the window now: its features join (S, z).
        qf = self.features(q[:, None], True, True, training)  # [B, 1, H, C]
        kf_old = self.features(ops.cast(buf_k[:, :1], q.dtype), False, True, training)  # [B, 1, H, C]
        out, (s, z), (wk, wv, wok) = window_ops.window_attention_step(
            q,
            qf[:, 0],
            k,
            v,
            kf_old[:, 0],
            (buf_k, state["window_v"], state["window_valid"]),
            (state["S"], state["z"]),
            eps=self.layer.epsilon,
            gamma=self._gamma(),
        )  # [B, H, M]
        return out, {"S": s, "z": z, "window_k": wk, "window_v": wv, "window_valid": wok}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        qf = self.features(q, True, True, training)
        kf = self.features(k, False, True, training)
        return window_ops.window_attention_reference(
            q, qf, k, kf, v, self.window_size, key_mask, eps=self.layer.epsilon, gamma=self._gamma()
        )
