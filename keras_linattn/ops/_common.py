"""What the attention ops share: input and state checks, key padding, heads-first products, the normalizer.

`keras_linattn.ops.core` (causal and non-causal linear attention), the
gated (`decay`), delta, window, efficient and short-convolution ops and
their float64 oracles use these helpers, so that every op refuses the same
inputs with the same messages, pads keys the same way and guards its
denominator and flags an underflowed kernel the same way:

- `_validate_inputs`, `_check_state`: shapes of ``q, k, v, key_mask`` and
  of a ``(S, z)`` state, naming the argument.
- `_mask_keys`: the one implementation of key padding.
- `_heads_first`, `_matmul`: the heads axis goes first (``[B, H, T, C]``)
  so that every contraction is a batched matmul (measured 2-3x faster than
  the equivalent einsums on CPU, forward and backward); products with a
  transposed operand hand the transpose to the matmul itself.
- `_normalize`, `_guarded_denominator`, `_divide_rows`: ``num / den``
  guarded only where the denominator is degenerate.
- `_has_keys`, `_step_has_keys`, `_mark_underflow`, `KERNEL_FLOOR`,
  `KernelUnderflowError`: rows whose kernel float32 cannot represent.
- `_causal_chunked` and `_chunk_prefix`: the chunkwise-parallel causal
  form of `linear_attention`, reused by the window op for its linear part.

`keras_linattn.ops.core` imports every name here, so ``ops.core._name``
(and ``ops.core.KernelUnderflowError``, its public home) still resolve.
Shapes follow the legend of `keras_linattn.ops.core`.
"""

import keras
from keras import ops

from keras_linattn._validation import check_rank
from keras_linattn._xla import under_xla

# Added to the denominator guard so that a zero query feature vector with no
# keys gives 0 / tiny = 0 instead of 0 / 0.
_TINY = 1e-30


def _validate_inputs(q, k, v=None, key_mask=None, causal=False, names=("q_features", "k_features", "v")):
    """Checks the ranks and shapes of attention inputs, naming the arguments.

    ``q [B, T, H, C]``, ``k [B, S, H, C]``, optional ``v [B, S, H, M]`` and
    ``key_mask [B, S]``; with `causal`, ``S == T``. Used by
    `linear_attention` and by the quadratic references, so a fast path and
    its oracle refuse the same inputs with the same messages.

    Raises:
        ValueError: naming the argument and the shape received.
    """
    q_name, k_name, v_name = names
    check_rank(q_name, q, 4)
    check_rank(k_name, k, 4)
    if v is not None:
        check_rank(v_name, v, 4)
    if q.shape[3] is not None and k.shape[3] is not None and q.shape[3] != k.shape[3]:
        raise ValueError(
            f"`{q_name}` and `{k_name}` must have the same feature dim C. "
            f"Received: {q_name}.shape={tuple(q.shape)}, {k_name}.shape={tuple(k.shape)}"
        )
    others = ((k_name, k),) if v is None else ((k_name, k), (v_name, v))
    for name, x in others:
        if q.shape[2] is not None and x.shape[2] is not None and q.shape[2] != x.shape[2]:
            raise ValueError(
                f"`{q_name}` and `{name}` must have the same number of heads H. "
                f"Received: {q_name}.shape={tuple(q.shape)}, {name}.shape={tuple(x.shape)}"
            )
    ks = k.shape[1]
    if v is not None and ks is not None and v.shape[1] is not None and ks != v.shape[1]:
        raise ValueError(
            f"`{k_name}` and `{v_name}` must have the same length S. "
            f"Received: {k_name}.shape={tuple(k.shape)}, {v_name}.shape={tuple(v.shape)}"
        )
    if key_mask is not None:
        check_rank("key_mask", key_mask, 2)
        if ks is not None and key_mask.shape[1] is not None and key_mask.shape[1] != ks:
            raise ValueError(
                f"`key_mask` must have shape [B, S] matching `{k_name}`. "
                f"Received: key_mask.shape={tuple(key_mask.shape)}, "
                f"{k_name}.shape={tuple(k.shape)}"
            )
    if causal and q.shape[1] is not None and ks is not None and q.shape[1] != ks:
        raise ValueError(
            "`causal=True` needs as many keys as queries (S == T). "
            f"Received: {q.shape[1]} queries and {ks} keys "
            f"({q_name}.shape[1]={q.shape[1]}, {k_name}.shape[1]={ks})"
        )


