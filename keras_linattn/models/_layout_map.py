"""`LinearBackbone.get_layout_map`: how the backbone's weights shard over a device mesh (keras-hub's convention)."""

import keras

__all__ = []


def _layout_patterns(model, data):
    """``{path regex: axes}`` of `LinearBackbone.get_layout_map` (mesh axis names `model`, `data`).

    Each regex starts with ``.*``: `LayoutMap` matches with `re.fullmatch`,
    and a path may carry a prefix (e.g. a name scope the model was built in).
    """
    block = r".*decoder_block_\d+"
    return {
        r".*token_embedding/embeddings": (model, data),
        r".*token_embedding/reverse_embeddings": (data, model),
        r".*position_embedding/embeddings": (None, data),
        block + r"/self_attention/(query|key|value)/kernel": (data, model, None),
        block + r"/self_attention/attention_output/kernel": (model, None, data),
        block + r"/feedforward_(intermediate|gate)_dense/kernel": (data, model),
        block + r"/feedforward_output_dense/kernel": (model, data),
    }


def layout_map(device_mesh, model_parallel_dim_name, data_parallel_dim_name):
    """The `keras.distribution.LayoutMap` of `LinearBackbone.get_layout_map` (arguments checked here)."""
    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise ValueError(
            "`device_mesh` must be a `keras.distribution.DeviceMesh`. "
            f"Received: device_mesh={type(device_mesh).__name__}"
        )
    for arg, name in (
        ("model_parallel_dim_name", model_parallel_dim_name),
        ("data_parallel_dim_name", data_parallel_dim_name),
    ):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"`{arg}` must be an axis of the device mesh {list(device_mesh.axis_names)}. Received: {arg}={name!r}"
            )
    model, data = model_parallel_dim_name, data_parallel_dim_name
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in _layout_patterns(model, data).items():
        layout_map[pattern] = axes
    return layout_map
