"""The decode contract: one state spec, one prefill, one decoding loop.

Everything that generates tokens goes through this module:

- `LinearCausalLM.generate` (Keras, any backend; XLA-compiled on TensorFlow),
- the SavedModel ``generate`` / ``generate_sampled`` signatures,
- the ONNX generate graph that `keras_linattn.export.OnnxGenerator` runs.

Shape legend: B batch, P prompt length, L output length (``max_length``),
V vocabulary size.

The contract, shared by all three:

- **Prompts** are ``[B, P]`` int32 ids with ``P >= 1``, optionally with a
  ``padding_mask [B, P]`` (1 = real token). Rows of different lengths are
  left-padded; every row has at least one real token.
- **max_length** is the total output length, prompt included, and must be
  ``>= P``. The output is ``[B, max_length]``: the prompt unchanged, then
  the generated tokens.
- **Prefill** runs the prompt through the model's parallel path
  (`prefill`), which returns the logits of the last position and the
  decode state.
- **Decoding** (`decode_loop`) then draws a token from the logits with a
  sampler, writes it, and feeds it to the model's recurrent ``step``, in a
  ``keras.ops.while_loop``.
- **Sampling** of token ``t`` (its index in the output) uses the stateless
  seed ``[seed, t]``: the same seed gives the same tokens everywhere
  (`keras_linattn.samplers.uniform_noise`).
- **Non-finite logits** (a row whose logits hold a NaN or +inf, or are all
  -inf: `keras_linattn.samplers.nonfinite_rows`), or a sampler's id outside
  ``[0, V)``, never give a token: the loop writes ``INVALID_TOKEN`` (-1)
  at that position and at every later position of the row, marks the row
  finished and feeds id 0 to ``step`` in its place, so the other rows
  decode on unchanged. The graphs (SavedModel, ONNX) return those -1;
  the Python front ends (`LinearCausalLM.generate`,
  `keras_linattn.export.OnnxGenerator`) raise `NonFiniteLogitsError`
  (`check_output_tokens`), naming the row and position.

The decode state is described once, by the model's `state_spec` (a list of
`StateSpec`: name, per-example shape, dtype); the initial state, the
state checks and the exported signatures are all derived from it.
"""

import numpy as np

from keras_linattn import _lazy, _state
from keras_linattn.samplers import INVALID_TOKEN, nonfinite_rows

ops = _lazy.module("keras.ops")  # loaded on first use: the argument checks are numpy only (keras_linattn.serving)

# The state contract lives in keras_linattn._state; re-exported here because
# the decode contract is where models meet it.
StateSpec = _state.StateSpec
zeros_state = _state.zeros_state
check_state = _state.check_state

__all__ = [
    "INVALID_TOKEN",
    "NonFiniteLogitsError",
    "StateSpec",
    "check_generate_arguments",
    "check_output_tokens",
    "check_state",
    "decode_loop",
    "generate_tokens",
    "prefill",
    "zeros_state",
]


class NonFiniteLogitsError(FloatingPointError, ValueError):
    """Raised by `LinearCausalLM.generate` and `OnnxGenerator.generate` where no token could be drawn.

    The logits that predict a position held a NaN or +inf, or were all -inf
    (`keras_linattn.samplers.nonfinite_rows`): the model produced NaN/inf
    there. Causes: a kernel that float32 cannot represent (eager calls raise
    `keras_linattn.ops.core.KernelUnderflowError`; compiled decoding and
    exported graphs give NaN instead), corrupt or NaN weights, or activations
    that overflow. The exported graphs return `INVALID_TOKEN` (-1) at those
    positions instead of raising.

    Attributes:
        rows: the rows (batch indices) that met non-finite logits.
        positions: for each of `rows`, the first position (index in the
            output, prompt included) that has no token.
    """

    def __init__(self, message, rows=(), positions=()):
        super().__init__(message)
        self.rows = list(rows)
        self.positions = list(positions)


def check_output_tokens(tokens, where="generate", vocabulary_size=None, custom_sampler=False):
    """Raises `NonFiniteLogitsError` if `tokens` ``[B, L]`` hold `INVALID_TOKEN` (-1).

    Args:
        tokens: the ``[B, L]`` output of the decode loop (numpy).
        where: the front end, for the message.
        vocabulary_size: V, for outputs that hold no padding id of the
            caller's: any id outside ``[0, V)`` is refused too (None: only
            -1 is).
        custom_sampler: True when the sampler is not a built-in one: an id
            outside ``[0, V)`` may then come from the sampler itself.

    Returns:
        `tokens`, unchanged, when no position is without a token.
    """
    tokens = np.asarray(tokens)
    bad = tokens == INVALID_TOKEN
    if vocabulary_size is not None:
        bad |= (tokens < 0) | (tokens >= vocabulary_size)
    if not bad.any():
        return tokens
    rows = [int(r) for r in np.flatnonzero(bad.any(axis=1))]
    positions = [int(np.argmax(bad[r])) for r in rows]
    found = ", ".join(f"row {r} from position {p}" for r, p in zip(rows, positions, strict=True))
    cause = " (or the custom sampler returned an id outside the vocabulary)" if custom_sampler else ""
    raise NonFiniteLogitsError(
        f"{where}: non-finite logits at row {rows[0]}, position {positions[0]}{cause}: the model produced "
        "NaN or inf there (a NaN or +inf logit, or every logit -inf), so no token can be drawn. Causes: a kernel "
        "that float32 cannot represent (flagged by KernelUnderflowError in eager calls, NaN in compiled or "
        "exported graphs), corrupt or NaN weights, or activations that overflow. Rows without a token: "
        f"{found} (the exported graphs return {INVALID_TOKEN} at those positions).",
        rows=rows,
        positions=positions,
    )


