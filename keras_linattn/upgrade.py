"""Converts files written before keras_linattn 0.3 to the current layout.

    python -m keras_linattn.upgrade OLD NEW

OLD is a ``.keras`` file or a preset directory (``save_to_preset``) written
by keras_linattn 0.1 or 0.2; NEW is where the converted copy is written (a
``.keras`` file, or a preset directory). The model, its weights, its LoRA
adapters and its preprocessor are unchanged; only where the files keep them
changes. The core classes read the current layout only: since 0.3 they
refuse an older file with a message that names this command, instead of
carrying the older layouts' readers.

Two older layouts exist:

- **stack** (0.2 before the blocks became `LinearBackbone`'s own layers):
  the backbone's weights sit under ``layers/__decoder_stack/...`` and its
  config has no ``"layout"`` key;
- **flat** (0.1): `LinearCausalLM` was one subclassed model, registered as
  ``keras_linattn>_Round2LinearCausalLM``, with a flat config (the
  backbone's arguments) and weights under ``decoder_blocks/...``.

A weights file alone (``save_weights``) carries no config: build the model
with the configuration it was saved with and read the older file with
`load_older_weights(model, path)`, then save it again.

This module is never imported by the package itself.
"""

import argparse
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import zipfile

__all__ = ["load_older_weights", "main", "upgrade"]

# The registered name of 0.1's flat `LinearCausalLM` (the class these files record).
FLAT_LM_NAME = "_Round2LinearCausalLM"
# The attribute name of 0.2's inner layer, as the stack layout's weight paths spell it.
STACK_LAYER_PATH = "__decoder_stack"


@functools.cache
def _classes():
    """The older layouts' readers: (stack-layout backbone class, flat LM class). Built on first use."""
    import keras

    from keras_linattn.models.backbone import LinearBackbone as CurrentBackbone
    from keras_linattn.models.causal_lm import LinearCausalLM

    class _DecoderStack(keras.layers.Layer):
        """A weightless view of a backbone's layers under the attribute names of 0.2's inner layer.

        Keras names a layer's weights by class (``__decoder_stack`` for this
        class name) and attribute path, so the view gives the paths the
        older files hold.
        """

        def __init__(self, backbone):
            super().__init__(name="decoder_stack", dtype=backbone.dtype_policy)
            self.decoder_blocks = list(backbone.decoder_blocks)
            self.final_norm = backbone.final_norm
            self.position_embedding = backbone.position_embedding
            self.token_embedding = backbone.token_embedding
            self.built = True

    # Keras files a model's weights under its class name: the reader keeps the name `LinearBackbone`.
    class LinearBackbone(CurrentBackbone):
        """A `LinearBackbone` whose weights are read and written under the stack layout's paths."""

        @property
        def layers(self):
            # Keras' weight reader walks `layers` first: the inputs, then the view (once the blocks exist).
            if not hasattr(self, "final_norm"):
                return super().layers
            view = self.__dict__.get("_stack_view")
            if view is None:
                view = _DecoderStack(self)
                # Not a tracked attribute: the view holds no weights of its own.
                object.__setattr__(self, "_stack_view", view)
            inputs = [layer for layer in super().layers if isinstance(layer, keras.layers.InputLayer)]
            return inputs + [view]

        @classmethod
        def from_config(cls, config):
            config = dict(config)
            config.pop("layout", None)
            return super(CurrentBackbone, cls).from_config(config)

    class FlatLinearCausalLM(LinearCausalLM):
        """0.1's flat `LinearCausalLM` file layout: embeddings as the layers, blocks as attributes."""

        backbone_cls = None

        def __dir__(self):
            return [name for name in super().__dir__() if name not in ("backbone", "_backbone")]

        @property
        def layers(self):
            return [layer for layer in (self.token_embedding, self.position_embedding) if layer is not None]

        @classmethod
        def from_config(cls, config):
            config = dict(config)
            config.pop("trainable", None)
            name = config.pop("name", None)
            backbone = CurrentBackbone(**config)
            return cls(backbone, name=name, compile=False)

    class OlderCausalLM(LinearCausalLM):
        """Reads an older `LinearCausalLM` config: 0.1's flat one, or 0.2's over a stack-layout backbone."""

        @classmethod
        def from_config(cls, config):
            if "backbone" not in config:
                return FlatLinearCausalLM.from_config(config)
            config = dict(config)
            # Keras replaces the custom-object scope while a class builds itself from its config: the
            # backbone is read here, with the older layouts' readers named explicitly.
            if isinstance(config["backbone"], dict):
                with keras.saving.custom_object_scope({"keras_linattn>LinearBackbone": LinearBackbone}):
                    config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
            return LinearCausalLM.from_config.__func__(LinearCausalLM, config)

    return LinearBackbone, FlatLinearCausalLM, OlderCausalLM


def _older_objects():
    stack, flat, lm = _classes()
    return {
        "keras_linattn>LinearBackbone": stack,
        "keras_linattn>LinearCausalLM": lm,
        f"keras_linattn>{FLAT_LM_NAME}": flat,
    }


@contextlib.contextmanager
def _older_layouts():
    """Within: presets of the older layouts load through their readers (the top-level class is looked up here)."""
    import keras

    with keras.saving.custom_object_scope(_older_objects()):
        yield


def _current_backbone(older):
    """A `LinearBackbone` of the current layout with `older`'s configuration and weights."""
    from keras_linattn.models.backbone import LinearBackbone

    config = older.get_config()
    config.pop("layout", None)
    config.pop("name", None)
    backbone = LinearBackbone(**config, name=older.name)
    _copy_weights(older, backbone)
    return backbone


