"""The int8 call of the attention projections (`_ProjectionDense`): Keras' machinery, a 2-D integer product.

Keras' `EinsumDense._int8_call` quantizes the inputs per token, multiplies
them by the int8 kernel with ``ops.einsum`` and divides by both scales. Its
einsum on int8 operands takes an int32 product only where every dim but the
batch is static; the time axis of the projections' equations is not, so it
would multiply the int8 values as floats, and an exported graph would hold
a float product. `int8_call` is the same call with the contraction written
as one 2-D ``ops.matmul`` (int8 operands: an int32 product, a
`MatMulInteger` in ONNX), as `_ProjectionDense.step_call` writes the float
one, rescaled in 2-D and then reshaped. Quantizers, scales, LoRA, bias and
the gradient are Keras' own.
"""

from keras import ops

from keras_linattn import _compat


def _int_product(x, kernel, form):
    """``einsum(equation, x, kernel)`` of a projection as one 2-D product, and the einsum's output shape.

    ``form`` is ``"input"`` (``btd,dhk->bthk``: ``[B, T, dim] x [dim, H, K]``)
    or ``"output"`` (``bthk,hkd->btd``: ``[B, T, H, K] x [H, K, dim]``).
    Returns ``([B * T, N], shape)``: the product (int8 operands: int32) with
    ``N`` the kernel's output dims flattened in order, and the shape
    ``[B, T, H, K]`` or ``[B, T, dim]`` that it is reshaped to.
    """
    shape = ops.shape(x)
    if form == "input":
        dim, heads, size = kernel.shape
        y = ops.matmul(ops.reshape(x, (-1, dim)), ops.reshape(kernel, (dim, heads * size)))  # [B * T, H * K]
        return y, (shape[0], shape[1], heads, size)
    heads, size, dim = kernel.shape
    y = ops.matmul(ops.reshape(x, (-1, heads * size)), ops.reshape(kernel, (heads * size, dim)))  # [B * T, dim]
    return y, (shape[0], shape[1], dim)


def int8_call(layer, inputs, form):
    """`layer` (an int8 `_ProjectionDense` with an inputs quantizer) on ``inputs``, its product in int8.

    Args:
        layer: the projection, quantized by Keras' `EinsumDense.quantize`.
        inputs: ``[B, T, dim]`` (``form="input"``) or ``[B, T, H, K]`` (``"output"``).
        form: ``"input"`` or ``"output"`` (`_attention_base._STEP_FORMS`).

    Returns:
        The projection's output, as Keras' `EinsumDense._int8_call` computes it.
    """

    @ops.custom_gradient
    def product(inputs, kernel, kernel_scale):
        def grad_fn(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            scale = layer._adjust_scale_for_dequant(kernel_scale)
            float_kernel = ops.divide(ops.cast(kernel, layer.compute_dtype), scale)
            return ops.einsum(layer._custom_gradient_equation, upstream, float_kernel), None, None

        quantized, inputs_scale = layer.inputs_quantizer(inputs, axis=layer.quantization_axis)  # one scale a token
        x, shape = _int_product(quantized, kernel, form)  # [B * T, N] int32
        x = ops.cast(x, layer.compute_dtype)
        # Keras' rescale (the product of the two scales, then a division) on the 2-D product, before the
        # reshape: the same values, and in an ONNX graph `MatMulInteger -> Cast -> Div` with nothing between,
        # as Keras' int8 `Dense` writes it: one pattern for every integer product of an export (the one
        # onnxruntime's `MatMulIntegerToFloat` fusion matches, `benchmarks._int8_fusion`).
        scale = ops.multiply(ops.reshape(inputs_scale, (-1, 1)), ops.reshape(kernel_scale, (-1,)))  # [B * T, N]
        return ops.reshape(ops.divide(x, scale), shape), grad_fn

    x = product(
        inputs, ops.convert_to_tensor(_compat.unmerged_kernel(layer)), ops.convert_to_tensor(layer.kernel_scale)
    )
    if layer.lora_enabled:
        lora_x = ops.matmul(ops.einsum(layer.equation, inputs, layer.lora_kernel_a), layer.lora_kernel_b)
        x = ops.cast(ops.add(x, (layer.lora_alpha / layer.lora_rank) * lora_x), layer.compute_dtype)
    if layer.bias is not None:
        x = ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x
