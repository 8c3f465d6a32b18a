"""Loading files written before `LinearCausalLM` became a keras-hub task over a `LinearBackbone`.

Everything that reads the older layouts lives here; nothing else in the
package refers to them.

Two older layouts are read here.

**The stack layout.** Until the blocks became `LinearBackbone`'s own
layers (its functional graph, keras-hub's layout), the backbone was a
functional model over one inner layer that held the embeddings, the
blocks and the final norm. Its files (``.keras``, presets, ``save_weights``)
file the weights under ``layers/__decoder_stack/...`` and its configs have
no ``"layout"`` key. `LinearBackbone.from_config` builds such a config with
``layout="stack"``: the same model, whose `layers` (what Keras' weight
writer and reader walk first) are `stack_layout_layers`, a weightless view
with the old attribute names over the backbone's own layers. Files load,
and save back, unchanged. ``load_weights`` of an older weights file into a
new backbone goes through the same view (`holds_stack_layout`,
`stack_layout`).

**The flat layout.** Round 2's `LinearCausalLM` was one subclassed model. Its `.keras` files hold
a flat config (the backbone's arguments, no ``"backbone"`` key) and file the
weights under ``decoder_blocks/...``, ``final_norm/...`` and
``layers/<embedding>``. `LinearCausalLM.from_config` sends such a config
here (`load_flat_lm`), and the model it returns saves back in the same
layout, under the same registered name, so the files round-trip unchanged.

This module is imported lazily (by `LinearCausalLM.from_config` and by the
loaders `keras_linattn/__init__.py` registers); importing it does not import
keras-hub.
"""

import contextlib
import functools
import os

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


# The name of the inner layer whose attribute paths the stack layout's files hold.
STACK_LAYER_PATH = "__decoder_stack"


@functools.cache
def _stack_view_class():
    import keras

    class _DecoderStack(keras.layers.Layer):
        """A weightless view of a backbone's layers under the attribute names of the former inner layer.

        Keras names a layer's weights by class (``__decoder_stack`` for this
        class name) and attribute path, so the view gives the paths older
        files hold: ``__decoder_stack/{decoder_blocks/<block>, final_norm,
        position_embedding, token_embedding}/...``.
        """

        def __init__(self, backbone):
            super().__init__(name="decoder_stack", dtype=backbone.dtype_policy)
            self.decoder_blocks = list(backbone.decoder_blocks)
            self.final_norm = backbone.final_norm
            self.position_embedding = backbone.position_embedding
            self.token_embedding = backbone.token_embedding
            self.built = True

    return _DecoderStack


def stack_layout_layers(backbone, layers):
    """What Keras' weight walk sees as a "stack"-layout backbone's layers: its inputs, then the view.

    Args:
        backbone: a `LinearBackbone`.
        layers: the backbone's functional layers (inputs first).
    """
    import keras

    view = backbone.__dict__.get("_stack_view")
    if view is None:
        view = _stack_view_class()(backbone)
        # Not a tracked attribute: the view holds no weights of its own and
        # must not join the backbone's layers, variables or checkpoints.
        object.__setattr__(backbone, "_stack_view", view)
    inputs = [layer for layer in layers if isinstance(layer, keras.layers.InputLayer)]
    return inputs + [view]


def holds_stack_layout(filepath):
    """True when the weights file (``.weights.h5``, or a sharded ``.weights.json``) names the stack layout's paths."""
    import json

    import h5py

    filepath = os.fspath(filepath)
    if filepath.endswith(".json"):
        with open(filepath) as f:
            index = json.load(f)
        return any(STACK_LAYER_PATH in key for key in index.get("weight_map", {}))
    if not os.path.isfile(filepath):
        return False
    with h5py.File(filepath, "r") as f:
        # `visit` stops at the first name for which the function returns something other than None.
        return bool(f.visit(lambda name: True if name.endswith(STACK_LAYER_PATH) else None))


@contextlib.contextmanager
def stack_layout(backbones):
    """Within: every backbone of `backbones` reads and writes the stack layout."""
    before = [backbone.layout for backbone in backbones]
    try:
        for backbone in backbones:
            backbone.layout = "stack"
        yield
    finally:
        for backbone, layout in zip(backbones, before, strict=True):
            backbone.layout = layout


def load_flat_lm(config):
    """The model of an older flat `LinearCausalLM` config (no ``"backbone"`` key)."""
    return flat_lm_class().from_config(config)


def __getattr__(name):
    # `FlatLM`: the class, for the loader `keras_linattn/__init__.py` registers under `FLAT_LM_NAME`.
    if name == "FlatLM":
        return flat_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