def _check_state(state, num_heads, feature_dim, value_dim, batch_size=None, name="state"):
    """Validates a linear-attention state ``(S [B, H, C, M], z [B, H, C])``.

    Raises:
        ValueError: naming `name` and the shapes received, if the state is not
            a pair of tensors of the expected shapes.
    """
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(
            f"`{name}` must be a pair (S, z) with S of shape [B, H, C, M] and z of "
            f"shape [B, H, C]. Received: {name}={state!r}"
        )
    s, z = state
    expected_s = (batch_size, num_heads, feature_dim, value_dim)
    expected_z = (batch_size, num_heads, feature_dim)
    for part, x, expected in (("S", s, expected_s), ("z", z, expected_z)):
        shape = tuple(x.shape)
        ok = len(shape) == len(expected) and all(
            e is None or d is None or d == e for d, e in zip(shape, expected, strict=True)
        )
        if not ok:
            raise ValueError(
                f"`{name}` {part} must have shape {_fmt(expected)}. "
                f"Received: {name}[{0 if part == 'S' else 1}].shape={shape}"
            )
    if tuple(s.shape)[0] is not None and tuple(z.shape)[0] is not None and s.shape[0] != z.shape[0]:
        raise ValueError(
            f"`{name}` S and z must have the same batch size. "
            f"Received: S.shape={tuple(s.shape)}, z.shape={tuple(z.shape)}"
        )


def _fmt(shape):
    return "[" + ", ".join("B" if d is None else str(d) for d in shape) + "]"


def _mask_keys(x, key_mask):
    """Zeroes what belongs to padded keys: keys, key features or values.

    The one implementation of key padding in the package (the attention
    functions, the recurrent step and the attention layers all call it).
    ``key_mask`` has the leading dims of ``x`` (``[B, S]`` for ``x [B, S, H, X]``,
    ``[B]`` for one step's ``x [B, H, X]``); nonzero / True marks a real key.

    `where`, not a product: a NaN or Inf at a padded position must not
    reach the real outputs (0 * NaN is NaN).
    """
    if key_mask is None:
        return x
    keep = ops.cast(key_mask, "bool")  # [B, S] (or [B])
    extra = len(x.shape) - len(keep.shape)
    if len(keep.shape) == 1 and extra:
        keep = ops.reshape(keep, (-1,) + (1,) * extra)  # [B, 1, 1]: one ONNX node where the loop makes two
    for _ in range(len(x.shape) - len(keep.shape)):
        keep = ops.expand_dims(keep, -1)  # ends as [B, S, 1, 1] (or [B, 1, 1])
    return ops.where(keep, x, ops.zeros((), x.dtype))  # a scalar: no zeros the size of x (nor, in ONNX, its shape)


def _matmul(a, b, transpose_a=False, transpose_b=False):
    """``a @ b`` over the last two axes, with ``a`` and/or ``b`` transposed there.

    On TensorFlow this is one ``BatchMatMulV2`` with its adjoint flags. A
    separate transpose before the matmul costs nothing in graph mode, but
    XLA on CPU folds it into the dot's layout, which made the non-causal core
    slower forward + backward (measured in `docs/dev/benchmarks.md`). Other
    backends transpose, then multiply.
    """
    if keras.backend.backend() == "tensorflow" and a.dtype == b.dtype:
        import tensorflow as tf

        return tf.linalg.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    if transpose_a:
        a = ops.swapaxes(a, -1, -2)
    if transpose_b:
        b = ops.swapaxes(b, -1, -2)
    return ops.matmul(a, b)


def _heads_first(x):
    """[B, T, H, X] -> [B, H, T, X]: batched matmuls are much faster than einsum here."""
    return ops.transpose(x, (0, 2, 1, 3))


