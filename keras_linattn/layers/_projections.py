"""The per-head query/key/value/output projections shared by the attention layers.

Both `LinearAttention` and `EfficientAttention` project like
`keras.layers.MultiHeadAttention` (same kernel shapes ``[dim, H, D]`` and
``[H, M, dim]``), so weights can be copied between the three.
"""

import keras


def set_projection_arguments(
    layer,
    kernel_initializer,
    bias_initializer,
    kernel_regularizer,
    bias_regularizer,
    kernel_constraint,
    bias_constraint,
):
    """Resolves and stores the projection arguments on `layer` (as MultiHeadAttention does)."""
    layer.kernel_initializer = keras.initializers.get(kernel_initializer)
    layer.bias_initializer = keras.initializers.get(bias_initializer)
    layer.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
    layer.bias_regularizer = keras.regularizers.get(bias_regularizer)
    layer.kernel_constraint = keras.constraints.get(kernel_constraint)
    layer.bias_constraint = keras.constraints.get(bias_constraint)


def projection_config(layer):
    """The `get_config` entries of the arguments stored by `set_projection_arguments`."""
    return {
        "kernel_initializer": keras.initializers.serialize(layer.kernel_initializer),
        "bias_initializer": keras.initializers.serialize(layer.bias_initializer),
        "kernel_regularizer": keras.regularizers.serialize(layer.kernel_regularizer),
        "bias_regularizer": keras.regularizers.serialize(layer.bias_regularizer),
        "activity_regularizer": keras.regularizers.serialize(layer.activity_regularizer),
        "kernel_constraint": keras.constraints.serialize(layer.kernel_constraint),
        "bias_constraint": keras.constraints.serialize(layer.bias_constraint),
    }


def _einsum_dense(layer, equation, output_shape, bias_axes, name):
    # A fresh initializer per weight: an initializer instance reuses its seed.
    kernel_init = layer.kernel_initializer.__class__.from_config(layer.kernel_initializer.get_config())
    bias_init = layer.bias_initializer.__class__.from_config(layer.bias_initializer.get_config())
    return keras.layers.EinsumDense(
        equation,
        output_shape=output_shape,
        bias_axes=bias_axes if layer.use_bias else None,
        kernel_initializer=kernel_init,
        bias_initializer=bias_init,
        kernel_regularizer=layer.kernel_regularizer,
        bias_regularizer=layer.bias_regularizer,
        kernel_constraint=layer.kernel_constraint,
        bias_constraint=layer.bias_constraint,
        dtype=layer.dtype_policy,
        name=name,
    )


def build_projections(layer, query_shape, value_shape, key_shape):
    """Validates the input shapes and builds ``layer.{query,key,value,output}_dense``.

    `layer` provides `num_heads`, `key_dim`, `value_dim`, `output_shape_`,
    `use_bias` and the initializers/regularizers/constraints of its
    projections.

    Raises:
        ValueError: for inputs that are not rank 3 or keys and values of
            different lengths.
    """
    for name, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
        if len(shape) != 3:
            raise ValueError(
                f"`{name}` must have rank 3 [batch, length, dim]. "
                f"Received: {name}.shape={tuple(shape)}"
            )
    if value_shape[1] is not None and key_shape[1] is not None and value_shape[1] != key_shape[1]:
        raise ValueError(
            "`key` and `value` must have the same length. "
            f"Received: key.shape={tuple(key_shape)}, value.shape={tuple(value_shape)}"
        )
    h, d, m = layer.num_heads, layer.key_dim, layer.value_dim
    out_dim = layer.output_shape_ or query_shape[-1]
    layer.query_dense = _einsum_dense(layer, "btd,dhk->bthk", (None, h, d), "hk", "query")
    layer.query_dense.build(query_shape)
    layer.key_dense = _einsum_dense(layer, "btd,dhk->bthk", (None, h, d), "hk", "key")
    layer.key_dense.build(key_shape)
    layer.value_dense = _einsum_dense(layer, "btd,dhk->bthk", (None, h, m), "hk", "value")
    layer.value_dense.build(value_shape)
    layer.output_dense = _einsum_dense(layer, "bthk,hkd->btd", (None, out_dim), "d", "attention_output")
    layer.output_dense.build((query_shape[0], query_shape[1], h, m))
