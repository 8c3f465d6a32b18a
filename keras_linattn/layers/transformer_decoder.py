"""LinearTransformerDecoder: a pre-norm causal linear-attention transformer block."""

import keras

from keras_linattn.layers.transformer import _LinearTransformerBlock, document


@keras.saving.register_keras_serializable(package="keras_linattn")
@document
class LinearTransformerDecoder(_LinearTransformerBlock):
    """Pre-norm transformer decoder block with causal linear self-attention.

    ``x = x + Dropout(LinearAttention(LayerNorm(x)))`` (causal), then
    ``x = x + Dropout(Dense(activation(Dense(LayerNorm(x)))))``. This is the
    block `keras_linattn.models.LinearCausalLM` stacks. The block has no
    cross-attention (decoder-only language models).

    Training uses the chunkwise-parallel causal path; decoding uses `step`,
    the same weights in recurrent form with a constant-size state
    ``(S [B, H, C, M], z [B, H, C])``. ``call(..., return_state=True)``
    returns the state after the last token, and ``initial_state=`` resumes
    from one, so a long sequence can be processed in pieces.

    Args:
{block_args}

    Call arguments:
        inputs: ``[B, T, dim]``.
        padding_mask: optional ``[B, T]`` (1 = real token). Padded tokens
            are left out of the attention state, so left-padded sequences
            give the same outputs at the real tokens as unpadded ones. A Keras
            mask on `inputs` is used when `padding_mask` is None.
        training: Python boolean (dropout).
        return_state: also return the final state ``(S, z)``.
        initial_state: optional state to resume from.

    Returns:
        ``[B, T, dim]``, and the state if `return_state`.

    Example:

    >>> block = LinearTransformerDecoder(num_heads=4, intermediate_dim=128)
    >>> x = keras.random.normal((2, 10, 64))
    >>> y = block(x)                                   # [2, 10, 64], causal
    >>> state = block.get_initial_state(2)
    >>> y0, state = block.step(x[:, 0], state)         # equals y[:, 0]
    """

    _causal = True
