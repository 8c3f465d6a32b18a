"""Linear (kernelized) attention as pure functions of feature-mapped tensors.

Shape legend (used in every shape comment of this package):

    B batch, T query length, S key length, H heads,
    D key dim, C feature dim, M value dim, L chunk length, N number of chunks

Given query features ``phi(q)`` ``[B, T, H, C]``, key features ``phi(k)``
``[B, S, H, C]`` and values ``v`` ``[B, S, H, M]``:

    out_i = phi(q_i)^T S / (phi(q_i)^T z),  S = sum_j phi(k_j) v_j^T,  z = sum_j phi(k_j)

Non-causal attention uses one ``(S, z)`` per batch and head. Causal attention
uses the chunkwise-parallel form: inside a chunk a masked ``L x L`` product,
across chunks an exclusive prefix sum of chunk states. Everything is
accumulated in float32 whatever the input dtype.

Internally the heads axis goes first (``[B, H, T, C]``) so that every
contraction is a batched matmul (measured 2-3x faster than the equivalent
einsums on CPU, forward and backward). Products with a transposed operand
go through `_matmul`, which hands the transpose to the matmul itself.

The helpers this module shares with the other ops (input checks, key
padding, the normalizer, the underflow flag, the chunked causal form) live
in `keras_linattn.ops._common`; they are imported here as well, so
``keras_linattn.ops.core._name`` still resolves.
"""

import numbers

from keras import ops

from keras_linattn._validation import check_bool, check_epsilon, check_non_negative_int, check_positive_int, check_rank

# The helpers shared with the other ops, from `_common`. Those this module
# does not use stay importable from here (``ops.core._name``) for the code
# and tests that name them through it: hence the noqa.
from keras_linattn.ops._common import (  # noqa: F401
    _TINY,
    KERNEL_FLOOR,
    KernelUnderflowError,
    _causal_chunked,
    _check_state,
    _chunk_prefix,
    _divide_rows,
    _fmt,
    _guarded_denominator,
    _has_keys,
    _heads_first,
    _is_eager,
    _mark_underflow,
    _mask_keys,
    _matmul,
    _normalize,
    _step_has_keys,
    _strict_lower,
    _two_level_group,
    _validate_inputs,
)

__all__ = ["DEFAULT_EPSILON", "KernelUnderflowError", "linear_attention", "linear_attention_step"]

DEFAULT_EPSILON = 1e-6


def linear_attention(
    q_features,
    k_features,
    v,
    causal=False,
    key_mask=None,
    chunk_size=64,
    initial_state=None,
    return_state=False,
    eps=DEFAULT_EPSILON,
    normalize=True,
):
    """Kernelized linear attention over feature-mapped queries and keys.

    Args:
        q_features: query features ``phi(q)``, ``[B, T, H, C]``.
        k_features: key features ``phi(k)``, ``[B, S, H, C]``.
        v: values, ``[B, S, H, M]``.
        causal: if True, query ``i`` attends to keys ``0..i`` only (requires
            ``S == T``). Computed with the chunkwise-parallel algorithm.
        key_mask: optional ``[B, S]`` boolean/0-1 mask, 1 for real keys.
            Padded keys contribute nothing (masking happens on the features,
            i.e. after the feature map).
        chunk_size: chunk length ``L`` of the causal algorithm. Any ``T`` is
            accepted; the sequence is padded to a multiple of ``L`` internally.
        initial_state: optional ``(S [B, H, C, M], z [B, H, C])`` to continue
            from, e.g. the state returned for the previous piece of a sequence.
        return_state: if True, also return the final state ``(S, z)``.
        eps: relative guard of the denominator: ``phi(q).z`` is replaced
            only where ``|phi(q).z| <= eps * |phi(q)|.|z|`` (the terms cancel,
            or there are none). For non-negative features that is
            ``phi(q).z = 0`` only. A query with no (unmasked) key gets 0; a
            row whose kernel underflowed float32 (real keys, nonzero query
            features, kernel magnitude at most `KERNEL_FLOOR` = 2^-103) raises `KernelUnderflowError` when
            eager and is NaN in a graph, never a silent 0.
        normalize: if False, return the numerator ``phi(q)^T S`` without the
            denominator (the caller normalizes the output some other way).

    Returns:
        ``[B, T, H, M]`` in the dtype of ``v`` (and the float32 state
        ``(S, z)`` if ``return_state``).
    """
    _validate_inputs(q_features, k_features, v, key_mask, causal)
    if initial_state is not None:
        _check_state(initial_state, q_features.shape[2], q_features.shape[3], v.shape[3], name="initial_state")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    check_epsilon("eps", eps, allow_zero=True)
    check_bool("normalize", normalize)
    out_dtype = v.dtype
    q = _heads_first(ops.cast(q_features, "float32"))  # [B, H, T, C]
    k = _heads_first(_mask_keys(ops.cast(k_features, "float32"), key_mask))  # [B, H, S, C]
    v = _heads_first(_mask_keys(ops.cast(v, "float32"), key_mask))  # [B, H, S, M]
    if initial_state is not None:
        s0, z0 = (ops.cast(x, "float32") for x in initial_state)
    else:
        s0 = z0 = None
    if causal:
        num, den, *den_abs, (s, z) = _causal_chunked(q, k, v, chunk_size, s0, z0, with_abs=normalize)
        den_abs = den_abs[0] if den_abs else None
    else:
        s = _matmul(k, v, transpose_a=True)  # [B, H, C, M]
        z = ops.sum(k, axis=2)  # [B, H, C]
        if s0 is not None:
            s, z = s + s0, z + z0
        num = ops.matmul(q, s)  # [B, H, T, M]
        den = ops.matmul(q, z[..., None])  # [B, H, T, 1]
        den_abs = ops.matmul(ops.abs(q), ops.abs(z)[..., None]) if normalize else None  # [B, H, T, 1]
    if normalize:
        out = _normalize(q, num, den, eps, den_abs)  # [B, H, T, M]
        num_keys = k.shape[2] if k.shape[2] is not None else ops.shape(k)[2]  # S
        out = _mark_underflow(out, q, den_abs, _has_keys(key_mask, causal, z0, q, num_keys))
    else:
        out = num  # [B, H, T, M]
    out = ops.cast(ops.transpose(out, (0, 2, 1, 3)), out_dtype)  # [B, T, H, M]
    if return_state:
        return out, (s, z)
    return out


