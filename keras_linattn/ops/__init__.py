"""Pure attention functions (no weights): linear and efficient attention, and exact references.

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those.
"""

from keras_linattn.ops import core, efficient, reference
from keras_linattn.ops.core import DEFAULT_EPSILON, linear_attention, linear_attention_step
from keras_linattn.ops.efficient import efficient_attention
from keras_linattn.ops.reference import (
    efficient_attention_reference,
    kernel_attention_reference,
    kernel_attention_weights,
    softmax_attention,
    softmax_attention_weights,
)

__all__ = [*core.__all__, *efficient.__all__, *reference.__all__]