def _copy_weights(source, target):
    theirs, ours = source.weights, target.weights
    if len(theirs) != len(ours):
        raise ValueError(f"The older model has {len(theirs)} weights and the current one {len(ours)}.")
    for a, b in zip(theirs, ours, strict=True):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"Weight {a.path} has shape {tuple(a.shape)}; the current model's {b.path} has {b.shape}.")
        b.assign(a)


def _current(older):
    """The current-layout copy of an older backbone or causal LM."""
    from keras_linattn.models.backbone import LinearBackbone
    from keras_linattn.models.causal_lm import LinearCausalLM

    if isinstance(older, LinearCausalLM):
        backbone = _current_backbone(older.backbone)
        lm = LinearCausalLM(backbone, preprocessor=older.preprocessor, name=older.name)
        sampler = getattr(older, "sampler", None)
        if sampler is not None:
            lm.compile(sampler=sampler)
        return lm
    if isinstance(older, LinearBackbone):
        return _current_backbone(older)
    raise TypeError(f"Not a keras_linattn model: {type(older).__name__}")


def _is_older_keras_file(path):
    """True for a `.keras` archive of an older layout (flat LM, or a backbone config without ``"layout"``)."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    if config.get("registered_name") == f"keras_linattn>{FLAT_LM_NAME}":
        return True
    backbone = config.get("config", {}).get("backbone", config)
    return "layout" not in backbone.get("config", {})


def upgrade(src, dst, *, overwrite=False):
    """Writes the current-layout copy of an older ``.keras`` file or preset directory.

    Args:
        src: a ``.keras`` file or a preset directory written by
            keras_linattn 0.1 or 0.2.
        dst: the ``.keras`` file (for a ``.keras`` `src`) or the preset
            directory (for a preset `src`) to write.
        overwrite: replace an existing `dst`.

    Returns:
        The converted model (`LinearCausalLM` or `LinearBackbone`).

    Raises:
        FileNotFoundError: if `src` does not exist.
        FileExistsError: if `dst` exists and `overwrite` is False.
        ValueError: if `src` is neither a ``.keras`` file nor a preset
            directory, or `dst`'s kind differs from `src`'s.
    """
    import keras

    from keras_linattn.models.backbone import LinearBackbone
    from keras_linattn.models.causal_lm import LinearCausalLM

    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.exists(src):
        raise FileNotFoundError(f"No such file or preset directory: {src!r}")
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"{dst!r} exists; pass overwrite=True (--overwrite) to replace it.")
    if os.path.isdir(src):
        if dst.endswith(".keras"):
            raise ValueError(f"A preset directory converts to a preset directory. Received: dst={dst!r}")
        with open(os.path.join(src, "config.json")) as f:
            current = "layout" in json.load(f).get("config", {})
        cls = LinearCausalLM if os.path.exists(os.path.join(src, "task.json")) else LinearBackbone
        if current:
            older = cls.from_preset(src)
        else:
            with _older_layouts():
                older = cls.from_preset(src)
        model = _current(older)
        parent = os.path.dirname(os.path.abspath(dst))
        staging = tempfile.mkdtemp(prefix=".upgrade-", dir=parent)
        try:
            model.save_to_preset(staging)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            os.replace(staging, dst)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return model
    if not src.endswith(".keras"):
        raise ValueError(
            "Expected a `.keras` file or a preset directory; a weights file alone has no config: use "
            f"`keras_linattn.upgrade.load_older_weights(model, path)`. Received: {src!r}"
        )
    if not dst.endswith(".keras"):
        raise ValueError(f"A `.keras` file converts to a `.keras` file. Received: dst={dst!r}")
    if _is_older_keras_file(src):
        with _older_layouts():
            older = keras.saving.load_model(src, compile=False, custom_objects=_older_objects())
    else:  # already current: the copy is the same model
        older = keras.saving.load_model(src, compile=False)
    model = _current(older)
    staging = dst + ".partial.keras"
    model.save(staging)
    os.replace(staging, dst)
    return model


def load_older_weights(model, filepath):
    """Reads a 0.2 stack-layout weights file (``save_weights``) into a current-layout `model`.

    Args:
        model: a `LinearCausalLM` or `LinearBackbone` built with the
            configuration the file was saved with.
        filepath: the older ``.weights.h5`` file.
    """
    from keras_linattn.models.causal_lm import LinearCausalLM

    stack = _classes()[0]
    backbone = model.backbone if isinstance(model, LinearCausalLM) else model
    config = backbone.get_config()
    config.pop("layout", None)
    config.pop("name", None)
    reader = stack(**config, name=backbone.name)
    holder = LinearCausalLM(reader) if isinstance(model, LinearCausalLM) else reader
    holder.load_weights(filepath)
    _copy_weights(reader, backbone)


def main(argv=None):
    """``python -m keras_linattn.upgrade OLD NEW [--overwrite]``."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_linattn.upgrade",
        description="Convert a .keras file or preset written by keras_linattn 0.1/0.2 to the current layout.",
    )
    parser.add_argument("src", help="the older .keras file or preset directory")
    parser.add_argument("dst", help="where to write the converted copy (.keras file or preset directory)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    if not os.path.exists(args.src):
        parser.error(f"no such file or directory: {args.src}")
    model = upgrade(args.src, args.dst, overwrite=args.overwrite)
    print(f"wrote {args.dst} ({type(model).__name__}, {model.count_params():,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
