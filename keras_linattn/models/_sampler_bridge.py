"""keras-hub samplers behind the decode contract, and the samplers a `LinearCausalLM` saves with `compile`.

`LinearCausalLM` (`compile`, `generate`) and `keras_linattn.linearization`
(`merge_lora` copies a task's sampler) read samplers through here. This
module does not import keras_hub: a keras-hub sampler exists only once
keras_hub is imported, so the check looks keras_hub up among the loaded
modules (`keras_linattn.linearization` stays free of keras_hub).
"""

import sys

import keras
from keras import ops

from keras_linattn import samplers as samplers_lib

__all__ = ["BUILT_IN_SAMPLERS", "HubSampler", "get_sampler", "is_hub_sampler", "serialize_sampler"]

# Samplers whose ids are in [0, V) for finite logits (an invalid id can only mean non-finite logits).
BUILT_IN_SAMPLERS = (
    samplers_lib.GreedySampler,
    samplers_lib.RandomSampler,
    samplers_lib.TopKSampler,
    samplers_lib.TopPSampler,
)


def _hub_sampler_class():
    """keras-hub's `Sampler` base class, or None while keras_hub is not imported."""
    hub = sys.modules.get("keras_hub")
    return getattr(getattr(hub, "samplers", None), "Sampler", None)


def is_hub_sampler(sampler):
    """Whether `sampler` is a keras-hub `Sampler`."""
    base = _hub_sampler_class()
    return base is not None and isinstance(sampler, base)


class HubSampler:
    """A keras-hub `Sampler` behind the decode contract's ``sampler(logits, seed) -> ids``.

    keras-hub samplers draw with their own seed generator (the contract's
    per-token seed is not used). Samplers that replace keras-hub's whole loop
    (beam search, contrastive search) need the model's hidden states and a
    rewindable cache, which a recurrent state is not: they are refused.

    Args:
        sampler: a keras-hub `Sampler`.

    Raises:
        ValueError: for a sampler that overrides keras-hub's search loop.
    """

    def __init__(self, sampler):
        if type(sampler).__call__ is not _hub_sampler_class().__call__:
            raise ValueError(
                f"keras-hub's {type(sampler).__name__} runs its own search loop, which a recurrent decode state "
                "does not support; use greedy, random, top_k or top_p (keras-hub's or keras_linattn.samplers). "
                f"Received: sampler={sampler!r}"
            )
        self.sampler = sampler

    def __call__(self, logits, seed):
        probabilities = self.sampler.compute_probabilities(logits)
        return ops.cast(self.sampler.get_next_token(probabilities), "int32")

    def __repr__(self):
        return f"HubSampler({type(self.sampler).__name__}@{id(self.sampler):x})"


def get_sampler(sampler):
    """A `keras_linattn.samplers.Sampler`, or a keras-hub `Sampler` (name, config or instance).

    Args:
        sampler: a `keras_linattn.samplers` name, config or `Sampler`, a
            keras-hub `Sampler`, or a keras-serialized keras-hub sampler
            (a dict with a ``"module"`` key).

    Returns:
        The sampler.

    Raises:
        ValueError: as `keras_linattn.samplers.get`, for anything else.
    """
    if is_hub_sampler(sampler):
        return sampler
    if isinstance(sampler, dict) and "module" in sampler:  # a keras-serialized keras-hub sampler
        return keras.saving.deserialize_keras_object(sampler)
    return samplers_lib.get(sampler)


def serialize_sampler(sampler):
    """`sampler` as a config that `get_sampler` reads back (Keras' serialization for a keras-hub sampler)."""
    if is_hub_sampler(sampler):
        return keras.saving.serialize_keras_object(sampler)
    return samplers_lib.serialize(sampler)
