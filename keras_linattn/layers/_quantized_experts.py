"""The int8 form of `MixtureOfExperts`: Keras' int8 machinery on the expert kernels, products in int8.

Keras' `Dense.quantize("int8")` rounds each kernel to int8 with one scale
per output channel (`keras.quantizers.AbsMaxQuantizer` over the contracted
axis), keeps the scale as a non-trainable ``*_scale`` weight, and in its
call quantizes the inputs per row, multiplies int8 by int8 into int32 and
divides by both scales, with a custom gradient through the dequantized
kernel. The experts' kernels get the same treatment, one scale per expert
and output channel (``[E, I]`` for ``[E, dim, I]``). The products are
`ops.matmul` over int8 operands (an int32 product, a `MatMulInteger` in
ONNX), batched over the experts: the sequence form multiplies every token
by every expert's kernel, the one-token form gathers the `top_k` picked
experts' int8 kernels and their scales.

The router stays float: its output is a discrete choice (`top_k`), and a
rounding error in a router logit swaps the experts a token goes through, a
change of the output that no error bound of the rounding covers. It is
``dim x E`` weights against the experts' ``3 E dim I``; llama.cpp keeps it
unquantized for the same reason (its ``ffn_gate_inp`` tensors).
"""

import keras
from keras import ops

from keras_linattn import _compat

# (attribute, weight name, contracted axis) of the kernels `quantize("int8")` rounds, in the order their int8
# weights are created (the order `save_own_variables` writes them in). The router is not among them.
EXPERT_KERNELS = (
    ("gate_kernel", "expert_gate_kernel", 1),  # [E, dim, I]
    ("up_kernel", "expert_up_kernel", 1),  # [E, dim, I]
    ("down_kernel", "expert_down_kernel", 1),  # [E, I, dim]
)
SHARED_KERNELS = (
    ("shared_gate_kernel", "shared_expert_gate_kernel", 0),  # [dim, S]
    ("shared_up_kernel", "shared_expert_up_kernel", 0),  # [dim, S]
    ("shared_down_kernel", "shared_expert_down_kernel", 0),  # [S, dim]
    ("shared_weight_kernel", "shared_expert_weight_kernel", 0),  # [dim, 1]
)


def kernels(layer):
    """The ``(attribute, weight name, contracted axis)`` of `layer`'s quantizable kernels."""
    return EXPERT_KERNELS + (SHARED_KERNELS if layer.shared_expert_dim is not None else ())


def _inputs_quantizer(config):
    return keras.quantizers.QuantizationConfig.activation_quantizer_or_default(
        config, keras.quantizers.AbsMaxQuantizer()
    )


def int8_build(layer, shapes, config=None):
    """Adds `layer`'s int8 kernels and their scales (zeros and ones), in `kernels` order; returns nothing.

    Args:
        layer: a `MixtureOfExperts` whose float kernels are not (or no longer) there.
        shapes: ``{attribute: kernel shape}``.
        config: optional `keras.quantizers.QuantizationConfig` (its activation quantizer).
    """
    layer.inputs_quantizer = _inputs_quantizer(config)
    for attribute, name, axis in kernels(layer):
        shape = tuple(shapes[attribute])
        kernel = layer.add_weight(name=name, shape=shape, initializer="zeros", dtype="int8", trainable=False)
        scale_shape = shape[:axis] + shape[axis + 1 :]  # one scale per output channel (per expert)
        scale = layer.add_weight(name=f"{name}_scale", shape=scale_shape, initializer="ones", trainable=False)
        setattr(layer, attribute, kernel)
        setattr(layer, f"{attribute}_scale", scale)
    _compat.mark_quantized(layer)


def quantize_int8(layer, config=None):
    """Replaces `layer`'s float kernels by int8 ones and per-channel scales (Keras' `Dense.quantize` scheme).

    Args:
        layer: a built, float `MixtureOfExperts`.
        config: optional `keras.quantizers.QuantizationConfig`: its weight
            quantizer (applied over each kernel's contracted axis, as
            `EinsumDense` does) and activation quantizer.
    """
    weight_quantizer = keras.quantizers.QuantizationConfig.weight_quantizer_or_default(
        config, keras.quantizers.AbsMaxQuantizer()
    )
    values, shapes = {}, {}
    for attribute, _, axis in kernels(layer):
        kernel = getattr(layer, attribute)
        shapes[attribute] = tuple(kernel.shape)
        quantized, scale = weight_quantizer(kernel, axis=axis, to_numpy=True)
        values[attribute] = (quantized, ops.squeeze(scale, axis=axis))
        delattr(layer, attribute)  # Keras untracks the float variable (`Layer.__delattr__`)
    int8_build(layer, shapes, config)
    for attribute, (quantized, scale) in values.items():
        getattr(layer, attribute).assign(quantized)
        getattr(layer, f"{attribute}_scale").assign(scale)


