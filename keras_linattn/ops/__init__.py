"""Pure attention functions (no weights): linear and efficient attention, and exact references."""

from keras_linattn.ops.core import (
    DEFAULT_EPSILON,
    check_state,
    linear_attention,
    linear_attention_step,
    zero_state,
)
from keras_linattn.ops.decay import (
    gated_linear_attention,
    gated_linear_attention_reference,
    gated_linear_attention_step,
)
from keras_linattn.ops.efficient import efficient_attention
from keras_linattn.ops.short_conv import causal_conv, causal_conv_reference, causal_conv_step
from keras_linattn.ops.window import window_attention, window_attention_reference, window_attention_step
from keras_linattn.ops.reference import (
    efficient_attention_reference,
    kernel_attention_reference,
    kernel_attention_weights,
    softmax_attention,
    softmax_attention_weights,
)

__all__ = [
    "DEFAULT_EPSILON",
    "causal_conv",
    "causal_conv_reference",
    "causal_conv_step",
    "check_state",
    "efficient_attention",
    "efficient_attention_reference",
    "gated_linear_attention",
    "gated_linear_attention_reference",
    "gated_linear_attention_step",
    "kernel_attention_reference",
    "kernel_attention_weights",
    "linear_attention",
    "linear_attention_step",
    "softmax_attention",
    "softmax_attention_weights",
    "window_attention",
    "window_attention_reference",
    "window_attention_step",
    "zero_state",
]
