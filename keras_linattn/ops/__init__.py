"""Pure attention functions (no weights): linear and efficient attention, and exact references.

Each submodule declares its public names in its ``__all__``; this package
re-exports exactly those.
"""

from keras_linattn.ops import core, decay, delta, efficient, reference, rotary, short_conv, sparse_cache, window
from keras_linattn.ops.core import DEFAULT_EPSILON, KernelUnderflowError, linear_attention, linear_attention_step
from keras_linattn.ops.decay import (
    CHANNEL_CHUNK,
    gated_linear_attention,
    gated_linear_attention_reference,
    gated_linear_attention_step,
)
from keras_linattn.ops.delta import DELTA_CHUNK, delta_rule_attention, delta_rule_reference, delta_rule_step
from keras_linattn.ops.efficient import efficient_attention
from keras_linattn.ops.reference import (
    efficient_attention_reference,
    kernel_attention_reference,
    kernel_attention_weights,
    softmax_attention,
    softmax_attention_weights,
)
from keras_linattn.ops.rotary import rotary_embedding, rotary_embedding_reference
from keras_linattn.ops.short_conv import causal_conv, causal_conv_reference, causal_conv_step
from keras_linattn.ops.sparse_cache import (
    sparse_cache_attention,
    sparse_cache_attention_reference,
    sparse_cache_attention_step,
)
from keras_linattn.ops.window import window_attention, window_attention_reference, window_attention_step

__all__ = [
    *core.__all__,
    *decay.__all__,
    *delta.__all__,
    *efficient.__all__,
    *reference.__all__,
    *rotary.__all__,
    *short_conv.__all__,
    *sparse_cache.__all__,
    *window.__all__,
]
