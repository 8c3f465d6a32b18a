"""The sparse cache's selection (LoLA): which pair enters the linear state, and the cache after it.

`keras_linattn.ops.sparse_cache` states the rule; this module holds the
per-token decision (`_admit`), shared by the parallel form's token loop
(`_selection`) and the decoding step, the cache's softmax terms for one
query, and the cache's shape checks. Shape legend as there: B batch, N
cache slots, H heads, D key dim, C feature dim, M value dim.
"""

import keras
from keras import ops

from keras_linattn.ops._common import _guarded_denominator, _mask_keys
from keras_linattn.ops.window import _NEG


def _recall_error(kf, v, s, z, eps):
    """``||v - phi(k)^T S / d(k)||^2`` per candidate: ``kf [B, X, H, C]``, ``v [B, X, H, M]`` -> ``[B, X, H]``."""
    read = ops.einsum("bxhc,bhcm->bxhm", kf, s)  # [B, X, H, M]
    den = ops.einsum("bxhc,bhc->bxh", kf, z)[..., None]  # [B, X, H, 1]
    den_abs = ops.einsum("bxhc,bhc->bxh", ops.abs(kf), ops.abs(z))[..., None]  # [B, X, H, 1]
    return ops.sum(ops.square(v - read / _guarded_denominator(den, den_abs, eps)), axis=-1)  # [B, X, H]


def _admit(state, cache, leaving, eps):
    """One decision: the leaving pair joins the cache; the candidate the state recalls best goes into ``(S, z)``.

    Args:
        state: ``(S [B, H, C, M], z [B, H, C])`` float32.
        cache: ``(keys [B, N, H, D], features [B, N, H, C], values [B, N, H, M],
            valid [B, N, H])`` float32, oldest first; invalid slots are zeros.
        leaving: ``(key [B, H, D], features [B, H, C], value [B, H, M], valid [B])``.
        eps: the guard of the error's denominator.

    Returns:
        ``((S, z), cache, (features [B, H, C], value [B, H, M]))``: the
        pair that entered the state is zeros where none did.
    """
    s, z = state
    keys, feats, values, valid = cache
    n = ops.shape(keys)[1]  # N (a tensor where the state's shape is not static, as in exported loops)
    n_f = ops.cast(n, "float32")
    ok = ops.cast(leaving[3], "float32")  # [B]
    ok = ops.broadcast_to(ok[:, None], ops.shape(leaving[1])[:2])  # [B, H]
    cand_ok = ops.concatenate([valid, ok[:, None]], axis=1) > 0  # [B, N+1, H]
    cand = [ops.concatenate([x, y[:, None]], axis=1) for x, y in zip((keys, feats, values), leaving[:3], strict=True)]
    cand = [_mask_keys(x, cand_ok) for x in cand]  # [B, N+1, H, D|C|M]: a padded key holds nothing
    k_c, kf_c, v_c = cand
    # Free slots (and a padded leaving key) score below every real pair: the first of them is dropped.
    err = ops.where(cand_ok, _recall_error(kf_c, v_c, s, z, eps), -ops.ones_like(cand_ok, "float32"))  # [B, N+1, H]
    idx = ops.arange(n + 1, dtype="float32")[None, :, None]  # [1, N+1, 1]
    lowest = ops.min(err, axis=1, keepdims=True)  # [B, 1, H]
    first = ops.min(
        ops.where(err <= lowest, idx, ops.full_like(err, 1.0) * (n_f + 1.0)), axis=1
    )  # [B, H]: ties -> oldest
    out = ops.cast(ops.equal(idx, first[:, None, :]), "float32")  # [B, N+1, H] one-hot
    enter = out * ops.cast(cand_ok, "float32")  # [B, N+1, H]: a real pair enters the state
    kf_e = ops.einsum("bxh,bxhc->bhc", enter, kf_c)  # [B, H, C]
    v_e = ops.einsum("bxh,bxhm->bhm", enter, v_c)  # [B, H, M]
    s = s + kf_e[..., :, None] * v_e[..., None, :]  # [B, H, C, M]
    z = z + kf_e  # [B, H, C]
    # The N kept candidates, in order: slot i takes candidate i before the evicted one, i + 1 from it on.
    before = ops.arange(n, dtype="float32")[None, :, None] < first[:, None, :]  # [B, N, H]
    k_n, kf_n, v_n = (ops.where(before[..., None], x[:, :-1], x[:, 1:]) for x in cand)  # [B, N, H, D|C|M]
    ok_c = ops.cast(cand_ok, "float32")  # [B, N+1, H]
    ok_n = ops.where(before, ok_c[:, :-1], ok_c[:, 1:])  # [B, N, H]
    return (s, z), (k_n, kf_n, v_n, ok_n), (kf_e, v_e)


