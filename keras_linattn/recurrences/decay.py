"""The decaying recurrence: ``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` with fixed, scalar or channel gates.

Wraps `keras_linattn.ops.gated_linear_attention` (chunked with the decay
inside chunks as differences of cumulative log decays),
`gated_linear_attention_step` and `gated_linear_attention_reference`. The
gates (`_add_gate_weights`, `_gate_log_decay`) are shared with the gated
delta rule.
"""

import math

import keras
import numpy as np
from keras import ops

from keras_linattn import _state, _validation
from keras_linattn.ops import decay as decay_ops
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.registry import register

__all__ = ["DecayRecurrence"]

GATES = ("fixed", "scalar", "channel")
# GLA's gate-logit normalizer: log a = logsigmoid(x W) / 16 keeps gates near 1 at initialization.
CHANNEL_GATE_TEMPERATURE = 16.0
# Rank of the low-rank projection of the per-channel gates (as in GLA).
CHANNEL_GATE_RANK = 16


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


def _add_gate_weights(recurrence, gate):
    """Creates the weights of `gate` (``"fixed"``: none) on the recurrence's layer."""
    layer = recurrence.layer
    h, d, c = recurrence.num_heads, recurrence.key_dim, recurrence.feature_dim
    if gate == "scalar":
        # The gate starts slow and the same for every token: w = 0, A = 1 and
        # dt = softplus(b) log-uniform in [1e-3, 1e-2], so a head starts out
        # remembering about 100 to 1,000 tokens. Forgetting faster is easy to
        # learn; remembering longer is not, because the gradient reaching an
        # old token goes through the product of the decays since. Mamba2's
        # initialization (A in [1, 16], dt in [1e-3, 1e-1], a random w) gives a
        # single head a memory of 1.4 to 14 tokens in the MQAR model, and the
        # one-head Gated DeltaNet + conv4 stayed at chance at T=256 (docs/dev/quality.md).
        recurrence.gate_kernel = recurrence.add_weight("gate_kernel", (h, d, h), "zeros")
        recurrence.gate_bias = recurrence.add_weight(
            "gate_bias", (h,), _inverse_softplus_of_log_uniform(1e-3, 1e-2, layer.seed)
        )
        recurrence.a_log = recurrence.add_weight("a_log", (h,), "zeros")
    elif gate == "channel":
        recurrence.gate_down = recurrence.add_weight(
            "gate_down", (h, d, CHANNEL_GATE_RANK), layer._fresh(layer.kernel_initializer)
        )
        recurrence.gate_up = recurrence.add_weight(
            "gate_up", (CHANNEL_GATE_RANK, h, c), layer._fresh(layer.kernel_initializer)
        )
        recurrence.gate_bias = recurrence.add_weight("gate_bias", (h, c), "zeros")


def _gate_log_decay(recurrence, gate, keys):
    """``log a_t`` from the projected keys ``[B, S, H, D]``: ``[B, S, H, 1]`` or ``[B, S, H, C]`` (float32)."""
    if gate == "fixed":
        log_gamma = ops.convert_to_tensor(_fixed_log_decay(recurrence.num_heads))  # [H]
        return ops.zeros(ops.shape(keys)[:3], "float32")[..., None] + log_gamma[:, None]  # [B, S, H, 1]
    x = ops.cast(keys, "float32")  # [B, S, H, D]
    if gate == "scalar":
        dt = ops.softplus(ops.einsum("bshd,hdg->bsg", x, recurrence.gate_kernel) + recurrence.gate_bias)  # [B, S, H]
        return (-ops.exp(recurrence.a_log) * dt)[..., None]  # [B, S, H, 1]
    low = ops.einsum("bshd,hdr->bsr", x, recurrence.gate_down)  # [B, S, R]
    logits = ops.einsum("bsr,rhc->bshc", low, recurrence.gate_up) + recurrence.gate_bias  # [B, S, H, C]
    return ops.log_sigmoid(logits) / CHANNEL_GATE_TEMPERATURE  # [B, S, H, C]


