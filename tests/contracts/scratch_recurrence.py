"""A recurrence defined and registered here only: a learned per-head fixed decay, written from scratch.

``S_t = a_h S_{t-1} + phi(k_t) v_t^T``, ``z_t = a_h z_{t-1} + phi(k_t)``,
``o_t = phi(q_t)^T S_t / phi(q_t)^T z_t`` with ``a_h = sigmoid(w_h)``, one
learned weight per head. None of it uses the package's decay ops: the
parallel form is the quadratic masked form (decay weights
``exp(b_i - b_j)``, ``b`` the cumulative log decay over real tokens), the
step is the recurrence, the oracle a float64 loop. tests/contracts/conftest.py
imports this module, so the contract battery runs it like a built-in
recurrence: registering is all it takes.
"""

import keras
from keras import ops

from keras_linattn import _state, recurrences


def _real(key_mask, k):
    if key_mask is None:
        return ops.ones(ops.shape(k)[:2], "float32")
    return ops.cast(key_mask, "float32")  # [B, T]


@recurrences.register("scratch_fixed_decay")
class ScratchFixedDecay(recurrences.Recurrence):
    """Learned per-head fixed decay ``a_h = sigmoid(w_h)``.

    Args:
        initial_logit: initial ``w_h`` (3.0: ``a`` about 0.95).
    """

    contract_configs = ({},)

    def __init__(self, initial_logit=3.0):
        super().__init__()
        self.initial_logit = float(initial_logit)

    def get_config(self):
        return {"initial_logit": self.initial_logit}

    def build(self, layer):
        super().build(layer)
        self.decay_logit = self.add_weight(
            "decay_logit", (self.num_heads,), keras.initializers.Constant(self.initial_logit)
        )

    def state_spec(self):
        h, c, m = self.num_heads, self.feature_dim, self.value_dim
        return [_state.StateSpec("S", (h, c, m), "float32"), _state.StateSpec("z", (h, c), "float32")]

    def _log_a(self, dtype="float32"):
        return ops.log_sigmoid(ops.cast(self.decay_logit, dtype))  # [H]

    def _readout(self, qf, num, den):
        guard = self.layer.epsilon * ops.sum(ops.abs(qf), axis=-1) + 1e-30  # [..., H]
        return num / ops.maximum(den, guard)[..., None]

    def call(self, q, k, v, gate_keys, key_mask, state, causal=True, training=None):
        real = _real(key_mask, k)  # [B, T]
        qf = ops.cast(self.features(q, True, True, training), "float32")  # [B, T, H, C]
        kf = ops.cast(self.features(k, False, True, training), "float32") * real[:, :, None, None]
        vv = ops.where(real[:, :, None, None] > 0, ops.cast(v, "float32"), 0.0)  # [B, T, H, M]
        b = ops.cumsum(real, axis=1)[:, :, None] * self._log_a()  # [B, T, H]
        t = ops.shape(q)[1]
        lower = ops.arange(t)[:, None] >= ops.arange(t)[None, :]  # [T, T]
        diff = b[:, :, None, :] - b[:, None, :, :]  # [B, T(i), T(j), H]
        weights = ops.where(lower[None, :, :, None], ops.exp(ops.minimum(diff, 0.0)), 0.0)
        scores = ops.einsum("bihc,bjhc->bijh", qf, kf) * weights  # [B, T, T, H]
        num = ops.einsum("bijh,bjhm->bihm", scores, vv)  # [B, T, H, M]
        den = ops.sum(scores, axis=2)  # [B, T, H]
        b_last = b[:, -1]  # [B, H]
        to_end = ops.exp(b_last[:, None, :] - b)  # [B, T, H]
        s = ops.einsum("bjh,bjhc,bjhm->bhcm", to_end, kf, vv)  # [B, H, C, M]
        z = ops.einsum("bjh,bjhc->bhc", to_end, kf)  # [B, H, C]
        if state is not None:
            carry = ops.exp(b)  # [B, T, H]
            num = num + carry[..., None] * ops.einsum("bihc,bhcm->bihm", qf, state["S"])
            den = den + carry * ops.einsum("bihc,bhc->bih", qf, state["z"])
            s = s + ops.exp(b_last)[..., None, None] * state["S"]
            z = z + ops.exp(b_last)[..., None] * state["z"]
        return self._readout(qf, num, den), {"S": s, "z": z}

    def step(self, q, k, v, gate_keys, state, training=None):
        qf = ops.cast(self.features(q[:, None], True, True, training)[:, 0], "float32")  # [B, H, C]
        kf = ops.cast(self.features(k[:, None], False, True, training)[:, 0], "float32")  # [B, H, C]
        a = ops.exp(self._log_a())  # [H]
        s = a[:, None, None] * state["S"] + kf[..., None] * ops.cast(v, "float32")[..., None, :]
        z = a[:, None] * state["z"] + kf
        num = ops.einsum("bhc,bhcm->bhm", qf, s)
        return self._readout(qf, num, ops.sum(qf * z, axis=-1)), {"S": s, "z": z}

    def oracle(self, q, k, v, gate_keys, key_mask, training=None):
        f64 = "float64"
        real = ops.cast(_real(key_mask, k), f64)
        qf = ops.cast(self.features(q, True, True, training), f64)
        kf = ops.cast(self.features(k, False, True, training), f64)
        vv = ops.cast(v, f64)
        a = ops.exp(self._log_a(f64))  # [H]
        batch, length, h, c = qf.shape
        s = ops.zeros((batch, h, c, vv.shape[-1]), f64)
        z = ops.zeros((batch, h, c), f64)
        outs = []
        for t in range(length):
            r = real[:, t][:, None]  # [B, 1]: a padded token neither decays nor writes
            decay = r * a[None] + (1.0 - r)  # [B, H]
            s = decay[..., None, None] * s + r[..., None, None] * kf[:, t, :, :, None] * vv[:, t, :, None, :]
            z = decay[..., None] * z + r[..., None] * kf[:, t]
            outs.append(self._readout(qf[:, t], ops.einsum("bhc,bhcm->bhm", qf[:, t], s), ops.sum(qf[:, t] * z, -1)))
        return ops.cast(ops.stack(outs, axis=1), v.dtype)

    def conditioning(self, gate_keys):
        import numpy as np

        length = gate_keys.shape[1]
        return 1.0 + float(np.max(-np.asarray(ops.convert_to_numpy(self._log_a())))) * length
