"""keras-hub's `CausalLM` protocol on a decode state: `score`, the cache entry, and `generate_step`'s batches.

keras-hub's `CausalLM.generate` preprocesses each batch into a frame
``{"token_ids": [B, L], "padding_mask": [B, L]}`` (the mask marks the
prompt; the other columns are room to generate) and hands it to the
function `make_generate_function` returns, ``f(inputs, stop_token_ids)``.
`LinearCausalLM` answers with `generate_step`, which this module runs on
the package's own compiled prefill and decoding loop
(`LinearCausalLM._generate_ids`, `keras_linattn.generation`): the
frame is turned into the decode contract's left-padded prompt, decoded,
and the new tokens are written back into the frame.

keras-hub's cache becomes the decode state (`LinearCausalLM.state_spec`):
`prefill_cache` is the prefill (an empty state, then the prompt through the
parallel path) and `call_with_cache` runs tokens from a state, one token
in recurrent form (`step`), longer pieces in parallel (`call_with_state`).

Shape legend: B batch, L frame length, P prompt length, T piece length,
V vocabulary size, dim hidden width.
"""

import keras
import numpy as np
from keras import ops

from keras_linattn.models._tokens import _nan_where, _prepare

SCORING_MODES = ("logits", "loss")


def _hidden_with_intercept(lm, token_ids, padding_mask, layer_intercept_fn):
    """The backbone's layers one by one, `layer_intercept_fn` after the embeddings (-1) and after each block."""
    backbone = lm.backbone
    token_ids, padding_mask, positions, _, bad = _prepare(
        token_ids, padding_mask, None, backbone.vocabulary_size, backbone.max_sequence_length
    )
    x = layer_intercept_fn(backbone.embed(token_ids, positions), -1)  # [B, T, dim]
    for index, block in enumerate(backbone.decoder_blocks):
        x = layer_intercept_fn(block(x, padding_mask=padding_mask), index)  # [B, T, dim]
    return _nan_where(bad, backbone.final_norm(x))  # [B, T, dim]


def score_tokens(lm, token_ids, padding_mask=None, scoring_mode="logits", layer_intercept_fn=None, target_ids=None):
    """`LinearCausalLM.score`: keras-hub's `CausalLM.score` (see there for the arguments)."""
    if scoring_mode not in SCORING_MODES:
        raise ValueError(f"`scoring_mode` must be one of {SCORING_MODES}. Received: scoring_mode={scoring_mode!r}")
    if scoring_mode == "loss" and target_ids is None:
        raise ValueError(
            "`scoring_mode='loss'` needs the target token ids: pass `target_ids` ([batch, length], e.g. the "
            "token ids shifted left by one). Received: target_ids=None"
        )
    if layer_intercept_fn is not None and not callable(layer_intercept_fn):
        raise TypeError(
            "`layer_intercept_fn` must be a function `(activations, layer_index) -> activations` or None. "
            f"Received: layer_intercept_fn={layer_intercept_fn!r}"
        )
    token_ids = ops.convert_to_tensor(token_ids)
    if len(token_ids.shape) != 2:
        raise ValueError(f"`token_ids` must have shape [batch, length]. Received: token_ids.shape={token_ids.shape}")
    if target_ids is not None:
        target_ids = ops.convert_to_tensor(target_ids)
        if tuple(target_ids.shape) != tuple(token_ids.shape):
            raise ValueError(
                f"`target_ids` must have the shape of `token_ids` {tuple(token_ids.shape)}. "
                f"Received: target_ids.shape={tuple(target_ids.shape)}"
            )
    if padding_mask is None:
        padding_mask = ops.ones(ops.shape(token_ids), "int32")
    padding_mask = ops.cast(ops.cast(ops.convert_to_tensor(padding_mask), "bool"), "int32")
    if layer_intercept_fn is None:
        logits = lm(token_ids, padding_mask=padding_mask)  # [B, T, V]
    else:
        logits = lm._head(_hidden_with_intercept(lm, token_ids, padding_mask, layer_intercept_fn))  # [B, T, V]
    if scoring_mode == "logits":
        return logits
    per_token_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    return per_token_loss(target_ids, logits)  # [B, T]


