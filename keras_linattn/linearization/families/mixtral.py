"""Mixtral (`MixtralBackbone`): Mistral's layout with a mixture of gated experts as every feed-forward.

Each layer's sparse MoE block becomes a `keras_linattn.layers.MixtureOfExperts`
(router, top-k experts renormalized, no shared expert) with the teacher's
weights (`families._moe`); a sliding window within the student's stays
exact softmax (`mistral.local_window`).
"""

from keras_linattn.linearization.families import Family, register
from keras_linattn.linearization.families._common import rms_decoder_config
from keras_linattn.linearization.families._moe import copy_moe_decoder, layer_moe
from keras_linattn.linearization.families.mistral import local_window

__all__ = ["copy_mixtral", "mixtral_config"]


def mixtral_config(config, backbone, window_size):
    """`LinearBackbone` arguments of a `MixtralBackbone` config (experts of width ``intermediate_dim``)."""
    return rms_decoder_config(
        config,
        backbone,
        moe=layer_moe(backbone, config["intermediate_dim"], normalize_top_k=True),
        **local_window(config.get("sliding_window"), window_size),
    )


def copy_mixtral(copy, student, backbone):
    """Copies every Mixtral weight (`families._moe.copy_moe_decoder`)."""
    copy_moe_decoder(copy, student, backbone)


register(Family(name="mixtral", backbones=("MixtralBackbone",), config=mixtral_config, weights=copy_mixtral))
