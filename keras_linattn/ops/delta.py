"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet).

One recurrence, three forms side by side (chunked WY/UT training path,
recurrent step, float64 per-token oracle):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T        o_t = S_t^T q_t

with ``S [C, M]``, keys usually L2-normalized, ``b_t = beta_t in (0, 1)`` the
write strength and ``a_t`` an optional decay (``log_decay``, one per head).
Equivalently ``S_t = a_t S_{t-1} + k_t u_t^T`` with the "new value"
``u_t = b_t (v_t - a_t S_{t-1}^T k_t)``: the state first reads what it returns
for ``k_t``, then writes only the correction. There is no normalizer.

Shape legend: B batch, T length, H heads, C key (feature) dim, M value dim,
L chunk length, N number of chunks.

Chunked form (docs/dev/recurrences_derivations.md). Inside a chunk, with ``g_i`` the
cumulative log decay from the chunk start and ``S_0`` the entering state,
the new values solve the unit lower-triangular system

    (I + A) U = diag(b) V - diag(b e^g) K S_0,   A_ij = b_i e^{g_i - g_j} k_i . k_j  (j < i)

so ``U = U~ - W S_0`` with ``U~ = T diag(b) V``, ``W = T diag(b e^g) K`` and
``T = (I + A)^{-1}``: ``A`` is nilpotent, so ``T = (I - A)(I + A^2)(I + A^4)...``
(repeated squaring, ``2 (log2 L - 1)`` matmuls), or forward substitution
unrolled over the static chunk length (``solver="substitution"``). Both are
plain matmuls that XLA compiles and tf2onnx exports. Then the chunk
is decayed additive attention with values ``U``:

    O = diag(e^g) Q S_0 + (Q K^T * G * tril) U,    S_end = e^{g_L} S_0 + (K * e^{g_L - g})^T U

``T``, ``W``, ``U~`` and the intra-chunk products are computed for all chunks
at once; only the three small matmuls that carry ``S`` run chunk after chunk.