def _decay_conditioning(log_decay):
    """1 + the largest summed ``|log a|`` over time: how far the chunked exponents reach (docs/dev/testing.md)."""
    g = np.abs(np.asarray(ops.convert_to_numpy(log_decay), "float64"))
    return 1.0 + float(g.sum(axis=1).max()) if g.size else 1.0


@register("decay")
class DecayRecurrence(Recurrence):
    """``S_t = a_t S_{t-1} + phi(k_t) v_t^T`` (and ``z_t = a_t z_{t-1} + phi(k_t)``).

    Args:
        gate: ``"fixed"`` (default): RetNet's ``a = 1 - 2^(-5-h)`` for head
            h. ``"scalar"``: one data-dependent gate per head and token,
            ``a_t = exp(-exp(A_log) * softplus(w . k_t + b))`` (Mamba2's
            form; it starts slow and token-independent: ``w = 0``,
            ``A_log = 0``, ``softplus(b)`` log-uniform in [1e-3, 1e-2]).
            ``"channel"``: one gate per head and feature channel,
            ``log a_t = logsigmoid(k_t W_1 W_2 + b) / 16`` (GLA, low-rank
            16). The gates read the projected keys of all heads.
        normalize: True (default) divides by ``phi(q) . z``; False drops the
            denominator (the layer's output RMSNorm instead).
    """

    contract_configs = ({"gate": "fixed"}, {"gate": "scalar"}, {"gate": "channel", "normalize": False})

    def __init__(self, gate="fixed", normalize=True):
        super().__init__()
        self.gate = _validation.check_one_of("gate", gate, GATES)
        self.normalize = _validation.check_bool("normalize", normalize)

    def get_config(self):
        return {"gate": self.gate, "normalize": self.normalize}

    def build(self, layer):
        super().build(layer)
        _add_gate_weights(self, self.gate)

    def log_decay(self, keys):
        """``log a_t`` ``[B, S, H, 1|C]`` from the projected keys ``[B, S, H, D]``."""
        return _gate_log_decay(self, self.gate, keys)

    def state_spec(self):
        h, c, m = self.num_heads, self.feature_dim, self.value_dim
        return [_state.StateSpec("S", (h, c, m), "float32"), _state.StateSpec("z", (h, c), "float32")]

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        qf = self.features(q, True, causal, training)  # [B, T, H, C]
        kf = self.features(k, False, causal, training, key_mask)  # [B, S, H, C]
        out, (s, z) = decay_ops.gated_linear_attention(
            qf,
            kf,
            v,
            self.log_decay(gate_keys),
            key_mask=key_mask,
            chunk_size=self.layer.chunk_size,
            initial_state=None if state is None else (state["S"], state["z"]),
            return_state=True,
            normalize=self.normalize,
            eps=self.layer.epsilon,
        )  # [B, T, H, M]
        return out, {"S": s, "z": z}

    def step(self, q, k, v, gate_keys, state, training=None):
        qf = self.features(q[:, None], True, True, training)  # [B, 1, H, C]
        kf = self.features(k[:, None], False, True, training)  # [B, 1, H, C]
        out, (s, z) = decay_ops.gated_linear_attention_step(
            qf[:, 0],
            kf[:, 0],
            v,
            self.log_decay(gate_keys)[:, 0],
            (state["S"], state["z"]),
            normalize=self.normalize,
            eps=self.layer.epsilon,
        )  # [B, H, M]
        return out, {"S": s, "z": z}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        qf = self.features(q, True, True, training)
        kf = self.features(k, False, True, training)
        return decay_ops.gated_linear_attention_reference(
            qf,
            kf,
            v,
            self.log_decay(gate_keys),
            key_mask=key_mask,
            normalize=self.normalize,
            eps=self.layer.epsilon,
            compute_dtype="float64",
        )[0]

    def conditioning(self, gate_keys):
        return _decay_conditioning(self.log_decay(gate_keys))