# ------------------------------------------------------------------ the cache
def prefill_cache(lm, token_ids, padding_mask=None):
    """keras-hub's `_build_cache`: ``(hidden_states [B, P, dim], cache)`` after the prompt, from an empty state."""
    batch_size = token_ids.shape[0] if getattr(token_ids, "shape", None) is not None else None
    if batch_size is None:
        batch_size = ops.shape(token_ids)[0]
    state = lm.get_initial_state(batch_size)
    return lm.backbone.call_with_state(token_ids, state, padding_mask=padding_mask, training=False)


def run_with_cache(lm, token_ids, cache, padding_mask=None):
    """keras-hub's `call_with_cache`: ``(logits [B, T, V], hidden_states [B, T, dim], cache)``.

    A one-token piece (static ``T == 1``) runs the recurrent `step`, as
    decoding does; a longer one the parallel `call_with_state`.
    """
    token_ids = ops.convert_to_tensor(token_ids)
    if len(token_ids.shape) != 2:
        raise ValueError(f"`token_ids` must have shape [batch, length]. Received: token_ids.shape={token_ids.shape}")
    if token_ids.shape[1] == 1 and padding_mask is None:
        hidden, cache = lm.backbone.step(token_ids[:, 0], cache)  # [B, dim]
        hidden = hidden[:, None]  # [B, 1, dim]
    else:
        hidden, cache = lm.backbone.call_with_state(token_ids, cache, padding_mask=padding_mask, training=False)
    return lm._head(hidden), hidden, cache


# ------------------------------------------------------------ generate_step
def _frame(inputs):
    """``inputs`` (keras-hub's ``{"token_ids", "padding_mask"}`` or a ``[B, L]`` array) as numpy ``(ids, mask)``."""
    if isinstance(inputs, dict):
        if "token_ids" not in inputs:
            raise ValueError(f"`inputs` must hold 'token_ids' (and 'padding_mask'). Received: keys={sorted(inputs)}")
        token_ids, padding_mask = inputs["token_ids"], inputs.get("padding_mask")
    else:
        token_ids, padding_mask = inputs, None
    token_ids = np.asarray(ops.convert_to_numpy(token_ids))
    if token_ids.ndim != 2 or 0 in token_ids.shape:
        raise ValueError(f"`token_ids` must be a non-empty [batch, length] array. Received: shape={token_ids.shape}")
    if padding_mask is None:
        mask = np.ones(token_ids.shape, bool)
    else:
        mask = np.asarray(ops.convert_to_numpy(padding_mask)).astype(bool)
    if mask.shape != token_ids.shape:
        raise ValueError(
            f"`padding_mask` must have the shape of `token_ids` {token_ids.shape}. "
            f"Received: padding_mask.shape={mask.shape}"
        )
    return token_ids, mask


def _prompt_spans(mask):
    """Each row's prompt ``[start, end)``: the mask must be one run of ones per row (zeros, ones, zeros)."""
    starts = np.argmax(mask, axis=1)  # [B]
    ends = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)  # [B]
    counts = mask.sum(axis=1)  # [B]
    bad = (counts == 0) | (counts != ends - starts)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            "Each row's `padding_mask` must mark its prompt as one run of ones (left padding, the prompt, then the "
            f"columns to generate), with at least one token. Received: padding_mask[{row}]="
            f"{mask[row].astype(int).tolist()}"
        )
    return starts, ends, counts


def _contract_prompt(token_ids, mask, starts, ends, counts, pad_token_id):
    """The decode contract's ``[B, P]`` left-padded prompt and its mask for the frame's prompts.

    Where every prompt ends at the same column (left padding, as
    `LinearCausalLMPreprocessor` packs), the frame's columns before it are
    the prompt as they are; otherwise (keras-hub's right padding) each
    row's prompt is moved to end at the last column of a ``[B, max count]``
    block.
    """
    if (ends == ends[0]).all():
        return token_ids[:, : ends[0]], mask[:, : ends[0]]
    width = int(counts.max())
    prompt = np.full((token_ids.shape[0], width), pad_token_id, token_ids.dtype)
    prompt_mask = np.zeros(prompt.shape, bool)
    for row, (start, end, count) in enumerate(zip(starts, ends, counts, strict=True)):
        prompt[row, width - count :] = token_ids[row, start:end]
        prompt_mask[row, width - count :] = True
    return prompt, prompt_mask