def check_generate_arguments(prompt_ids, max_length, padding_mask, vocabulary_size, max_sequence_length=None):
    """The contract's checks on a generate call, in NumPy (before any tracing).

    Returns:
        ``(prompt [B, P] int array, mask [B, P] bool or None, max_length int)``.

    Raises:
        ValueError: naming the argument, for an empty or non-integer prompt,
            ids outside ``[0, vocabulary_size)``, ``max_length`` below the
            prompt length or above `max_sequence_length`, or a padding mask
            that is not left-padded with at least one real token per row.
    """
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 2 or prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise ValueError(
            "`prompt_ids` must be a non-empty [batch, length] array of token ids. "
            f"Received: prompt_ids.shape={prompt.shape}"
        )
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"`prompt_ids` must hold integer token ids. Received: dtype={prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocabulary_size:
        raise ValueError(
            f"`prompt_ids` must be in [0, {vocabulary_size}). Received: min={prompt.min()}, max={prompt.max()}"
        )
    prompt_length = prompt.shape[1]
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < prompt_length:
        raise ValueError(
            f"`max_length` must be an integer >= the prompt length {prompt_length}. Received: max_length={max_length!r}"
        )
    max_length = int(max_length)
    if max_sequence_length is not None and max_length > max_sequence_length:
        raise ValueError(
            f"`max_length` exceeds the model's max_sequence_length={max_sequence_length}. "
            f"Received: max_length={max_length}"
        )
    mask = None
    if padding_mask is not None:
        mask = np.asarray(padding_mask).astype(bool)
        if mask.shape != prompt.shape:
            raise ValueError(
                f"`padding_mask` must have the prompt's shape {prompt.shape}. Received: padding_mask.shape={mask.shape}"
            )
        if not mask.any(axis=1).all() or (mask[:, 1:] < mask[:, :-1]).any():
            raise ValueError(
                "`padding_mask` rows must be left-padded (zeros then ones) with at least one "
                f"real token. Received: padding_mask={mask.astype(int).tolist()}"
            )
    return prompt, mask, max_length


def prefill(model, prompt_ids, padding_mask, state):
    """Parallel pass over the prompt: ``(logits of the last position [B, V] float32, state)``.

    Uses the model's ``last_logits_with_state`` where it has one (`LinearCausalLM`: the vocabulary
    projection of the last position only), else ``call_with_state`` and its last position.
    """
    last = getattr(model, "last_logits_with_state", None)
    if last is not None:
        logits, state = last(prompt_ids, state, padding_mask=padding_mask, training=False)  # [B, V]
        return ops.cast(logits, "float32"), _with_spec_shapes(model, state)
    logits, state = model.call_with_state(prompt_ids, state, padding_mask=padding_mask, training=False)  # [B, P, V]
    return ops.cast(logits[:, -1], "float32"), _with_spec_shapes(model, state)


def _with_spec_shapes(model, state):
    """`state` with the static per-example shapes of the model's `state_spec`, where a trace lost them.

    In one traced graph (the exported generate), a prefill's state can come
    out with dims the trace cannot know, e.g. a window buffer cut from
    ``[B, W + P, ...]`` with ``[:, -W:]``. The decoding loop would then carry
    that unknown dim, and the step traced inside it takes general forms
    (shape reads, einsums) where a step with the spec's shapes takes the
    one-token ones. A reshape to ``[-1, *shape]`` restores the spec's dims
    (a check, too: a state of any other size fails there). Eager tensors and
    states already of the spec's shape pass through untouched.
    """
    spec_of = getattr(model, "state_spec", None)
    if spec_of is None:
        return state
    spec = spec_of()
    if len(spec) != len(state):
        return state
    out = []
    for x, entry in zip(state, spec, strict=True):
        dims = tuple(entry.shape)
        known = all(isinstance(d, int) and d > 0 for d in dims) and len(x.shape) == len(dims) + 1
        if known and tuple(x.shape[1:]) != dims:
            x = ops.reshape(x, (-1,) + dims)
        out.append(x)
    return type(state)(out) if isinstance(state, (list, tuple)) else out