def _cache_terms(q, cache):
    """The cache's softmax terms of one query ``q [B, H, D]`` (scaled), under the cache's own max.

    Returns ``(num [B, H, M], den [B, H, 1], peak [B, H, 1])``: ``sum exp(s_j - peak) v_j``,
    ``sum exp(s_j - peak)`` over the valid slots and their max logit (``_NEG`` for none).
    """
    keys, _, values, valid = cache
    scores = ops.einsum("bhd,bnhd->bhn", q, keys)  # [B, H, N]
    allowed = ops.transpose(valid, (0, 2, 1)) > 0  # [B, H, N]
    peak = ops.max(ops.where(allowed, scores, ops.full_like(scores, _NEG)), axis=-1, keepdims=True, initial=_NEG)
    e = ops.where(allowed, ops.exp(ops.minimum(scores - peak, 0.0)), ops.zeros_like(scores))  # [B, H, N]
    return ops.einsum("bhn,bnhm->bhm", e, values), ops.sum(e, axis=-1, keepdims=True), peak


def _scan_tokens(step, carry, xs, num_outputs):
    """``carry, ys = scan(step, carry, xs)`` over axis 0 of every tensor in `xs`; ``ys`` a list of `num_outputs`.

    TensorFlow: a ``tf.while_loop`` over TensorArrays (an ONNX Loop for
    tf2onnx, as `keras_linattn.ops.delta`'s chunk loop). Other backends:
    ``keras.ops.scan``.
    """
    if keras.backend.backend() != "tensorflow":
        carry, ys = ops.scan(lambda c, x: step(c, x), carry, xs)
        return carry, list(ys)
    import tensorflow as tf

    n = tf.shape(xs[0])[0]
    inputs = [tf.TensorArray(x.dtype, size=n, element_shape=x.shape[1:]).unstack(x) for x in xs]

    def body(i, c, acc):
        c, ys = step(c, [ta.read(i) for ta in inputs])
        return i + 1, c, tuple(a.write(i, y) for a, y in zip(acc, ys, strict=True))

    outs = tuple(tf.TensorArray(tf.float32, size=n) for _ in range(num_outputs))
    bound = xs[0].shape[0] if xs[0].shape[0] is not None else n  # static where known: XLA differentiates the loop
    _, carry, outs = tf.while_loop(
        lambda i, c, acc: i < n, body, (tf.constant(0), carry, outs), maximum_iterations=bound
    )
    return carry, [o.stack() for o in outs]


def _selection_loop(carry, xs, eps):
    """The parallel form's token loop: per token, the decision (`_admit`), then query i's cache terms."""

    def step(carry, x):
        (s, z), cache_i, (kf_e, v_e) = _admit(carry[:2], carry[2:], x[1:], eps)
        return (s, z) + cache_i, (kf_e, v_e) + _cache_terms(x[0], cache_i)

    return _scan_tokens(step, carry, xs, 5)


_COMPILED_SELECTION = []  # the `tf.function` of `_selection_loop`, built at the first eager call


def _selection(carry, xs, eps):
    """`_selection_loop`, run as one compiled function when TensorFlow executes eagerly.

    Eagerly, a ``tf.while_loop`` runs as a Python loop that dispatches every
    op of every token one by one from Python, which costs far more than the
    ops themselves. Called eagerly (a
    model called outside ``fit``/``predict``, e.g. ``model(x)``), the loop
    is therefore traced once per shape and `eps` and run as a graph;
    gradients taken with a ``GradientTape`` go through it as through the
    graph. Inside a traced function, and on other backends, it is inlined.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        if tf.executing_eagerly():
            if not _COMPILED_SELECTION:
                _COMPILED_SELECTION.append(tf.function(_selection_loop, reduce_retracing=True, autograph=False))
            return _COMPILED_SELECTION[0](carry, xs, eps)
    return _selection_loop(carry, xs, eps)


# ------------------------------------------------------------------ the cache's shape
def _check_cache(cache, h, d, c, m, name):
    if not isinstance(cache, (tuple, list)) or len(cache) != 4:
        raise ValueError(f"`{name}` must be (keys, features, values, valid). Received: {name}={cache!r}")
    n = cache[0].shape[1]
    for part, x, tail in zip(
        ("keys", "features", "values", "valid"), cache, ((h, d), (h, c), (h, m), (h,)), strict=True
    ):
        expected = (None, n) + tail
        shape = tuple(x.shape)
        if len(shape) != len(expected) or any(
            a is not None and b is not None and a != b for a, b in zip(shape, expected, strict=True)
        ):
            raise ValueError(
                f"`{name}` {part} must have shape [B, N, {', '.join(str(t) for t in tail)}] (N = {n}). "
                f"Received: {part}.shape={shape}"
            )
    return n


def _empty_cache(batch, n, h, d, c, m):
    return tuple(ops.zeros((batch, n, h) + tail, "float32") for tail in ((d,), (c,), (m,), ()))