def generated_mask(generated, stop_token_ids):
    """``[B, N]`` bool: the generated tokens up to and including each row's first stop token."""
    if not stop_token_ids:
        return np.ones(generated.shape, bool)
    hit = np.isin(generated, np.asarray(list(stop_token_ids)))
    return np.cumsum(hit, axis=1) - hit == 0


def generate_frame(lm, inputs, stop_token_ids=None, **options):
    """`LinearCausalLM.generate_step` on one keras-hub frame, through `LinearCausalLM._generate_ids`.

    Args:
        lm: the `LinearCausalLM`.
        inputs: ``{"token_ids": [B, L], "padding_mask": [B, L]}``: each
            row's prompt is one run of ones in the mask (left padding
            before it is allowed); the columns after it are generated.
        stop_token_ids: ids that end a row, or None.
        **options: `_generate_ids` arguments: ``sampler``, ``seed``,
            ``pad_token_id``, ``verbose``, ``block_size``.

    Returns:
        ``{"token_ids": [B, L] int32, "padding_mask": [B, L] bool}``: the
        frame with each row's new tokens after its prompt; the mask marks
        the prompt and the new tokens up to and including the first stop
        token.
    """
    token_ids, mask = _frame(inputs)
    starts, ends, counts = _prompt_spans(mask)
    length = token_ids.shape[1]
    pad_token_id = options.get("pad_token_id", 0)
    prompt, prompt_mask = _contract_prompt(token_ids, mask, starts, ends, counts, pad_token_id)
    new = length - int(ends.min())  # the most any row generates
    max_length = prompt.shape[1] + new
    if lm.max_sequence_length is not None and max_length > lm.max_sequence_length:
        raise ValueError(
            f"Rows whose prompts end at different columns (right padding) are decoded as left-padded prompts of "
            f"{prompt.shape[1]} columns plus {new} new tokens, more than max_sequence_length="
            f"{lm.max_sequence_length}; left-pad the prompts (`LinearCausalLMPreprocessor`). Received: prompt ends "
            f"{ends.tolist()} in a frame of {length} columns"
        )
    tokens = lm._generate_ids(
        prompt.astype("int32"),
        max_length,
        options.get("sampler"),
        options.get("seed"),
        stop_token_ids,
        prompt_mask,
        pad_token_id,
        options.get("verbose", False),
        options.get("block_size"),
    )
    generated = tokens[:, prompt.shape[1] :]  # [B, new]
    keep = generated_mask(generated, stop_token_ids)  # [B, new]
    out, out_mask = token_ids.astype("int32"), mask.copy()
    for row, end in enumerate(ends):
        out[row, end:] = generated[row, : length - end]
        out_mask[row, end:] = keep[row, : length - end]
    return {"token_ids": out, "padding_mask": out_mask}


