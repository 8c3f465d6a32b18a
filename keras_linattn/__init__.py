"""keras_linattn: kernelized linear attention layers for Keras 3 (TensorFlow backend).

>>> import keras_linattn as kla
>>> layer = kla.layers.LinearAttention(num_heads=8, key_dim=64, feature_map="elu")
>>> layer.num_heads, layer.key_dim
(8, 64)

Importing the package imports nothing heavy and changes no environment
variable: each subpackage (`layers`, `export`, `models`, ...) and
`linearize` / `attention_transfer` load on first use, so
`keras_linattn.serving` runs with numpy and onnxruntime alone. Pick the
Keras backend with ``KERAS_BACKEND`` before importing Keras (TensorFlow is
Keras' default). The export toolchain (tf2onnx, onnx, onnxruntime) is
imported only by the functions that need it, and keras-hub only by
`keras_linattn.models`.

Once Keras is imported (before or after this package), `.keras` files that
hold this package's classes load without importing anything else; once
keras-hub is imported, its `from_preset` finds the linearized models
(`keras_hub.models.CausalLM.from_preset(<a preset saved by LinearCausalLM>)`).
`quiet()` keeps TensorFlow's start-up lines and known-harmless warnings out.
"""

import importlib
import sys

from keras_linattn import _lazy
from keras_linattn._quiet import quiet
from keras_linattn.version import __version__

__all__ = [
    "__version__",
    "attention_transfer",
    "callbacks",
    "distill",
    "export",
    "feature_maps",
    "layers",
    "linearization",
    "linearize",
    "models",
    "ops",
    "quiet",
    "recurrences",
    "regularizers",
    "samplers",
    "serving",
]

_SUBMODULES = {
    "callbacks",
    "distill",
    "export",
    "feature_maps",
    "layers",
    "linearization",
    "models",
    "ops",
    "recurrences",
    "regularizers",
    "samplers",
    "serving",
}
_FUNCTIONS = {"attention_transfer": "keras_linattn.linearization", "linearize": "keras_linattn.linearization"}

# Every class this package registers with Keras, by module: `.keras` files naming one load before its module is
# imported (tests/contracts/test_lazy_import.py checks this table against the registrations).
_KERAS_CLASSES = {
    "keras_linattn.callbacks": ("RedrawRandomFeatures",),
    "keras_linattn.feature_maps.aoglu": ("AOGLUFeatureMap",),
    "keras_linattn.feature_maps.elu": ("EluFeatureMap",),
    "keras_linattn.feature_maps.favor": ("FavorPlusFeatureMap",),
    "keras_linattn.feature_maps.favor_trig": ("FavorTrigFeatureMap",),
    "keras_linattn.feature_maps.ffn": ("FFNFeatureMap",),
    "keras_linattn.feature_maps.glu": ("GLUFeatureMap",),
    "keras_linattn.feature_maps.hedgehog": ("HedgehogFeatureMap",),
    "keras_linattn.feature_maps.oglu": ("OGLUFeatureMap",),
    "keras_linattn.feature_maps.relu": ("ReluFeatureMap",),
    "keras_linattn.feature_maps.taylor": ("TaylorFeatureMap",),
    "keras_linattn.layers.efficient_attention": ("EfficientAttention",),
    "keras_linattn.layers.linear_attention": ("LinearAttention",),
    "keras_linattn.layers.linear_attention_cell": ("LinearAttentionCell",),
    "keras_linattn.layers.mixture_of_experts": ("MixtureOfExperts",),
    "keras_linattn.layers.transformer_decoder": ("LinearTransformerDecoder",),
    "keras_linattn.layers.transformer_encoder": ("LinearTransformerEncoder",),
    "keras_linattn.models.backbone": ("LinearBackbone",),
    "keras_linattn.models.causal_lm": ("LinearCausalLM",),
    "keras_linattn.models.preprocessor": ("LinearCausalLMPreprocessor",),
    "keras_linattn.recurrences.additive": ("AdditiveRecurrence",),
    "keras_linattn.recurrences.decay": ("DecayRecurrence",),
    "keras_linattn.recurrences.delta": ("DeltaRecurrence",),
    "keras_linattn.recurrences.sparse_cache": ("SparseCacheRecurrence",),
    "keras_linattn.recurrences.window": ("WindowRecurrence",),
    "keras_linattn.regularizers": ("OrthogonalRegularizer",),
    "keras_linattn.samplers": ("GreedySampler", "RandomSampler", "TopKSampler", "TopPSampler"),
}


def _register_keras_loaders():
    """Lets Keras load files naming this package's classes before their modules are imported.

    Each registered name points to a loader whose `from_config` imports the
    module and hands the config to the real class; importing the module
    registers the real class in its place.
    """
    import keras

    def loader(module, name):
        def from_config(cls, config):
            # The class itself, not the registry: a load in progress may hold a copy of the registry with this loader.
            return getattr(importlib.import_module(module), name).from_config(config)

        return type(f"_Load{name}", (), {"from_config": classmethod(from_config), "get_config": lambda self: {}})

    registry = keras.saving.get_custom_objects()
    for module, names in _KERAS_CLASSES.items():
        for name in names:
            registry.setdefault(f"keras_linattn>{name}", loader(module, name))
    # The class keras_linattn 0.1's flat LM files record: refused with the converter's name.
    registry.setdefault("keras_linattn>_Round2LinearCausalLM", _FlatFileRefusal)


class _FlatFileRefusal:
    """Loads nothing: a file of keras_linattn 0.1's flat `LinearCausalLM` names the converter instead."""

    @classmethod
    def from_config(cls, config):
        raise ValueError(
            "This file holds a LinearCausalLM of keras_linattn 0.1 (one flat model): convert it once with "
            "`python -m keras_linattn.upgrade OLD NEW` (keras_linattn.upgrade)."
        )


def _register_with_keras_hub():
    """keras-hub's `from_preset` finds `LinearCausalLM` (and its backbone and preprocessor) by subclass."""
    modules = ("keras_linattn.models.backbone", "keras_linattn.models.causal_lm", "keras_linattn.models.preprocessor")
    if any(name in sys.modules for name in modules) and not _lazy.is_imported(modules[1]):
        return  # keras_hub imported by one of these modules, which is loading them now
    importlib.import_module(modules[1])  # imports the backbone and the preprocessor too


_lazy.after_import("keras", _register_keras_loaders)
_lazy.after_import("keras_hub", _register_with_keras_hub)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_linattn.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'keras_linattn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