def _sum_to(grad, x):
    """`grad` summed over the axes along which ``x`` was broadcast in a batched `ops.matmul`."""
    extra = len(grad.shape) - len(x.shape)
    if extra:
        grad = ops.sum(grad, axis=tuple(range(extra)))
    axes = tuple(i for i, (g, d) in enumerate(zip(grad.shape, x.shape, strict=True)) if d == 1 and g != 1)
    return ops.sum(grad, axis=axes, keepdims=True) if axes else grad


def int8_matmul(layer, x, kernel, scale):
    """``x @ (kernel / scale)`` with Keras' int8 product: `x` quantized per row, an int8 x int8 -> int32 matmul.

    Args:
        layer: the `MixtureOfExperts` (its `inputs_quantizer`, `compute_dtype`).
        x: ``[..., M, K]`` float; its batch dims broadcast against the kernel's.
        kernel: ``[..., K, N]`` int8.
        scale: ``[..., N]``: the kernel's per-output-channel scale (``kernel = round(W * scale)``).

    Returns:
        ``[..., M, N]`` in the layer's compute dtype. Its gradient with
        respect to `x` is that of ``x @ (kernel / scale)`` (Keras' int8
        layers' custom gradient); the kernel and scale get none.
    """
    dtype = layer.compute_dtype

    @ops.custom_gradient
    def product(x, kernel, scale):
        def grad_fn(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            float_kernel = ops.divide(ops.cast(kernel, dtype), scale)  # [..., K, N]
            return _sum_to(ops.matmul(upstream, ops.swapaxes(float_kernel, -1, -2)), x), None, None

        if layer.inputs_quantizer:
            quantized, x_scale = layer.inputs_quantizer(x, axis=-1)  # [..., M, K] int8, [..., M, 1]
            y = ops.cast(ops.matmul(quantized, kernel), dtype)  # int32 -> [..., M, N]
            return ops.divide(y, ops.multiply(x_scale, scale)), grad_fn
        return ops.divide(ops.matmul(x, ops.cast(kernel, dtype)), scale), grad_fn

    scale = ops.expand_dims(ops.convert_to_tensor(scale), -2)  # [..., 1, N]
    return product(x, ops.convert_to_tensor(kernel), scale)


def all_experts(layer, h, routing):
    """Every expert on every token ``h [N, dim]`` with int8 products, weighted by ``routing [E, N]``: ``[N, dim]``."""
    g = layer.activation(int8_matmul(layer, h, layer.gate_kernel, layer.gate_kernel_scale))  # [E, N, I]
    u = int8_matmul(layer, h, layer.up_kernel, layer.up_kernel_scale)  # [E, N, I]
    out = int8_matmul(layer, g * u, layer.down_kernel, layer.down_kernel_scale)  # [E, N, dim]
    return ops.sum(out * ops.cast(routing, out.dtype)[:, :, None], axis=0)  # [N, dim]


def picked_experts(layer, h, weights, experts):
    """The `top_k` picked experts of each row ``h [B, dim]``, their int8 kernels and scales gathered: ``[B, dim]``."""

    def picked(attribute):
        kernel = ops.take(getattr(layer, attribute), experts, axis=0)  # [B, k, K, N]
        return kernel, ops.take(getattr(layer, f"{attribute}_scale"), experts, axis=0)  # [B, k, N]

    x = h[:, None, None, :]  # [B, 1, 1, dim]: one row, broadcast over the k experts
    g = layer.activation(int8_matmul(layer, x, *picked("gate_kernel")))  # [B, k, 1, I]
    u = int8_matmul(layer, x, *picked("up_kernel"))  # [B, k, 1, I]
    out = ops.squeeze(int8_matmul(layer, g * u, *picked("down_kernel")), axis=2)  # [B, k, dim]
    return ops.sum(out * ops.cast(weights, out.dtype)[..., None], axis=1)  # [B, dim]


def shared(layer, h):
    """The shared expert on ``h [N, dim]`` with int8 products, gated by a sigmoid of ``h @ shared_weight``."""
    g = layer.activation(int8_matmul(layer, h, layer.shared_gate_kernel, layer.shared_gate_kernel_scale))
    g = g * int8_matmul(layer, h, layer.shared_up_kernel, layer.shared_up_kernel_scale)  # [N, S]
    out = int8_matmul(layer, g, layer.shared_down_kernel, layer.shared_down_kernel_scale)  # [N, dim]
    return out * ops.sigmoid(int8_matmul(layer, h, layer.shared_weight_kernel, layer.shared_weight_kernel_scale))
