"""LinearTransformerDecoder: a pre-norm causal linear-attention transformer block."""

import keras

from keras_linattn.layers.transformer import _document, _LinearTransformerBlock

__all__ = ["LinearTransformerDecoder"]


@keras.saving.register_keras_serializable(package="keras_linattn")
@_document
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

        >>> import numpy as np
        >>> keras.utils.set_random_seed(0)
        >>> block = LinearTransformerDecoder(num_heads=4, intermediate_dim=128)
        >>> x = np.random.default_rng(0).normal(size=(2, 10, 64)).astype("float32")  # [B, T, dim]
        >>> y = np.asarray(block(x))  # causal
        >>> state = block.get_initial_state(2)
        >>> y0, state = block.step(x[:, 0], state)
        >>> y1, state = block.step(x[:, 1], state)
        >>> bool(np.allclose(np.stack([y0, y1], axis=1), y[:, :2], atol=1e-4))  # the recurrent form
        True
    """

    _causal = True
