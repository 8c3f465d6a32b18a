"""The additive recurrence (plain linear attention): ``S_t = S_{t-1} + phi(k_t) v_t^T``.

Wraps `keras_linattn.ops.linear_attention` (chunkwise-parallel, causal or
not), `linear_attention_step` and, as the oracle, the gated reference with
no decay.
"""

from keras import ops

from keras_linattn import _state, _validation
from keras_linattn.ops import core as la_ops
from keras_linattn.ops import decay as decay_ops
from keras_linattn.recurrences.base import Recurrence
from keras_linattn.recurrences.registry import register

__all__ = ["AdditiveRecurrence"]


@register("additive")
class AdditiveRecurrence(Recurrence):
    """``S_t = S_{t-1} + phi(k_t) v_t^T``, ``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t``.

    The one recurrence that also runs non-causally (``S`` over every key).

    Args:
        normalize: True (default) divides by ``phi(q) . z``; False drops the
            denominator (the layer then puts an RMSNorm on each head's
            output). The state is ``(S, z)`` either way.
    """

    causal_only = False
    contract_configs = ({"normalize": True}, {"normalize": False})

    def __init__(self, normalize=True):
        super().__init__()
        self.normalize = _validation.check_bool("normalize", normalize)

    def get_config(self):
        return {"normalize": self.normalize}

    def state_spec(self):
        h, c, m = self.num_heads, self.feature_dim, self.value_dim
        return [_state.StateSpec("S", (h, c, m), "float32"), _state.StateSpec("z", (h, c), "float32")]

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        qf, kf = self.feature_pair(q, k, causal, training, key_mask)  # [B, T, H, C], [B, S, H, C]
        out, (s, z) = la_ops.linear_attention(
            qf,
            kf,
            v,
            causal=causal,
            key_mask=key_mask,
            chunk_size=self.layer.chunk_size,
            initial_state=None if state is None else (state["S"], state["z"]),
            return_state=True,
            eps=self.layer.epsilon,
            normalize=self.normalize,
        )  # [B, T, H, M]
        return out, {"S": s, "z": z}

    def step(self, q, k, v, gate_keys, state, training=None):
        qf = self.features(q[:, None], True, True, training)  # [B, 1, H, C]
        kf = self.features(k[:, None], False, True, training)  # [B, 1, H, C]
        out, (s, z) = la_ops.linear_attention_step(
            qf[:, 0], kf[:, 0], v, (state["S"], state["z"]), eps=self.layer.epsilon, normalize=self.normalize
        )  # [B, H, M]
        return out, {"S": s, "z": z}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        qf = self.features(q, True, True, training)
        kf = self.features(k, False, True, training)
        no_decay = ops.zeros(tuple(qf.shape[:3]) + (1,))
        return decay_ops.gated_linear_attention_reference(
            qf,
            kf,
            v,
            no_decay,
            key_mask=key_mask,
            normalize=self.normalize,
            eps=self.layer.epsilon,
            compute_dtype="float64",
        )[0]
