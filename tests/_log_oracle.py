"""Exact kernel attention in float64 LOG SPACE, from the inputs and the map's weights.

The oracle of the numerics sweep (`tests/ops/test_numerics_sweep.py`). It never
looks at the layer's float32 features: it recomputes each registered map's
features from the projected queries/keys and the map's own weights
(projection, kernels, biases) in float64, as logarithms where the map is of
exponential type, and forms the kernel matrix ``K_ts = phi(q_t) . phi(k_s)``
as ``logsumexp_c(log phi(q_t)_c + log phi(k_s)_c)``, so that no kernel entry
underflows. Each row is then normalized with its own max (a per-query scale,
which cancels): the result is exact kernel attention wherever it is defined,
at any input scale.

Signed maps (taylor, favor_trig) have no logarithm; their kernels are
computed directly in float64 (taylor is a polynomial; favor_trig's key
amplitudes ``exp(|k'|^2/2)`` are shifted per row by the largest one).

Besides the output, `attend_reference` returns per row what the error model
needs: the number of terms of the row's reductions (``C`` features plus its
keys), the normalizer's conditioning (1 for positive maps) and ``L``, the
magnitude of the exponent arguments that float32 has to round (rounding
``a`` to float32 moves ``exp(a)`` by a relative ``|a| * eps``).

Shape legend: B batch, T queries, S keys, H heads, D key dim, C features, M value dim.
"""

import numpy as np

from keras_linattn import feature_maps as fm_lib
from keras_linattn.feature_maps import _trainable