def linear_attention_step(q_t, k_t, v_t, state, key_mask_t=None, eps=DEFAULT_EPSILON, normalize=True):
    """One recurrent step of causal linear attention.

    ``S <- S + phi(k_t) v_t^T``, ``z <- z + phi(k_t)``, then
    ``out_t = phi(q_t)^T S / phi(q_t)^T z``.

    Args:
        q_t: query features at step t, ``[B, H, C]``.
        k_t: key features at step t, ``[B, H, C]``.
        v_t: values at step t, ``[B, H, M]``.
        state: ``(S [B, H, C, M], z [B, H, C])``.
        key_mask_t: optional ``[B]`` mask; a masked step leaves the state
            unchanged.
        eps: relative denominator guard (see `linear_attention`).
        normalize: if False, return the numerator ``phi(q_t)^T S`` only.

    Returns:
        ``(out_t [B, H, M], (S, z))`` with the state in float32.
    """
    check_bool("normalize", normalize)
    check_rank("q_t", q_t, 3)
    check_rank("k_t", k_t, 3)
    check_rank("v_t", v_t, 3)
    _check_state(state, q_t.shape[1], q_t.shape[2], v_t.shape[2])
    check_epsilon("eps", eps, allow_zero=True)
    out_dtype = v_t.dtype
    q = ops.cast(q_t, "float32")  # [B, H, C]
    k = ops.cast(k_t, "float32")  # [B, H, C]
    v = ops.cast(v_t, "float32")  # [B, H, M]
    k = _mask_keys(k, key_mask_t)  # [B, H, C]
    v = _mask_keys(v, key_mask_t)  # [B, H, M]
    s, z = state
    s = ops.cast(s, "float32") + k[..., :, None] * v[..., None, :]  # [B, H, C, M]
    z = ops.cast(z, "float32") + k  # [B, H, C]
    num = ops.einsum("bhc,bhcm->bhm", q, s)  # [B, H, M]
    if not normalize:
        return ops.cast(num, out_dtype), (s, z)
    den = ops.sum(q * z, axis=-1, keepdims=True)  # [B, H, 1]
    den_abs = ops.sum(ops.abs(q) * ops.abs(z), axis=-1, keepdims=True)  # [B, H, 1]
    out = _normalize(q, num, den, eps, den_abs)  # [B, H, M]
    out = _mark_underflow(out, q, den_abs, _step_has_keys(z, key_mask_t))
    return ops.cast(out, out_dtype), (s, z)


def _zero_state(batch_size, num_heads, feature_dim, value_dim):
    """An empty state ``(S, z)``: zeros of ``[B, H, C, M]`` and ``[B, H, C]``."""
    if isinstance(batch_size, numbers.Integral):  # a symbolic batch size passes through
        batch_size = check_non_negative_int("batch_size", batch_size)
    num_heads = check_positive_int("num_heads", num_heads)
    feature_dim = check_positive_int("feature_dim", feature_dim)
    value_dim = check_positive_int("value_dim", value_dim)
    return (
        ops.zeros((batch_size, num_heads, feature_dim, value_dim), dtype="float32"),
        ops.zeros((batch_size, num_heads, feature_dim), dtype="float32"),
    )