Padding: a padded step (``key_mask`` False) has ``b = 0``, ``k = v = 0`` and
no decay: it leaves the state unchanged.
"""

import keras
from keras import ops

from keras_linattn._validation import check_positive_int, check_rank
from keras_linattn.ops._common import _heads_first, _mask_keys, _matmul, _validate_inputs

__all__ = ["DELTA_CHUNK", "delta_rule_attention", "delta_rule_reference", "delta_rule_step"]

# Longest chunk of the delta rule: the triangular solve is unrolled over it.
DELTA_CHUNK = 32


def _check_gate(name, x, q, required):
    if x is None:
        if required:
            raise ValueError(f"`{name}` is required. Received: {name}=None")
        return
    check_rank(name, x, len(q.shape) - 1)
    expected = tuple(q.shape[:-1])
    if any(a is not None and b is not None and a != b for a, b in zip(tuple(x.shape), expected, strict=True)):
        raise ValueError(
            f"`{name}` must have shape {expected} (one value per head and token). "
            f"Received: {name}.shape={tuple(x.shape)}"
        )


def _check_state(state, h, c, m, name="initial_state"):
    shape = tuple(getattr(state, "shape", ()))
    if len(shape) != 4 or any(
        a is not None and b is not None and a != b for a, b in zip(shape[1:], (h, c, m), strict=True)
    ):
        raise ValueError(f"`{name}` must be S of shape [B, {h}, {c}, {m}]. Received: {name}.shape={shape}")


def _solve_unit_lower(a, rhs):
    """``(I + a)^{-1} rhs`` for strictly lower-triangular ``a [..., L, L]`` (static L), by forward substitution."""
    length = a.shape[-1]
    rows = [rhs[..., :1, :]]  # [..., 1, X]
    for i in range(1, length):
        done = ops.concatenate(rows, axis=-2)  # [..., i, X]
        rows.append(rhs[..., i : i + 1, :] - ops.matmul(a[..., i : i + 1, :i], done))  # [..., 1, X]
    return ops.concatenate(rows, axis=-2)  # [..., L, X]


def _unit_lower_inverse(a):
    """``(I + a)^{-1}`` for strictly lower-triangular ``a [..., L, L]`` (static L), by repeated squaring.

    ``a`` is nilpotent (``a^L = 0``), so ``(I + a)^{-1} = sum_{k < L} (-a)^k
    = (I - a)(I + a^2)(I + a^4)...``: ``2 (ceil(log2 L) - 1)`` matmuls of
    ``[L, L]`` matrices instead of ``L - 1`` dependent row updates.
    """
    length = a.shape[-1]
    eye = ops.eye(length, dtype=a.dtype)
    power = -a  # (-a)^(2^j)
    inverse = eye + power  # sum of (-a)^k for k < 2^(j+1)
    span = 2
    while span < length:
        power = ops.matmul(power, power)
        inverse = inverse + ops.matmul(inverse, power)
        span *= 2
    return inverse


def _solve_unit_lower_by_inverse(a, rhs):
    """``(I + a)^{-1} rhs`` through `_unit_lower_inverse` (same contract as `_solve_unit_lower`)."""
    return ops.matmul(_unit_lower_inverse(a), rhs)


# How the chunk's unit lower-triangular system is solved. "inverse" (the
# default) runs its matmuls for all chunks at once, where "substitution" has
# L - 1 dependent row updates: it trains faster (docs/dev/history/recurrences.md).
SOLVERS = {"inverse": _solve_unit_lower_by_inverse, "substitution": _solve_unit_lower}


def _scan_chunks(step, carry, xs):
    """``carry, ys = scan(step, carry, xs)`` over axis 0 of every tensor in `xs`.

    TensorFlow: a ``tf.while_loop`` over TensorArrays (exported by tf2onnx as an
    ONNX Loop; ``tf.scan`` and ``ops.associative_scan`` do not export). Other
    backends: ``keras.ops.scan``.
    """
    if keras.backend.backend() != "tensorflow":
        return ops.scan(lambda c, x: step(c, x), carry, xs)
    import tensorflow as tf

    n = tf.shape(xs[0])[0]
    inputs = [tf.TensorArray(x.dtype, size=n, element_shape=x.shape[1:]).unstack(x) for x in xs]
    out = tf.TensorArray(tf.float32, size=n)  # the chunk outputs (float32, shape inferred at the first write)

    def body(i, c, acc):
        c, y = step(c, [ta.read(i) for ta in inputs])
        return i + 1, c, acc.write(i, y)

    # A static bound where the number of chunks is known: XLA needs one to differentiate the loop.
    bound = xs[0].shape[0] if xs[0].shape[0] is not None else n
    _, carry, out = tf.while_loop(lambda i, c, acc: i < n, body, (tf.constant(0), carry, out), maximum_iterations=bound)
    return carry, out.stack()


def delta_rule_attention(
    q,
    k,
    v,
    beta,
    log_decay=None,
    key_mask=None,
    chunk_size=64,
    initial_state=None,
    return_state=False,
    solver="inverse",
):
    """Causal delta-rule attention (DeltaNet; Gated DeltaNet with `log_decay`), chunked.

    Args:
        q: queries ``[B, T, H, C]``.
        k: keys ``[B, T, H, C]`` (L2-normalize them: ``|k| <= 1`` keeps every
            update a contraction).
        v: values ``[B, T, H, M]``.
        beta: write strengths ``[B, T, H]`` in ``[0, 1]``.
        log_decay: optional ``log a_t <= 0``, ``[B, T, H]``.
        key_mask: optional ``[B, T]``; a padded step leaves the state unchanged.
        chunk_size: chunk length (at most `DELTA_CHUNK`).
        initial_state: optional ``S [B, H, C, M]``.
        return_state: also return the final float32 ``S``.
        solver: how each chunk's triangular system is solved: ``"inverse"``
            (``(I + A)^{-1}`` by repeated squaring, ``2 (log2 L - 1)`` matmuls) or
            ``"substitution"`` (forward substitution, ``L - 1`` dependent
            row updates). Same result up to rounding; "inverse" is faster.

    Returns:
        ``[B, T, H, M]`` in ``v``'s dtype (and ``S`` if `return_state`).
    """
    if solver not in SOLVERS:
        raise ValueError(f"`solver` must be one of {sorted(SOLVERS)}. Received: solver={solver!r}")
    _validate_inputs(q, k, v, key_mask, causal=True, names=("q", "k", "v"))
    _check_gate("beta", beta, q, True)
    _check_gate("log_decay", log_decay, q, False)
    h, c, m = q.shape[2], q.shape[3], v.shape[3]
    if initial_state is not None:
        _check_state(initial_state, h, c, m)
    chunk = min(check_positive_int("chunk_size", chunk_size), DELTA_CHUNK)
    if q.shape[1] is not None:
        chunk = max(1, min(chunk, q.shape[1]))
    out_dtype = v.dtype
    if q.shape[1] == 0:  # an empty piece: no output, the state handed on
        s0 = ops.zeros((ops.shape(q)[0], h, c, m), "float32") if initial_state is None else initial_state
        out = ops.zeros_like(v)  # [B, 0, H, M]
        return (out, ops.cast(s0, "float32")) if return_state else out
    batch, length = ops.shape(q)[0], ops.shape(q)[1]
    qf = _heads_first(ops.cast(q, "float32"))  # [B, H, T, C]
    kf = _heads_first(_mask_keys(ops.cast(k, "float32"), key_mask))  # [B, H, T, C]
    vf = _heads_first(_mask_keys(ops.cast(v, "float32"), key_mask))  # [B, H, T, M]
    bf = ops.transpose(_mask_keys(ops.cast(beta, "float32"), key_mask), (0, 2, 1))  # [B, H, T]
    if log_decay is None:
        gf = ops.zeros_like(bf)
    else:
        gf = ops.transpose(_mask_keys(ops.cast(log_decay, "float32"), key_mask), (0, 2, 1))  # [B, H, T]

    pad = (chunk - length % chunk) % chunk
    p4 = [[0, 0], [0, 0], [0, pad], [0, 0]]
    p3 = [[0, 0], [0, 0], [0, pad]]
    qc = ops.reshape(ops.pad(qf, p4), (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    kc = ops.reshape(ops.pad(kf, p4), (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    vc = ops.reshape(ops.pad(vf, p4), (batch, h, -1, chunk, m))  # [B, H, N, L, M]
    bc = ops.reshape(ops.pad(bf, p3), (batch, h, -1, chunk))[..., None]  # [B, H, N, L, 1]
    g = ops.cumsum(ops.reshape(ops.pad(gf, p3), (batch, h, -1, chunk)), axis=-1)[..., None]  # [B, H, N, L, 1]

    idx = ops.arange(chunk)
    tril = idx[:, None] >= idx[None, :]  # [L, L]
    strict = idx[:, None] > idx[None, :]  # [L, L]
    diff = g - ops.swapaxes(g, -1, -2)  # [B, H, N, L, L]: g_i - g_j
    decay = ops.where(tril, ops.exp(ops.minimum(diff, 0.0)), ops.zeros_like(diff))  # [B, H, N, L, L]
    kk = _matmul(kc, kc, transpose_b=True)  # [B, H, N, L, L]
    a = ops.where(strict, bc * kk * decay, ops.zeros_like(kk))  # [B, H, N, L, L]
    rhs = ops.concatenate([bc * vc, bc * ops.exp(g) * kc], axis=-1)  # [B, H, N, L, M + C]
    solved = SOLVERS[solver](a, rhs)  # [B, H, N, L, M + C]
    u_tilde, w = solved[..., :m], solved[..., m:]  # [B, H, N, L, M], [B, H, N, L, C]
    scores = _matmul(qc, kc, transpose_b=True) * decay  # [B, H, N, L, L]
    q_in = qc * ops.exp(g)  # [B, H, N, L, C]
    last = g[:, :, :, -1:, :]  # [B, H, N, 1, 1]
    k_out = kc * ops.exp(last - g)  # [B, H, N, L, C]

    # Chunk after chunk: only these carry S.
    chunk_first = lambda x: ops.moveaxis(x, 2, 0)  # noqa: E731  [N, B, H, ...]
    xs = [chunk_first(x) for x in (u_tilde, w, scores, q_in, k_out, ops.exp(last))]

    def step(s, x):
        u_t, w_n, sc, qi, ko, el = x
        u = u_t - ops.matmul(w_n, s)  # [B, H, L, M]
        o = ops.matmul(qi, s) + ops.matmul(sc, u)  # [B, H, L, M]
        s = el * s + _matmul(ko, u, transpose_a=True)  # [B, H, C, M]
        return s, o

    s0 = ops.zeros((batch, h, c, m), "float32") if initial_state is None else ops.cast(initial_state, "float32")
    s_final, outs = _scan_chunks(step, s0, xs)  # [B, H, C, M], [N, B, H, L, M]
    out = ops.reshape(ops.moveaxis(outs, 0, 2), (batch, h, -1, m))[:, :, :length]  # [B, H, T, M]
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), out_dtype)  # [B, T, H, M]
    if return_state:
        return out, s_final
    return out


def delta_rule_step(q_t, k_t, v_t, beta_t, state, log_decay_t=None, key_mask_t=None):
    """One step: ``S <- a (I - b k k^T) S + b k v^T``, ``o = S^T q``.

    Args:
        q_t, k_t: ``[B, H, C]``; v_t: ``[B, H, M]``; beta_t, log_decay_t: ``[B, H]``.
        state: ``S [B, H, C, M]``.
        key_mask_t: optional ``[B]``; a masked step leaves the state unchanged.

    Returns:
        ``(out_t [B, H, M], S)`` with ``S`` in float32.
    """
    check_rank("q_t", q_t, 3)
    check_rank("k_t", k_t, 3)
    check_rank("v_t", v_t, 3)
    _check_gate("beta_t", beta_t, q_t, True)
    _check_gate("log_decay_t", log_decay_t, q_t, False)
    _check_state(state, q_t.shape[1], q_t.shape[2], v_t.shape[2], name="state")
    out_dtype = v_t.dtype
    q = ops.cast(q_t, "float32")
    k = _mask_keys(ops.cast(k_t, "float32"), key_mask_t)  # [B, H, C]
    v = _mask_keys(ops.cast(v_t, "float32"), key_mask_t)  # [B, H, M]
    b = _mask_keys(ops.cast(beta_t, "float32"), key_mask_t)[..., None]  # [B, H, 1]
    s = ops.cast(state, "float32")  # [B, H, C, M]
    if log_decay_t is not None:
        s = ops.exp(_mask_keys(ops.cast(log_decay_t, "float32"), key_mask_t))[..., None, None] * s
    read = ops.einsum("bhc,bhcm->bhm", k, s)  # [B, H, M]: what S returns for k
    s = s + k[..., :, None] * (b * (v - read))[..., None, :]  # [B, H, C, M]
    out = ops.einsum("bhc,bhcm->bhm", q, s)  # [B, H, M]
    return ops.cast(out, out_dtype), s


def delta_rule_reference(q, k, v, beta, log_decay=None, key_mask=None, initial_state=None, compute_dtype="float64"):
    """The oracle: ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` one token at a time.

    Same contract as `delta_rule_attention`; returns ``(out, S)`` with ``out``
    in ``v``'s dtype and ``S`` in ``compute_dtype``. Differentiable.
    """
    _validate_inputs(q, k, v, key_mask, causal=True, names=("q", "k", "v"))
    _check_gate("beta", beta, q, True)
    _check_gate("log_decay", log_decay, q, False)
    cast = lambda x: ops.cast(x, compute_dtype)  # noqa: E731
    qq, kk, vv, bb = cast(q), cast(k), cast(v), cast(beta)
    gg = None if log_decay is None else cast(log_decay)
    batch, length, h, c = qq.shape
    m = vv.shape[-1]
    s = ops.zeros((batch, h, c, m), compute_dtype) if initial_state is None else cast(initial_state)
    eye = ops.eye(c, dtype=compute_dtype)
    outs = []
    for t in range(length):
        keep = None if key_mask is None else ops.cast(key_mask, "bool")[:, t]
        kt, vt, bt = (_mask_keys(x[:, t], keep) for x in (kk, vv, bb))  # [B, H, C], [B, H, M], [B, H]
        transition = eye - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]  # [B, H, C, C]
        if gg is not None:
            transition = ops.exp(_mask_keys(gg[:, t], keep))[..., None, None] * transition
        s = ops.matmul(transition, s) + bt[..., None, None] * kt[..., :, None] * vt[..., None, :]
        outs.append(ops.einsum("bhc,bhcm->bhm", qq[:, t], s))
    out = ops.stack(outs, axis=1) if outs else ops.zeros((batch, 0, h, m), compute_dtype)
    return ops.cast(out, v.dtype), s
