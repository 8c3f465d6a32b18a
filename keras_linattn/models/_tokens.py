"""The token side of `LinearBackbone`: id and mask checks, positions, and the marking of invalid tokens.

A token id outside ``[0, vocabulary_size)`` or a position past
``max_sequence_length`` never reaches the embedding: in eager calls it is a
`ValueError` naming the value; in graphs (where a check cannot raise under
XLA) the row's hidden states become NaN (`_MarkInvalid`), which `generate`
and the exports report as -1 tokens.
"""

import keras
from keras import ops

from keras_linattn import _compat, _validation

__all__ = []


def _is_concrete(x):
    """True for a tensor with values (eager), False inside a traced function."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly() and not _compat.is_tf_symbolic_tensor(x)
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


def _max_or_none(x):
    """The largest entry of a concrete tensor (None when empty), for error messages."""
    return int(ops.max(x)) if int(ops.size(x)) else None


def _unpack_inputs(inputs, padding_mask=None):
    """``(token_ids, padding_mask)`` from a tensor (and `padding_mask`) or keras-hub's dict.

    Raises:
        ValueError: for a dict without ``"token_ids"``, a dict given with a
            separate `padding_mask`, or a tuple/list (ambiguous: fit's
            ``(x, y)``).
    """
    if isinstance(inputs, dict):
        unknown = set(inputs) - {"token_ids", "padding_mask"}
        if "token_ids" not in inputs or unknown:
            raise ValueError(
                'Inputs given as a dict must be {"token_ids": [B, T], "padding_mask": [B, T] (optional)}. '
                f"Received: keys={sorted(inputs)}"
            )
        if padding_mask is not None:
            raise ValueError("Pass `padding_mask` inside the inputs dict or as an argument, not both.")
        return inputs["token_ids"], inputs.get("padding_mask")
    if isinstance(inputs, (list, tuple)):
        raise ValueError(
            'Inputs must be token ids [B, T] or a dict {"token_ids", "padding_mask"}; a tuple is ambiguous '
            f"(fit reads (x, y) from it). Received: a {type(inputs).__name__} of {len(inputs)} items"
        )
    return inputs, padding_mask


def _nan_where(bad, x):
    """`x` (``[B, T, d]`` or ``[B, d]``), NaN at the tokens marked in `bad` (``[B, T]``/``[B]``; None: unchanged)."""
    if bad is None:
        return x
    # A scalar NaN: tf2onnx lowers a where between two full tensors to x * c + y * (1 - c),
    # where NaN * 0 poisons every row.
    return ops.where(bad[..., None], ops.cast(float("nan"), x.dtype), x)


def _check_ids_form(token_ids, name, rank, max_sequence_length):
    """`token_ids` as a tensor of the right rank, an integer dtype and a length within `max_sequence_length`."""
    token_ids = ops.convert_to_tensor(token_ids)
    if len(token_ids.shape) != rank:
        shape = "[batch, length]" if rank == 2 else "[batch]"
        raise ValueError(f"`{name}` must have shape {shape}. Received: {name}.shape={tuple(token_ids.shape)}")
    if "int" not in str(token_ids.dtype):
        raise ValueError(f"`{name}` must be integer token ids. Received: {name}.dtype={token_ids.dtype}")
    if rank == 2 and token_ids.shape[1] is not None and max_sequence_length is not None:
        if token_ids.shape[1] > max_sequence_length:
            raise ValueError(
                f"`{name}` is longer than max_sequence_length={max_sequence_length}. "
                f"Received: {name}.shape={tuple(token_ids.shape)}"
            )
    return token_ids


def _check_token_ids(token_ids, name, rank, vocabulary_size, max_sequence_length):
    """`_check_ids_form`, then the range: checked (concrete ids) or a run-time assertion (traced)."""
    token_ids = _check_ids_form(token_ids, name, rank, max_sequence_length)
    if _is_concrete(token_ids) and int(ops.size(token_ids)) > 0:
        # Concrete ids are checked (a negative id would silently wrap around
        # in the embedding lookup); inside a traced graph (fit, XLA) they
        # can't be without a per-step assertion.
        low, high = int(ops.min(token_ids)), int(ops.max(token_ids))
        if low < 0 or high >= vocabulary_size:
            raise ValueError(f"`{name}` must be in [0, {vocabulary_size}). Received: min={low}, max={high}")
    elif not _is_concrete(token_ids):
        # Traced (fit, predict, SavedModel): a run-time assertion before the lookup.
        ok = ops.logical_and(ops.all(token_ids >= 0), ops.all(token_ids < vocabulary_size))
        token_ids = _validation.graph_assert(token_ids, ok, f"`{name}` must be in [0, {vocabulary_size})")
    return token_ids


def _past_limit(token_ids, last_index, name, received, vocabulary_size, max_sequence_length):
    """The rule "a row holds at most `max_sequence_length` tokens", and what graphs do instead.

    `last_index` is the index each token would have in its row (the
    state's position plus its index in the piece; padding counts):
    ``[B, T]`` or ``[B]``. Concrete values raise here (`received`, a
    function, gives the message's values). In a traced graph the rule is
    a run-time assertion (`_validation.graph_assert`), and the tokens
    that break it or have an id outside the vocabulary are marked: their
    outputs (and so the task's logits) are NaN, which is what graphs without assertions (XLA, ONNX)
    return.

    Returns:
        ``(token_ids, bad)``: the ids (behind the assertion in graphs),
        and None (concrete inputs) or the ``[B, T]`` / ``[B]`` bool mark.
    """
    limit = max_sequence_length
    if _is_concrete(last_index):
        if limit is not None and int(ops.size(last_index)) and int(ops.max(last_index)) >= limit:
            raise ValueError(
                f"`{name}` runs past max_sequence_length={limit}: a row would hold "
                f"{int(ops.max(last_index)) + 1} tokens. Received: {received()}"
            )
        return token_ids, None
    bad = ops.logical_or(token_ids < 0, token_ids >= vocabulary_size)
    if limit is not None:
        past = last_index >= limit
        token_ids = _validation.graph_assert(
            token_ids, ops.logical_not(ops.any(past)), f"`{name}` runs past max_sequence_length={limit}"
        )
        bad = ops.logical_or(bad, past)
    return token_ids, bad


def _positions(token_ids, padding_mask, start):
    """Position of each token: real tokens before it (start [B] + prefix count)."""
    if padding_mask is None:
        length = ops.shape(token_ids)[1]
        offsets = ops.arange(length, dtype="int32")[None, :]  # [1, T]
        count = ops.zeros_like(start) + length
    else:
        mask = ops.cast(ops.cast(padding_mask, "bool"), "int32")  # [B, T], nonzero = real
        offsets = ops.cumsum(mask, axis=1) - mask  # [B, T]
        count = ops.sum(mask, axis=1)  # [B]
    return start[:, None] + offsets, start + count  # [B, T], [B]


def _check_padding_mask(padding_mask, token_ids):
    if padding_mask is None:
        return None
    padding_mask = ops.convert_to_tensor(padding_mask)
    static_match = len(padding_mask.shape) == 2 and all(
        a is None or b is None or a == b for a, b in zip(padding_mask.shape, token_ids.shape, strict=True)
    )
    if not static_match:
        raise ValueError(
            "`padding_mask` must have the shape of the token ids [batch, length]. "
            f"Received: padding_mask.shape={tuple(padding_mask.shape)}, "
            f"token_ids.shape={tuple(token_ids.shape)}"
        )
    return padding_mask


def _start_of(token_ids, state):
    """The position of each row before `token_ids` (``[B]`` int32): the state's, or 0."""
    if state is None:
        return ops.zeros((ops.shape(token_ids)[0],), "int32")
    return ops.cast(state[-1], "int32")


def _prepare(token_ids, padding_mask, state, vocabulary_size, max_sequence_length):
    """Checks a piece of sequences: ``(token_ids, padding_mask, positions [B, T], end [B], bad)``.

    `start` is the state's position (0 without a state); `end` the position
    after the piece; `bad` is None or the tokens whose outputs are NaN
    (`_past_limit`).
    """
    token_ids = _check_token_ids(token_ids, "token_ids", 2, vocabulary_size, max_sequence_length)
    padding_mask = _check_padding_mask(padding_mask, token_ids)
    start = _start_of(token_ids, state)
    last_index = start[:, None] + ops.arange(ops.shape(token_ids)[1], dtype="int32")[None, :]  # [B, T]
    token_ids, bad = _past_limit(
        token_ids,
        last_index,
        "token_ids",
        lambda: f"state position={_max_or_none(start)}, token_ids.shape={tuple(token_ids.shape)}",
        vocabulary_size,
        max_sequence_length,
    )
    positions, end = _positions(token_ids, padding_mask, start)
    return token_ids, padding_mask, positions, end, bad


def _embed(token_embedding, position_embedding, token_ids, positions, scale=None):
    """Token embeddings (times `scale`, if given), plus the learned positions (clipped to the table) if any."""
    x = token_embedding(token_ids)  # [B, T, dim] or [B, dim]
    if scale is not None:
        # A Python float, converted where the graph is traced: a tensor made here would be captured from
        # outside a traced graph (an exported graph would take it as an input).
        x = x * scale  # Gemma: sqrt(hidden_dim); the tied head reads the unscaled table
    if position_embedding is not None:
        limit = position_embedding.input_dim
        x = x + position_embedding(ops.clip(positions, 0, limit - 1))  # [B, T, dim] or [B, dim]
    return x


def _quantize_nothing(self, mode=None, type_check=True, config=None):
    """No weights, nothing to quantize: `keras.Model.quantize` calls this on every leaf layer, and Keras
    warns about a layer without it.

    Args:
        mode: the quantization mode (``"int8"``, ``"int4"``...), ignored.
        type_check: Keras' argument, ignored.
        config: Keras' `QuantizationConfig`, ignored.
    """
    del self, mode, type_check, config


class _MarkInvalid(keras.layers.Layer):
    """The last node of `LinearBackbone`'s graph: NaN hidden states at the tokens `_TokenCheck` marks invalid.

    A layer, not an op in the graph: the NaN constant is then made while
    the graph is traced, not captured from outside it (which an exported
    graph would take as an input). No weights.
    """

    quantize = _quantize_nothing

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.built = True

    def call(self, hidden, invalid):
        if _is_concrete(invalid):  # concrete inputs raise in `_TokenCheck` instead: nothing is marked
            return hidden
        return _nan_where(invalid, hidden)  # [B, T, dim]

    def compute_output_spec(self, hidden, invalid):
        return keras.KerasTensor(hidden.shape, hidden.dtype)


class _TokenCheck(keras.layers.Layer):
    """The first node of `LinearBackbone`'s graph: checks the token ids and the padding mask.

    Returns ``(token_ids, positions, invalid)``: the ids (behind a run-time
    range assertion in traced graphs), each token's position (real tokens
    before it, ``[B, T]`` int32), and the ``[B, T]`` bool mark of the tokens
    whose hidden states are NaN (an id outside the vocabulary or past
    `max_sequence_length` in a traced graph; all False for concrete inputs,
    which raise instead). No weights.
    """

    quantize = _quantize_nothing

    def __init__(self, vocabulary_size, max_sequence_length, **kwargs):
        super().__init__(**kwargs)
        self.vocabulary_size = vocabulary_size
        self.max_sequence_length = max_sequence_length
        self.built = True

    def call(self, token_ids, padding_mask=None):
        token_ids, _, positions, _, bad = _prepare(
            token_ids, padding_mask, None, self.vocabulary_size, self.max_sequence_length
        )
        if bad is None:
            bad = ops.zeros(ops.shape(token_ids), "bool")
        return token_ids, positions, bad  # positions: [B, T] (the start [B] plus each offset)

    def compute_output_spec(self, token_ids, padding_mask=None):
        shape = tuple(token_ids.shape)
        return (
            keras.KerasTensor(shape, "int32"),
            keras.KerasTensor(shape, "int32"),
            keras.KerasTensor(shape, "bool"),
        )

    def get_config(self):
        config = super().get_config()
        config.update({"vocabulary_size": self.vocabulary_size, "max_sequence_length": self.max_sequence_length})
        return config