def decode_loop(model, sampler, tokens, logits, state, finished, index, end, seed, stop_token_ids=None, pad_token_id=0):
    """Draws tokens ``index .. end - 1`` into `tokens`, one recurrent step each.

    Args:
        model: a causal LM with ``step(token_t, state) -> (logits, state)``.
        sampler: ``sampler(logits [B, V], seed [2]) -> [B] int32``.
        tokens: ``[B, L]`` int32 output buffer (prompt, then anything).
        logits: ``[B, V]`` float32 logits that predict token `index`.
        state: the decode state after token ``index - 1``.
        finished: ``[B]`` bool, rows that already emitted a stop token (or
            met non-finite logits).
        index, end: int32 scalars, ``1 <= index <= end <= L``.
        seed: ``[2]`` int32; token ``t`` is drawn with ``seed + [0, t]``.
        stop_token_ids: optional ``[K]`` int32; a row that emits one is
            finished and gets `pad_token_id` afterwards. The loop ends early
            when every row is finished.
        pad_token_id: id written after a row's stop token (not
            `INVALID_TOKEN`).

    A row whose logits are not finite (`samplers.nonfinite_rows`), or for
    which the sampler returns an id outside ``[0, V)``, gets
    `INVALID_TOKEN` (-1) at that position and every later one (written at
    once, so an early end leaves them too) and is finished; ``step`` is fed
    id 0 for it (in range, so a graph's id check passes and the other rows
    go on). A row is known to be in that state by the -1 at ``index - 1``
    (a prompt holds no negative id).

    Returns:
        ``(tokens, logits, state, finished, index)``: the index reached is
        `end`, or less when every row finished.
    """
    length = ops.shape(tokens)[1]
    columns = ops.arange(length, dtype="int32")[None, :]  # [1, L]
    vocabulary_size = getattr(model, "vocabulary_size", None)

    def cond(tokens, logits, state, finished, index):
        return ops.logical_and(index < end, ops.logical_not(ops.all(finished)))

    def body(tokens, logits, state, finished, index):
        step_seed = ops.cast(seed, "int32") + ops.stack([ops.zeros_like(index), index])  # [2]
        drawn = ops.cast(sampler(logits, step_seed), "int32")  # [B]
        invalid = ops.logical_or(nonfinite_rows(logits), drawn < 0)  # [B]
        if vocabulary_size is not None:
            invalid = ops.logical_or(invalid, drawn >= vocabulary_size)
        newly_invalid = ops.logical_and(invalid, ops.logical_not(finished))  # [B]
        previous = ops.sum(ops.where(columns == index - 1, tokens, 0), axis=1)  # [B]: token index - 1
        no_token = ops.logical_or(newly_invalid, previous == INVALID_TOKEN)  # [B]
        next_ids = ops.where(finished, ops.full_like(drawn, pad_token_id), drawn)  # [B]
        next_ids = ops.where(no_token, ops.full_like(drawn, INVALID_TOKEN), next_ids)  # [B]
        # A where, not a slice update: it lowers to plain ops on every backend and in ONNX.
        tokens = ops.where(columns == index, next_ids[:, None], tokens)  # [B, L]
        tokens = ops.where(ops.logical_and(newly_invalid[:, None], columns > index), INVALID_TOKEN, tokens)  # [B, L]
        finished = ops.logical_or(finished, newly_invalid)
        if stop_token_ids is not None:
            hit = ops.any(next_ids[:, None] == stop_token_ids[None, :], axis=1)  # [B]
            finished = ops.logical_or(finished, hit)
        feed = ops.where(no_token, ops.zeros_like(next_ids), next_ids)  # [B]: id 0 is always valid for `step`
        logits, state = model.step(feed, state)  # [B, V]
        return tokens, ops.cast(logits, "float32"), list(state), finished, index + 1

    return ops.while_loop(cond, body, (tokens, logits, list(state), finished, index))


def generate_tokens(model, sampler, prompt_ids, padding_mask, max_length, seed, stop_token_ids=None, pad_token_id=0):
    """Prefill and decode in one call, for traced graphs (SavedModel, ONNX).

    Args:
        prompt_ids: ``[B, P]`` int32.
        padding_mask: ``[B, P]`` (1 = real token).
        max_length: int32 scalar ``>= P`` (a tensor is fine).
        seed: ``[2]`` int32.

    Returns:
        ``[B, max_length]`` int32 token ids; `INVALID_TOKEN` (-1) from the
        first position of a row whose logits were not finite (`decode_loop`).
    """
    prompt_ids = ops.cast(prompt_ids, "int32")
    batch, prompt_length = ops.shape(prompt_ids)[0], ops.shape(prompt_ids)[1]
    max_length = ops.cast(max_length, "int32")
    tail = ops.full((batch, ops.maximum(max_length - prompt_length, 0)), pad_token_id, dtype="int32")
    tokens = ops.concatenate([prompt_ids, tail], axis=1)  # [B, L]
    state = model.get_initial_state(batch)
    logits, state = prefill(model, prompt_ids, ops.cast(padding_mask, "bool"), state)  # [B, V]
    finished = ops.zeros((batch,), "bool")
    tokens, *_ = decode_loop(
        model,
        sampler,
        tokens,
        logits,
        state,
        finished,
        ops.cast(prompt_length, "int32"),
        max_length,
        seed,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
    )
    return tokens
