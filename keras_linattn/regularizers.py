"""Weight regularizers: the Frobenius orthogonality penalty for head-wise kernels."""

import keras
from keras import ops

from keras_linattn._validation import check_non_negative_float

__all__ = ["OrthogonalRegularizer"]


@keras.saving.register_keras_serializable(package="keras_linattn")
class OrthogonalRegularizer(keras.regularizers.Regularizer):
    """Soft orthogonality penalty ``factor * sum_h ||W_h W_h^T - I||_F^2``.

    The penalty of Jia et al. ("Orthogonal Deep Neural Networks"), applied
    per head: a rank-2 weight ``[D, C]`` is one matrix, a rank-3 weight
    ``[H, D, C]`` is ``H`` matrices (one per head) whose penalties are
    summed. The smaller Gram matrix is used: ``W W^T`` (``[D, D]``) when
    ``D <= C``, else ``W^T W`` (``[C, C]``), so the penalty is zero exactly
    when the rows (``D <= C``) or the columns (``D > C``) of every ``W_h``
    are orthonormal. It is computed in float32.

    How it differs from `keras.regularizers.OrthogonalRegularizer`: the
    Keras one accepts rank-2 weights only and penalizes
    ``factor * mean_{i<j} |cos(w_i, w_j)|``, the mean absolute cosine
    similarity between distinct rows (or columns) after L2 normalization. It
    ignores the norms of the rows, is zero for any matrix with orthogonal
    rows of any length (e.g. ``2 * I``), and is an L1-like penalty on the
    cosines. This one pulls each ``W_h`` towards an isometry: row norms are
    pulled to 1 as well, and the penalty is quadratic in the deviation,
    summed (not averaged) over entries and heads.

    Args:
        factor: non-negative regularization strength. Default 0.01.

    Example:

    >>> import numpy as np
    >>> reg = OrthogonalRegularizer(factor=0.5)
    >>> float(reg(np.eye(3, dtype="float32")))
    0.0
    >>> float(reg(2.0 * np.eye(2, dtype="float32")))  # 0.5 * (3^2 + 3^2)
    9.0
    """

    def __init__(self, factor=0.01):
        self.factor = check_non_negative_float("factor", factor)

    def __call__(self, x):
        rank = len(x.shape)
        if rank not in (2, 3):
            raise ValueError(
                "OrthogonalRegularizer expects a rank-2 [D, C] or rank-3 [H, D, C] weight. "
                f"Received: x.shape={tuple(x.shape)}"
            )
        w = ops.cast(x, "float32")
        if rank == 2:
            w = w[None]  # [1, D, C]
        rows, cols = w.shape[-2], w.shape[-1]
        if rows <= cols:
            gram = ops.einsum("hdc,hec->hde", w, w)  # [H, D, D]
        else:
            gram = ops.einsum("hdc,hde->hce", w, w)  # [H, C, C]
        eye = ops.eye(min(rows, cols), dtype="float32")[None]  # [1, n, n]
        return self.factor * ops.sum(ops.square(gram - eye))

    def get_config(self):
        return {"factor": self.factor}
