"""LinearTransformerEncoder: a pre-norm bidirectional linear-attention transformer block."""

import keras

from keras_linattn.layers.transformer import _document, _LinearTransformerBlock

__all__ = ["LinearTransformerEncoder"]


@keras.saving.register_keras_serializable(package="keras_linattn")
@_document
class LinearTransformerEncoder(_LinearTransformerBlock):
    """Pre-norm transformer encoder block with non-causal linear attention.

        ``x = x + Dropout(LinearAttention(LayerNorm(x)))`` (every token attends
        to every unpadded token), then
        ``x = x + Dropout(Dense(activation(Dense(LayerNorm(x)))))``.
        Cost is ``O(T * C * M)`` per head instead of ``O(T^2)``.

        `step` is streaming encoding: it adds one token to the state
        ``(S, z) = (sum_j phi(k_j) v_j^T, sum_j phi(k_j))`` and returns that
        token's output against every token seen so far, i.e. the output at
        position t of the encoder applied to ``x[:, :t+1]``. Earlier outputs are
        not revised (a non-causal encoder's outputs change when tokens arrive;
        re-query the final state with ``call(..., initial_state=...)`` for that).
        ``call(..., return_state=True)`` returns the state summarizing the whole
        (unpadded) sequence, and ``initial_state=`` adds a previous state to it.

        Args:
    {block_args}

        Call arguments:
            inputs: ``[B, T, dim]``.
            padding_mask: optional ``[B, T]`` (1 = real token); padded tokens are
                left out of every token's attention. A Keras mask on `inputs` is
                used when `padding_mask` is None.
            training: Python boolean (dropout).
            return_state: also return the state ``(S, z)`` of the whole sequence.
            initial_state: optional state added to this sequence's.

        Returns:
            ``[B, T, dim]``, and the state if `return_state`.

        Example:

        >>> import numpy as np
        >>> keras.utils.set_random_seed(0)
        >>> block = LinearTransformerEncoder(num_heads=4, intermediate_dim=128)
        >>> x = np.random.default_rng(0).normal(size=(2, 10, 64)).astype("float32")  # [B, T, dim]
        >>> mask = np.ones((2, 10), bool)
        >>> mask[1, 7:] = False  # the second row has 7 real tokens
        >>> y = np.asarray(block(x, padding_mask=mask))
        >>> y_short = np.asarray(block(x[1:, :7]))
        >>> y.shape, bool(np.allclose(y[1, :7], y_short[0], atol=1e-4))  # padding changes no real token
        ((2, 10, 64), True)
    """

    _causal = False