def _normalize(q, num, den, eps, den_abs=None):
    """``num / den``, guarded only where the denominator is degenerate (q: [..., C]).

    With ``den_abs`` (``[..., 1]``, the magnitude of the terms summed into
    ``den``: ``|phi(q)| . |z|``, which equals ``den`` for non-negative
    features) the guard is relative to the denominator itself: ``den`` is
    replaced only where ``|den| <= eps * den_abs``, i.e. where the terms
    cancel (signed maps) or where there is nothing to divide (``den = 0``,
    e.g. a row whose keys are all padded: ``num = 0`` there and the output
    is 0, never NaN). For non-negative features that is ``den = 0`` only:
    every other row is the exact ratio, with its exact gradient (the guard
    is a constant for autodiff). A negative ``den`` of a signed map is kept:
    that is what exact kernel attention divides by.

    Without ``den_abs`` the older guard applies: ``den`` is floored at
    ``eps * sum|phi(q)| + 1e-30`` (kept for callers that have no ``den_abs``;
    every recurrence in `ops/` passes one).

    Outside XLA the division goes through `_divide_rows`, whose hand-written
    gradient is the exact one in fewer passes over the ``[..., M]`` tensors;
    XLA fuses the autodiff of a plain division by itself, and a custom
    gradient only keeps it from fusing.
    """
    if den_abs is None:
        guard = eps * ops.sum(ops.abs(q), axis=-1, keepdims=True) + _TINY  # [..., 1]
        den = ops.maximum(den, guard)  # [..., 1]
    else:
        den = _guarded_denominator(den, den_abs, eps)  # [..., 1]
    if under_xla():
        return num / den
    return _divide_rows(num, den)


def _guarded_denominator(den, den_abs, eps):
    """``den`` replaced only where ``|den| <= eps * den_abs`` (by that guard, or 1 where it is 0); any dtype.

    The guard of `_normalize` with ``den_abs``, shared with the float64
    oracles of the recurrences so that they divide by the same thing. The
    guard is a constant for autodiff.
    """
    guard = ops.stop_gradient(eps * den_abs)  # [..., 1]
    degenerate = ops.abs(den) <= guard  # [..., 1]: cancelled, or 0
    return ops.where(degenerate, ops.where(guard > 0, guard, ops.ones((), guard.dtype)), den)  # [..., 1]


class KernelUnderflowError(ValueError):
    """Raised (eagerly) where float32 features cannot represent the attention kernel of a row.

    A row with at least one real key, nonzero query features and
    ``|phi(q)| . |z| <= 2^-103`` has a kernel that float32 cannot hold: its
    products sum to less than ``1 / eps32 = 2^23`` times float32's smallest
    normal number (2^-126), where products are flushed to 0 (CPU and XLA
    flush subnormals), so a single term lost at that edge moves the output
    by more than float32's rounding; at 0 every product underflowed. The
    exact ratio ``phi(q)^T S / phi(q)^T z`` cannot be formed. The same
    error is raised by `keras_linattn.layers.LinearAttention` for causal rows
    that attend to a favor_trig key whose amplitude ``exp(|k'|^2/2)`` is past
    the cap ``exp(50)`` (the capped features are not that key's kernel). In
    graph mode (`tf.function`, XLA, SavedModel, ONNX), where nothing can
    raise, such a row is NaN instead: never a silent 0 or a wrong value. The
    gated (``decay``) and window recurrences follow the same rule. See
    docs/dev/hardening.md.
    """


