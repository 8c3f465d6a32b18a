"""Loading files written before `LinearCausalLM` became a keras-hub task over a `LinearBackbone`.

Everything that reads the older layouts lives here; nothing else in the
package refers to them.

Round 2's `LinearCausalLM` was one subclassed model. Its `.keras` files hold
a flat config (the backbone's arguments, no ``"backbone"`` key) and file the
weights under ``decoder_blocks/...``, ``final_norm/...`` and
``layers/<embedding>``. `LinearCausalLM.from_config` sends such a config
here (`load_flat_lm`), and the model it returns saves back in the same
layout, under the same registered name, so the files round-trip unchanged.

This module is imported lazily (by `LinearCausalLM.from_config` and by the
loaders `keras_linattn/__init__.py` registers); importing it does not import
keras-hub.
"""

import functools

# The registered Keras name the older files record for the model this module
# builds (``"keras_linattn>" + FLAT_LM_NAME``); files saved back keep it.
FLAT_LM_NAME = "_Round2LinearCausalLM"


@functools.cache
def flat_lm_class():
    """The `LinearCausalLM` subclass that reads and writes the older flat layout (registered on first use)."""
    import keras

    from keras_linattn.models.causal_lm import LinearCausalLM

    @keras.saving.register_keras_serializable(package="keras_linattn", name=FLAT_LM_NAME)
    class FlatLinearCausalLM(LinearCausalLM):
        """A `LinearCausalLM` loaded from an older flat `.keras` file, which it saves back in that layout.

        Keras' weight writer and reader walk ``model.layers`` first and then
        ``dir(model)``, so this class lists the embeddings as its layers,
        reaches the blocks and the final norm through `LinearCausalLM`'s
        attributes of the same names, and leaves the backbone (no variables
        of its own) out of the walk: the old files load, and save again,
        unchanged. Its config stays the flat one. Everything else is
        `LinearCausalLM`.
        """

        # Not a preset target: keras-hub's `from_preset` picks the task class whose
        # `backbone_cls` matches the preset's backbone, which must be LinearCausalLM.
        backbone_cls = None

        def __dir__(self):
            return [name for name in super().__dir__() if name not in ("backbone", "_backbone")]

        @property
        def layers(self):
            return [layer for layer in (self.token_embedding, self.position_embedding) if layer is not None]

        def get_config(self):
            config = {"name": self.name, "trainable": self.trainable}
            config.update({k: v for k, v in self.backbone.get_config().items() if k not in ("name", "trainable")})
            return config

        @classmethod
        def from_config(cls, config):
            config = dict(config)
            config.pop("trainable", None)
            # The older model was compiled only by its user; Keras restores that
            # compile, if any, from the file.
            return cls(**config, compile=False)

    return FlatLinearCausalLM


def load_flat_lm(config):
    """The model of an older flat `LinearCausalLM` config (no ``"backbone"`` key)."""
    return flat_lm_class().from_config(config)


def __getattr__(name):
    # `FlatLM`: the class, for the loader `keras_linattn/__init__.py` registers under `FLAT_LM_NAME`.
    if name == "FlatLM":
        return flat_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
