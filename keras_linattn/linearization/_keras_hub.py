"""The keras-hub adapter of `linearize` (imported only for a keras-hub teacher).

The work is done in `keras_linattn.models._hub_linearize`, the one part of
the package that may import keras_hub.
"""

__all__ = ["linearize"]


def linearize(teacher, *, feature_map, window_size, **attention_kwargs):
    from keras_linattn.models._hub_linearize import linearize_keras_hub

    return linearize_keras_hub(teacher, feature_map=feature_map, window_size=window_size, **attention_kwargs)
