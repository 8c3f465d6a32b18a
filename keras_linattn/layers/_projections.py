"""Former module of `ProjectedAttention` (now `_attention_base`), kept so that imports of this path still work."""

from keras_linattn.layers._attention_base import (  # noqa: F401
    PROJECTION_ARGS_DOC,
    ProjectedAttention,
    _check_output_shape,
    _ProjectionDense,
    document,
)
