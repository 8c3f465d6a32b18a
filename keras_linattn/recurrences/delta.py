"""The delta rule (DeltaNet), gated or not: ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``.

Wraps `keras_linattn.ops.delta_rule_attention` (chunked, WY form),
`delta_rule_step` and `delta_rule_reference`. The gate is the decay
recurrence's (`keras_linattn.recurrences.decay`).
"""

from keras import ops

from keras_linattn import _state, _validation
from keras_linattn.ops import delta as delta_ops
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.decay import _add_gate_weights, _decay_conditioning, _gate_log_decay
from keras_linattn.recurrences.registry import register

__all__ = ["DeltaRecurrence"]

GATES = (None, "fixed", "scalar")


def _l2_normalize(x):
    """Unit L2 norm over the last axis, in float32 (the delta rule's keys and queries)."""
    x = ops.cast(x, "float32")
    return x * ops.rsqrt(ops.sum(ops.square(x), axis=-1, keepdims=True) + 1e-12)


@register("delta")
class DeltaRecurrence(Recurrence):
    """The delta rule: a key's old value is overwritten instead of added to.

    ``S_t = S_{t-1} + b_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T`` with
    ``phi(q)``, ``phi(k)`` L2-normalized per head and
    ``b_t = sigmoid(w . k_t + c)`` per head; ``o_t = phi(q_t)^T S_t`` (no
    normalizer: the layer puts an RMSNorm on each head's output). With a
    gate, ``S_{t-1}`` is first multiplied by ``a_t`` (Gated DeltaNet). The
    feature map may be the identity (``feature_map=None``).

    Args:
        gate: None (default), ``"fixed"`` or ``"scalar"``: the decay
            recurrence's gates (one per head).
    """

    accepts_identity_map = True
    key_scale_free = True  # keys are L2-normalized after the map
    normalize = False
    contract_configs = ({"gate": None}, {"gate": "scalar"})

    def __init__(self, gate=None):
        super().__init__()
        self.gate = _validation.check_one_of("gate", gate, GATES)

    def get_config(self):
        return {"gate": self.gate}

    def build(self, layer):
        super().build(layer)
        h, d = self.num_heads, self.key_dim
        self.beta_kernel = self.add_weight("beta_kernel", (h, d, h), layer._fresh(layer.kernel_initializer))
        self.beta_bias = self.add_weight("beta_bias", (h,), "zeros")
        _add_gate_weights(self, self.gate)

    def beta(self, keys):
        """Write strengths ``sigmoid(w . k + c)`` from the projected keys ``[B, S, H, D]``: ``[B, S, H]``."""
        x = ops.cast(keys, "float32")  # [B, S, H, D]
        return ops.sigmoid(ops.einsum("bshd,hdg->bsg", x, self.beta_kernel) + self.beta_bias)  # [B, S, H]

    def log_decay(self, keys):
        """``log a_t`` ``[B, S, H]`` from the projected keys, or None without a gate."""
        return None if self.gate is None else _gate_log_decay(self, self.gate, keys)[..., 0]

    def features(self, x, is_query, causal=True, training=None, key_mask=None):
        return _l2_normalize(super().features(x, is_query, causal, training, key_mask))

    def state_spec(self):
        return [_state.StateSpec("S", (self.num_heads, self.feature_dim, self.value_dim), "float32")]

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        qf = self.features(q, True, causal, training)  # [B, T, H, C]
        kf = self.features(k, False, causal, training, key_mask)  # [B, S, H, C]
        out, s = delta_ops.delta_rule_attention(
            qf,
            kf,
            v,
            self.beta(gate_keys),
            self.log_decay(gate_keys),
            key_mask=key_mask,
            chunk_size=self.layer.chunk_size,
            initial_state=None if state is None else state["S"],
            return_state=True,
        )  # [B, T, H, M]
        return out, {"S": s}

    def step(self, q, k, v, gate_keys, state, training=None):
        qf = self.features(q[:, None], True, True, training)  # [B, 1, H, C]
        kf = self.features(k[:, None], False, True, training)  # [B, 1, H, C]
        log_decay = self.log_decay(gate_keys)
        log_decay = None if log_decay is None else log_decay[:, 0]  # [B, H]
        out, s = delta_ops.delta_rule_step(
            qf[:, 0], kf[:, 0], v, self.beta(gate_keys)[:, 0], state["S"], log_decay
        )  # [B, H, M]
        return out, {"S": s}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        qf = self.features(q, True, True, training)
        kf = self.features(k, False, True, training)
        return delta_ops.delta_rule_reference(
            qf, kf, v, self.beta(gate_keys), self.log_decay(gate_keys), key_mask=key_mask
        )[0]

    def conditioning(self, gate_keys):
        log_decay = self.log_decay(gate_keys)
        return 1.0 if log_decay is None else _decay_conditioning(log_decay)