def _log_softplus(x):
    """``log(softplus(x))`` without underflow: ``~ x`` for ``x << 0``."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    small = x < -30.0
    out[small] = x[small] - 0.5 * np.exp(x[small])  # log(log1p(e^x)) = x - e^x/2 + O(e^2x)
    big = ~small
    out[big] = np.log(np.logaddexp(0.0, x[big]))
    return out


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -np.asarray(x, np.float64))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _act(name, x):
    return {
        "sigmoid": lambda y: 1.0 / (1.0 + np.exp(-y)),
        "tanh": np.tanh,
        "relu": lambda y: np.maximum(y, 0.0),
        "gelu": None,
    }[name](x)


def _w(v):
    return np.asarray(v, np.float64)


def _headwise(x, w):
    return np.einsum("bthd,hdc->bthc", x, _w(w))


def map_terms(fm, x, is_query):
    """``(kind, values, magnitude)`` of a map's features for ``x [B, T, H, D]`` (float64).

    ``kind`` is ``"log"`` (values are ``log phi``) or ``"signed"`` (values are
    ``phi``, or for favor_trig keys ``(trig, log amplitude)``); ``magnitude``
    ``[B, T, H]`` is the size of the exponent arguments float32 rounds.
    """
    x = np.asarray(x, np.float64)
    zeros = np.zeros(x.shape[:3])
    if isinstance(fm, fm_lib.EluFeatureMap):
        return "log", np.where(x < 0, x, np.log1p(np.maximum(x, 0.0))), np.abs(np.minimum(x, 0.0)).max(-1)
    if isinstance(fm, fm_lib.ReluFeatureMap):
        with np.errstate(divide="ignore"):
            return "log", np.log(np.maximum(x, 0.0) + fm.epsilon), zeros
    if isinstance(fm, fm_lib.TaylorFeatureMap):
        d = x.shape[-1]
        xs = x * (fm.scale if fm.scale is not None else d**-0.25)
        outer = (xs[..., :, None] * xs[..., None, :]).reshape(x.shape[:3] + (d * d,))
        return "signed", np.concatenate([np.ones(x.shape[:3] + (1,)), xs, outer / np.sqrt(2.0)], -1), zeros
    if isinstance(fm, fm_lib.RandomFeatureMap):
        d = x.shape[-1]
        xs = x * (fm.scale if fm.scale is not None else d**-0.25)
        proj = np.einsum("bthd,hmd->bthm", xs, _w(fm.projection))  # [B, T, H, m]
        half = 0.5 * (xs**2).sum(-1, keepdims=True)  # [B, T, H, 1]
        m = fm.num_features
        if isinstance(fm, fm_lib.FavorPlusFeatureMap):
            return "log", proj - half - 0.5 * np.log(m), np.abs(proj).max(-1) + half[..., 0]
        trig = np.concatenate([np.sin(proj), np.cos(proj)], -1) / np.sqrt(m)
        if is_query:
            return "signed", trig, np.abs(proj).max(-1)
        return "signed", (trig, half[..., 0]), np.abs(proj).max(-1) + half[..., 0]
    if isinstance(fm, _trainable.TrainableFeatureMap):
        branch = fm._branches["qk" if fm.share_qk else ("query" if is_query else "key")]
        if isinstance(fm, fm_lib.HedgehogFeatureMap):
            logits = _headwise(x, branch["kernel"])
            if fm.use_bias:
                logits = logits + _w(branch["bias"])
            mag = 2.0 * np.abs(logits).max(-1)
            return "log", np.concatenate([_log_softmax(logits), _log_softmax(-logits)], -1), mag
        if isinstance(fm, fm_lib.FFNFeatureMap):
            h = x
            for w in branch[:-1]:
                h = _act(fm.hidden_activation, _headwise(h, w))
            y = _headwise(h, branch[-1])
            return "log", _log_softplus(y), np.abs(np.minimum(y, 0.0)).max(-1)
        # The GLU family: act(u W_f) * sigmoid(u W_g) per unit, softplus last.
        h = x
        for i, unit in enumerate(branch):
            f = _headwise(h, unit["filter"])
            if "gate" in unit:
                g = _headwise(h, unit["gate"])
            else:
                g = _headwise(_headwise(h, unit["gate_a"]), unit["gate_b"])
            if i < len(branch) - 1:
                h = _act(fm.hidden_activation, f) / (1.0 + np.exp(-g))
            else:
                mag = (np.abs(np.minimum(f, 0.0)) + np.abs(np.minimum(g, 0.0))).max(-1)
                return "log", _log_softplus(f) + _log_sigmoid(g), mag
    raise NotImplementedError(f"no log-space oracle for {type(fm).__name__}")


def _allowed(b, t, s, causal, key_mask):
    allowed = np.ones((b, 1, t, s), bool)
    if causal:
        allowed &= np.tril(np.ones((t, s), bool))[None, None]
    if key_mask is not None:
        allowed &= np.asarray(key_mask, bool)[:, None, None, :]
    return allowed  # [B, 1, T, S]


def attend_reference(fm, q, k, v, causal=False, key_mask=None):
    """Exact kernel attention of map `fm` on projected ``q [B,T,H,D]``, ``k [B,S,H,D]``, ``v [B,S,H,M]``.

    Returns a dict of float64 arrays: ``out [B, T, H, M]`` (0 where a row has
    no key), ``defined [B, T, H]`` (the row has a key and a nonzero
    normalizer), ``n [B, T, H]`` (reduction length), ``cond [B, T, H]``
    (normalizer conditioning), ``mag [B, T, H]`` (exponent magnitude ``L``)
    and ``vmax [B, T, H]`` (largest ``|v|`` the row attends to).
    """
    v = np.asarray(v, np.float64)
    kind, lq, mq = map_terms(fm, q, True)
    _, lk, mk = map_terms(fm, k, False)
    b, t, h = np.shape(q)[:3]
    s = np.shape(k)[1]
    allowed = _allowed(b, t, s, causal, key_mask)  # [B, 1, T, S]
    if kind == "log":
        pairs = lq.transpose(0, 2, 1, 3)[:, :, :, None, :] + lk.transpose(0, 2, 1, 3)[:, :, None, :, :]
        logk = np.logaddexp.reduce(pairs, axis=-1)  # [B, H, T, S]
        logk = np.where(allowed, logk, -np.inf)
        peak = logk.max(-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        weights = np.exp(logk - peak)  # [B, H, T, S], max 1 per defined row
        magnitude = weights
    else:
        if isinstance(lk, tuple):  # favor_trig keys: trig features and log amplitudes
            trig, log_amp = lk
            dots = np.einsum("bthc,bshc->bhts", lq, trig)
            absdots = np.einsum("bthc,bshc->bhts", np.abs(lq), np.abs(trig))
            amp = np.where(allowed, log_amp.transpose(0, 2, 1)[:, :, None, :], -np.inf)  # [B, H, T, S]
            top = amp.max(-1, keepdims=True)
            scale = np.exp(amp - np.where(np.isfinite(top), top, 0.0))
            weights, magnitude = dots * scale, absdots * scale
        else:
            weights = np.einsum("bthc,bshc->bhts", lq, lk)
            magnitude = np.einsum("bthc,bshc->bhts", np.abs(lq), np.abs(lk))
        weights = np.where(allowed, weights, 0.0)
        magnitude = np.where(allowed, magnitude, 0.0)
    den = weights.sum(-1)  # [B, H, T]
    num = np.einsum("bhts,bshm->bhtm", weights, v)
    has_key = np.broadcast_to(allowed.any(-1), den.shape)
    defined = has_key & (den != 0)
    out = np.where(defined[..., None], num / np.where(defined, den, 1.0)[..., None], 0.0)
    cond = np.where(defined, magnitude.sum(-1) / np.where(defined, np.abs(den), 1.0), 1.0)
    mag_k = np.where(allowed, mk.transpose(0, 2, 1)[:, :, None, :], 0.0).max(-1)  # [B, H, T]
    mag = mq.transpose(0, 2, 1) + mag_k
    vabs = np.abs(v).max(-1).transpose(0, 2, 1)  # [B, H, S]
    vmax = np.where(allowed, vabs[:, :, None, :], 0.0).max(-1)
    n = lq.shape[-1] + allowed.sum(-1)
    tr = (0, 2, 1)
    return {
        "out": out.transpose(0, 2, 1, 3),
        "defined": defined.transpose(tr),
        "has_key": has_key.transpose(tr),
        "n": np.broadcast_to(n, den.shape).transpose(tr),
        "cond": np.maximum(cond, 1.0).transpose(tr),
        "mag": mag.transpose(tr),
        "vmax": vmax.transpose(tr),
    }