def _has_keys(key_mask, causal, z0, like, num_keys):
    """``[B, 1|H, 1|T, 1]`` bool: the row attends to at least one real key (or a carried state), or None for all.

    ``num_keys`` is the key length S (a Python int or a scalar tensor): with
    no key (S = 0) and no carried state there is nothing to attend to, and
    the output row is 0 like an all-padded row's, not an underflow.
    """
    if key_mask is None and z0 is None and isinstance(num_keys, int) and num_keys > 0:
        return None
    has = None
    if key_mask is not None:
        real = ops.cast(ops.cast(key_mask, "bool"), "float32")  # [B, S]
        if causal:
            has = (ops.cumsum(real, axis=1) > 0)[:, None, :, None]  # [B, 1, T, 1]
        else:
            has = (ops.sum(real, axis=1) > 0)[:, None, None, None]  # [B, 1, 1, 1]
    else:
        has = ops.logical_and(ops.ones_like(like[..., :1, :1]) > 0, num_keys > 0)  # [B, H, 1, 1]
    if z0 is not None:
        carried = ops.any(ops.not_equal(z0, 0.0), axis=-1)[:, :, None, None]  # [B, H, 1, 1]
        has = ops.logical_or(has, carried)
    return has


def _step_has_keys(z, key_mask_t):
    """``[B, H, 1]`` bool for one step (state ``z [B, H, C]`` after the step), or None for all rows.

    The step's own key counts as a real key; a masked step only knows its state.
    """
    if key_mask_t is None:
        return None
    has_keys = ops.any(ops.not_equal(z, 0.0), axis=-1, keepdims=True)  # [B, H, 1]
    return ops.logical_or(has_keys, ops.cast(key_mask_t, "bool")[:, None, None])


# A row whose kernel magnitude |phi(q)|.|z| is at most this is not representable in float32 (see
# `KernelUnderflowError`): 2^-126 (the smallest normal float32, below which CPU and XLA flush to 0)
# over eps32 = 2^-23, so that one flushed term changes the output by more than float32's rounding.
KERNEL_FLOOR = 2.0**-103


def _mark_underflow(out, q, den_abs, has_keys):
    """NaN rows where the kernel underflowed (`KernelUnderflowError`); raises instead when eager."""
    floor = ops.cast(KERNEL_FLOOR, den_abs.dtype)
    underflow = ops.logical_and(den_abs <= floor, ops.sum(ops.abs(q), axis=-1, keepdims=True) > 0)  # [..., 1]
    if has_keys is not None:
        underflow = ops.logical_and(underflow, has_keys)
    if _is_eager(underflow):
        count = int(ops.convert_to_numpy(ops.sum(ops.cast(underflow, "int32"))))
        if count:
            raise KernelUnderflowError(
                f"{count} attention row(s) have real keys but a kernel that underflows float32: the "
                "products phi(q) . phi(k) sum to at most 2^-103, at the edge of float32's range where "
                "products flush to 0, so the output is not representable (it would be 0 or wrong). Scale "
                "the queries/keys down (e.g. a LayerNorm before attention) or use "
                f"a map that stabilizes them. Received: {count} underflowed row(s) of shape {tuple(out.shape)}"
            )
        return out
    # sqrt(-1) = NaN where flagged, sqrt(-0) = -0 elsewhere (x + -0 == x bit for bit). Not a
    # `where` with a NaN branch: tf2onnx's own lowering of `where` is products (0 * NaN = NaN
    # everywhere); `export_onnx` converts it to ONNX Where, but other converters may not.
    marker = ops.sqrt(-ops.cast(ops.stop_gradient(underflow), out.dtype))  # [..., 1]
    return out + marker


