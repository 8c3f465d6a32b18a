"""Base class of feature maps ``phi: [B, T, H, D] -> [B, T, H, C]``."""

import keras

from keras_linattn._tracking import CheckpointTracked
from keras_linattn._validation import check_rank

__all__ = ["FeatureMap"]


class FeatureMap(CheckpointTracked, keras.layers.Layer):
    """A feature map for kernelized attention, ``sim(q, k) = phi(q) . phi(k)``.

    Subclasses implement `feature_dim(input_dim)` and
    `call(inputs, is_query=True, causal=False)`. Feature maps compute in
    float32 by default (the numerics of linear attention need float32
    features under mixed precision); pass ``dtype=`` to override.

    The attention layers and the recurrences also read a few optional hooks
    of the map. The base class gives each its default (the attributes
    below); a subclass overrides the ones it needs:

    - `float16_safe`: False refuses a float16 compute dtype.
    - `noncausal_pair`: a method that maps the queries and keys of a
      non-causal call together.
    - `call_signature_parameters`: the names of `call`'s parameters
      (set by Keras); a ``key_mask`` parameter receives the key padding.
    - `seed`: the seed a map draws its weights from, if any.
    - `causal_key_out_of_range`: None, or a method for maps that cap
      causal key features (favor_trig).

    Args:
        **kwargs: standard `keras.layers.Layer` arguments (`name`, `dtype`).

    Call arguments:
        inputs: ``[B, T, H, D]`` projected queries or keys.
        is_query: True for queries, False for keys. Maps that treat the two
            differently (FAVOR+ stabilization, separate trainable kernels) use it.
        causal: True when used in causal attention. A map must never let
            a key's features depend on other time steps when this is True.

    Returns:
        ``[B, T, H, C]`` features with ``C = feature_dim(D)``.
    """

    float16_safe = True
    """Whether the map's outputs stay in float16's range at ordinary input scales.

    Read by `LinearAttention` when it is created: with False it refuses a
    float16 compute dtype (``mixed_float16``) with a ValueError. True (the
    default): the map may run under float16. A map with signed features
    whose normalized ratio can overflow float16 (favor_trig) sets False.
    """

    noncausal_pair = None
    """None, or a method ``noncausal_pair(queries, keys, key_mask=None) -> (phi(q), phi(k))``.

    Called by the recurrence (`Recurrence.feature_pair`) for a non-causal
    call instead of mapping the queries and the keys separately, for maps
    whose features need statistics of both (favor+ shifts each feature by
    its max over the real keys and multiplies the queries back). Inputs are
    ``[B, T, H, D]`` and ``[B, S, H, D]`` and ``key_mask`` ``[B, S]`` or
    None. None (the default): queries and keys each go through `call`.
    Causal calls always map them through `call`.
    """

    call_signature_parameters = ()
    """The names of the parameters of the map's `call`.

    Keras' `Layer.__init__` sets it on every instance from the signature of
    `call`; the recurrence (`Recurrence.features`) reads it on each call to
    pass ``key_mask=`` (``[B, S]``, the key padding) only to maps whose
    `call` takes a ``key_mask`` parameter (favor+'s non-causal stabilizer,
    so that padded keys never enter its statistics). The empty default
    holds only before `Layer.__init__` has run: no ``key_mask`` is passed.
    """

    causal_key_out_of_range = None
    """None, or a method ``causal_key_out_of_range(keys) -> [B, T, H]`` bool, True where a key's features were capped.

    For maps that cap causal key features (favor_trig). `LinearAttention`
    calls it on the keys of a causal call whose recurrence does not cancel
    the key scale, and flags every row that attends to such a key
    (`KernelUnderflowError` eagerly, NaN in a graph). None (the default):
    the map never caps a key.
    """

    seed = None
    """The seed the map draws its random projection or initial weights from, or None.

    Seeded maps (the random-feature maps, the trainable maps) set it from
    their ``seed`` argument, which their config holds. A `LinearBackbone`
    given a map with a seed gives each block after the first its own seed
    derived from it, so that blocks do not draw the same projection or
    weights; with None (the default: an unseeded or deterministic map)
    every block gets the map's config as it is.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)

    def quantize(self, mode=None, type_check=True, config=None):
        """Keeps the map's weights as they are: feature maps stay float under `Model.quantize`.

        A map's weights are small (``[H, D, C]`` per layer, against the
        projections' ``[dim, H, D]``), and its features feed the float32
        state, the normalizer and, for hedgehog and favor+, an ``exp``: a
        rounding error of half an int8 step in ``W x`` would multiply a
        feature by up to ``exp(step / 2)`` (DESIGN.md, Numerics: features,
        S, z and the normalizer stay float32). `keras.Model.quantize` calls
        this on every leaf layer; without it Keras warns that the map has no
        `quantize` method.

        Args:
            mode: the quantization mode (``"int8"``, ``"int4"``...), ignored.
            type_check: Keras' argument, ignored.
            config: Keras' `QuantizationConfig`, ignored.
        """
        del mode, type_check, config

    def feature_dim(self, input_dim):
        """The output feature dim ``C`` for input dim ``D``."""
        raise TypeError(
            f"{type(self).__name__} does not define feature_dim(input_dim); every FeatureMap subclass must."
        )

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"{type(self).__name__} expects inputs of rank 4 [B, T, H, D]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.built = True

    def build_heads(self, input_shape):
        """Starts the build of a map with per-head weights.

        Checks ``[B, T, H, D]`` with static ``H`` and ``D`` and returns
        ``(H, D)``, to be built for. If the map is already built (deserializing
        builds it from its build config before the owning layer builds it
        again), checks that ``(H, D)`` is the one it was built for and returns
        None: the weights are kept.
        """
        if self.built:
            if tuple(input_shape[-2:]) != self.heads_dim:
                raise ValueError(
                    f"{type(self).__name__} was built for [H, D] = {list(self.heads_dim)}. "
                    f"Received: input_shape={tuple(input_shape)}"
                )
            return None
        FeatureMap.build(self, input_shape)
        num_heads, dim = input_shape[-2], input_shape[-1]
        if num_heads is None or dim is None:
            raise ValueError(
                f"{type(self).__name__} needs known head and key dims [B, T, H, D]. "
                f"Received: input_shape={tuple(input_shape)}"
            )
        self.heads_dim = (int(num_heads), int(dim))
        return self.heads_dim

    def check_heads(self, inputs):
        """Checks that call inputs are ``[B, T, H, D]`` with the built ``H, D``."""
        check_rank("inputs", inputs, 4)  # [B, T, H, D]
        if tuple(inputs.shape[-2:]) != self.heads_dim:
            num_heads, dim = self.heads_dim
            raise ValueError(
                f"{type(self).__name__} was built for H={num_heads}, D={dim}. "
                f"Received: inputs.shape={tuple(inputs.shape)}"
            )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.feature_dim(input_shape[-1]),)