class CausalLMProtocol:
    """keras-hub's `CausalLM` protocol for `LinearCausalLM` (a mixin before keras-hub's `CausalLM`).

    `make_generate_function` / `generate_step` (what keras-hub's
    `CausalLM.generate` calls), `_build_cache` / `call_with_cache` (the
    decode state as keras-hub's cache) and `score`. The model provides
    `_generate_ids`, `_head`, `backbone`, `preprocessor` and the decode
    state API (`get_initial_state`, `step`, `call_with_state`).
    """

    def make_generate_function(self):
        """keras-hub's: the function `keras_hub.models.CausalLM.generate` runs on each batch, `generate_step`.

        `generate_step` is not traced as a whole (its prefill and decoding
        loop are compiled and cached by `_generate_functions`, once per
        prompt shape and sampler), so it is returned as it is.

        Returns:
            ``generate_function(inputs, stop_token_ids=None) -> {"token_ids", "padding_mask"}``.
        """
        if getattr(self, "generate_function", None) is None:
            self.generate_function = self.generate_step
        return self.generate_function

    def generate_step(self, inputs, stop_token_ids=None):
        """keras-hub's generation of one batch: the frame's prompts, then new tokens in its other columns.

        What `keras_hub.models.CausalLM.generate` calls (through
        `make_generate_function`), so that keras-hub's own `generate` --
        its preprocessing, ``stop_token_ids``, ``strip_prompt`` and
        postprocessing -- runs on this model. It runs `generate`'s own
        compiled functions (`_generate_functions`: the parallel prefill
        from an empty state, as `_build_cache`, then
        `generation.decode_loop` over `step`), with the sampler given to
        `compile`. Random samplers of `keras_linattn.samplers`
        draw a seed from NumPy's global generator here
        (`keras.utils.set_random_seed` fixes it); keras-hub samplers use
        their own seed.

        Args:
            inputs: ``{"token_ids": [B, L], "padding_mask": [B, L]}``, the
                mask 1 on each row's prompt: one run of ones, left padding
                before it allowed (`LinearCausalLMPreprocessor`'s
                `generate_preprocess(x, sequence_length=L)`), or prompts
                from column 0 (keras-hub's right padding). The columns
                after a row's prompt are generated.
            stop_token_ids: ids that end a row (its later columns get the
                pad id and are masked out), or None.

        Returns:
            ``{"token_ids": [B, L] int32, "padding_mask": [B, L] bool}``:
            the mask marks each row's prompt and its new tokens up to and
            including the first stop token.

        Raises:
            ValueError: for a mask that is not one run of ones per row,
                token ids outside the vocabulary, or a frame longer than
                `max_sequence_length`; `generation.NonFiniteLogitsError`
                where no token can be drawn.
        """
        tokenizer = None if self.preprocessor is None else self.preprocessor.tokenizer
        pad_token_id = getattr(tokenizer, "pad_token_id", None) or 0
        return generate_frame(self, inputs, stop_token_ids, pad_token_id=pad_token_id)

    def _build_cache(self, token_ids, padding_mask=None):
        """keras-hub's prefill: an empty decode state (the cache), then the prompt through the parallel path.

        Args:
            token_ids: ``[B, P]`` int token ids.
            padding_mask: optional ``[B, P]`` (1 = real token; left padding).

        Returns:
            ``(hidden_states [B, P, dim], cache)``: the cache is the decode
            state (`state_spec`).
        """
        return prefill_cache(self, token_ids, padding_mask)

    def call_with_cache(self, token_ids, cache, cache_update_index=None, padding_mask=None):
        """keras-hub's cached forward pass, with the decode state as the cache.

        Args:
            token_ids: ``[B, T]`` int token ids that follow the cache.
            cache: the decode state (`_build_cache`, `get_initial_state`,
                `step` or a previous call).
            cache_update_index: keras-hub's column of ``token_ids[:, 0]``.
                Not read: the state holds each row's position (its count of
                real tokens), which differs from the column in a
                left-padded batch.
            padding_mask: optional ``[B, T]`` (1 = real token).

        Returns:
            ``(logits [B, T, V] float32, hidden_states [B, T, dim], cache)``.
            One token (``T == 1``, no mask) runs the recurrent `step`, a
            longer piece the parallel path; chaining pieces gives the
            logits of one pass.
        """
        return run_with_cache(self, token_ids, cache, padding_mask)

    def score(self, token_ids, padding_mask=None, scoring_mode="logits", layer_intercept_fn=None, target_ids=None):
        """keras-hub's `CausalLM.score`: per-token logits or loss of given token ids.

        Args:
            token_ids: ``[B, T]`` int token ids to score.
            padding_mask: optional ``[B, T]`` (1 = real token; default all
                ones). Padded tokens do not enter the attention state;
                scores at padded positions are not meaningful.
            scoring_mode: ``"logits"`` or ``"loss"``.
            layer_intercept_fn: optional ``fn(activations, index) ->
                activations`` applied to the embeddings (index -1) and to
                each block's output (index 0, 1, ...), as in keras-hub.
            target_ids: ``[B, T]`` int ids the loss is computed against
                (required for ``"loss"``; typically `token_ids` shifted left).

        Returns:
            ``[B, T, V]`` float32 logits, or the ``[B, T]`` per-token
            sparse categorical cross-entropy.

        Raises:
            ValueError: for another `scoring_mode`, ``"loss"`` without
                `target_ids`, or ids / targets of the wrong shape.
            TypeError: for a `layer_intercept_fn` that is not callable.
        """
        return score_tokens(self, token_ids, padding_mask, scoring_mode, layer_intercept_fn, target_ids)