def _is_eager(x):
    """True for a concrete (eager) tensor, whose values can be read now.

    TensorFlow: eager execution and a tensor with values. JAX: an array
    that is not a tracer (under `jax.jit`, `grad` or Keras' symbolic
    passes, values are tracers and the rows are marked NaN instead, as in
    a TensorFlow graph). Other backends: False.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and hasattr(x, "numpy")
    if backend == "jax":
        import jax

        return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    return False


@ops.custom_gradient
def _divide_rows(num, den):
    """``num / den`` for ``num [..., M]`` and a positive ``den [..., 1]``.

    Autodiff of a broadcasting division spends five passes over ``[..., M]``
    on the gradient (a division for ``num``; a negation, two divisions and a
    product before the reduction for ``den``). With ``r = 1 / den`` and
    ``out = num * r`` the same gradient is ``g * r`` and
    ``-sum(g * r * out)``: three passes. Measured on the attention core at
    N=8192 (forward + backward, CPU): about 5 ms of 60 non-causal and of 130
    causal (`docs/dev/benchmarks.md`). Tested against autodiff of ``num / den``.
    """
    r = 1.0 / den  # [..., 1]
    out = num * r  # [..., M]

    def grad(*args, upstream=None):
        if upstream is None:
            (upstream,) = args
        g_num = upstream * r  # [..., M]
        g_den = -ops.sum(g_num * out, axis=-1, keepdims=True)  # [..., 1]
        return g_num, g_den

    return out, grad


def _chunk_prefix(x):
    """Exclusive prefix sum over the chunk axis 2 of ``x [B, H, N, ...]``, as matmuls.

    ``out[:, :, n] = sum_{j < n} x[:, :, j]``, computed as ``tri @ x`` with the
    strictly lower-triangular ``[N, N]`` 0/1 matrix ``tri``. On CPU this is
    about 6x faster, forward and backward, than a cumulative sum followed by
    the shift that makes it exclusive (`benchmarks/results/profile_*.md`), and
    it is a plain matmul for XLA and ONNX. The price: a non-finite chunk state
    reaches every chunk through ``0 * inf`` (a NaN in a real token turns the
    whole sequence to NaN instead of only the outputs after it).

    ``tri @ x`` costs ``N^2`` multiply-adds per state entry. Where ``N`` is
    static and has a divisor ``G`` with ``4 <= G <= sqrt(N)`` (N=128 chunks:
    G=8), the sum is taken in two levels instead: inside groups of ``G``
    chunks with a ``[G, G]`` triangle, and across the ``N / G`` group totals
    with an ``[N/G, N/G]`` one, added back by broadcasting: ``N (G + N/G)``
    multiply-adds, the same terms summed in another order
    (`_two_level_group`).
    """
    shape = ops.shape(x)
    n = x.shape[2]
    group = _two_level_group(n)
    flat = ops.reshape(x, (shape[0], shape[1], shape[2], -1))  # [B, H, N, X]
    if group is None:
        return ops.reshape(ops.matmul(_strict_lower(shape[2], x.dtype), flat), shape)  # [B, H, N, ...]
    grouped = ops.reshape(flat, (shape[0], shape[1], n // group, group, -1))  # [B, H, N/G, G, X]
    within = ops.matmul(_strict_lower(group, x.dtype), grouped)  # [B, H, N/G, G, X]
    totals = ops.sum(grouped, axis=3)  # [B, H, N/G, X]
    before = ops.matmul(_strict_lower(n // group, x.dtype), totals)  # [B, H, N/G, X]
    return ops.reshape(within + ops.expand_dims(before, 3), shape)  # [B, H, N, ...]


def _strict_lower(n, dtype):
    """The strictly lower-triangular ``[n, n]`` 0/1 matrix: ``out[i, j] = 1`` iff ``j < i``."""
    idx = ops.arange(n)
    return ops.cast(ops.expand_dims(idx, 1) > ops.expand_dims(idx, 0), dtype)  # [n, n]


def _two_level_group(n):
    """The group size of `_chunk_prefix`'s two-level sum for ``n`` chunks, or None for one level.

    The largest divisor ``G`` of a static ``n`` with ``G * G <= n``, if it is
    at least 4 (fewer than 16 chunks stay one level: their ``[N, N]``
    matmul is small, and smaller groups were not measured).
    Measured at N=128 chunks (causal core, N=8192 tokens, forward +
    backward, CPU): G=8 102 ms, G=16 107 ms, one level 112 ms.
    """
    if n is None:
        return None
    best = None
    g = 4
    while g * g <= n:
        if n % g == 0:
            best = g
        g += 1
    return best


def _causal_chunked(q, k, v, chunk_size, s0, z0, with_abs=False):
    """Chunkwise-parallel causal attention on float32 heads-first tensors.

    ``q, k: [B, H, T, C]``, ``v: [B, H, T, M]``. For chunk n:
    ``O_n = Q_n S_{n-1} + tril(Q_n K_n^T) V_n`` (and the same with ``z`` for
    the denominator), ``S_n = S_{n-1} + K_n^T V_n`` where ``S_{n-1}`` is an
    exclusive prefix sum over chunks (`_chunk_prefix`). Returns the numerator
    and denominator before normalization, the denominator's magnitude
    ``sum_j |phi(q).phi(k_j)|`` over the chunk plus ``|phi(q)| . |z|`` over
    earlier chunks (None unless `with_abs`; equal to the denominator for
    non-negative features) and the final state:
    ``(num [B, H, T, M], den [B, H, T, 1], den_abs, (S, z))`` (without
    `with_abs`: ``(num, den, (S, z))``).
    """
    t_static = q.shape[2]  # S == T was checked by `_validate_inputs`
    h, c, m = q.shape[1], q.shape[3], v.shape[3]
    batch = ops.shape(q)[0]
    length = ops.shape(q)[2]
    chunk = chunk_size
    if t_static is not None:
        # Never use chunks longer than the (static) sequence.
        chunk = max(1, min(chunk_size, t_static))
    # No padding (a copy forward and a slice gradient backward) where the
    # static length is a multiple of the chunk.
    padded = t_static is None or t_static % chunk != 0
    if padded:
        # Both operands non-negative: floor and truncated modulo agree (some
        # converters, e.g. tf2onnx for integer FloorMod, emit the truncated one).
        pad = (chunk - length % chunk) % chunk
        paddings = [[0, 0], [0, 0], [0, pad], [0, 0]]
        q, k, v = ops.pad(q, paddings), ops.pad(k, paddings), ops.pad(v, paddings)
    qc = ops.reshape(q, (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    kc = ops.reshape(k, (batch, h, -1, chunk, c))  # [B, H, N, L, C]
    vc = ops.reshape(v, (batch, h, -1, chunk, m))  # [B, H, N, L, M]

    # Intra-chunk: masked L x L products.
    scores = _matmul(qc, kc, transpose_b=True)  # [B, H, N, L, L]
    tril = ops.tril(ops.ones((chunk, chunk), dtype="bool"))  # [L, L]
    scores = ops.where(tril, scores, ops.zeros_like(scores))
    num = ops.matmul(scores, vc)  # [B, H, N, L, M]
    den = ops.sum(scores, axis=-1, keepdims=True)  # [B, H, N, L, 1]
    den_abs = ops.sum(ops.abs(scores), axis=-1, keepdims=True) if with_abs else None  # [B, H, N, L, 1]

    # Inter-chunk: exclusive prefix sums of chunk states.
    chunk_s = _matmul(kc, vc, transpose_a=True)  # [B, H, N, C, M]
    chunk_z = ops.sum(kc, axis=3)  # [B, H, N, C]
    excl_s = _chunk_prefix(chunk_s)  # [B, H, N, C, M]
    excl_z = _chunk_prefix(chunk_z)  # [B, H, N, C]
    # A sum, not a last entry: an empty sequence (N = 0) has the zero state.
    s_final, z_final = ops.sum(chunk_s, axis=2), ops.sum(chunk_z, axis=2)  # [B, H, C, M], [B, H, C]
    if s0 is not None:
        excl_s = excl_s + s0[:, :, None]
        excl_z = excl_z + z0[:, :, None]
        s_final, z_final = s_final + s0, z_final + z0
    num = num + ops.matmul(qc, excl_s)  # [B, H, N, L, M]
    den = den + ops.matmul(qc, excl_z[..., None])  # [B, H, N, L, 1]

    num = ops.reshape(num, (batch, h, -1, m))  # [B, H, T (+ padding), M]
    den = ops.reshape(den, (batch, h, -1, 1))  # [B, H, T (+ padding), 1]
    if padded:
        num, den = num[:, :, :length], den[:, :, :length]
    if not with_abs:
        return num, den, (s_final, z_final)
    den_abs = den_abs + ops.matmul(ops.abs(qc), ops.abs(excl_z)[..., None])  # [B, H, N, L, 1]
    den_abs = ops.reshape(den_abs, (batch, h, -1, 1))[:, :, :length]  # [B, H, T, 1]
    return num, den, den_abs, (s_final, z_final)
