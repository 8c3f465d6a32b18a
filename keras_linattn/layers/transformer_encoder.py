"""LinearTransformerEncoder: a pre-norm bidirectional linear-attention transformer block."""

import keras

from keras_linattn.layers.transformer import _LinearTransformerBlock, document


@keras.saving.register_keras_serializable(package="keras_linattn")
@document
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

    >>> block = LinearTransformerEncoder(num_heads=4, intermediate_dim=128)
    >>> x = keras.random.normal((2, 10, 64))
    >>> mask = keras.ops.ones((2, 10), dtype="bool")
    >>> block(x, padding_mask=mask).shape
    (2, 10, 64)
    """

    _causal = False
