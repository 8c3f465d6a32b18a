"""The keras-hub adapter of `linearize`: keras-hub teachers -> `LinearBackbone` / `LinearCausalLM`.

Imported only for a keras-hub teacher (`keras_linattn.linearization.convert`),
so ``import keras_linattn`` never imports keras_hub.

The families it knows live in `keras_linattn.linearization.families`, one
small module each: the config mapping (the teacher's config -> the
`LinearBackbone` arguments of the same architecture, with linear attention
in each attention slot) and the weight paths (every teacher weight copied by
its public variable path: ``transformer_layer_<i>/self_attention/query/
kernel``, ...). Weights of the student that the teacher has no counterpart
for (feature maps, the window's gamma) keep their initialization. See
docs/dev/families.md.
"""

import keras_hub

from keras_linattn.layers.spec import ARGUMENTS, PRETRAINED_ARGUMENTS
from keras_linattn.linearization import _deferred, families
from keras_linattn.linearization.families._common import Copier, weights_by_path
from keras_linattn.models.backbone import LinearBackbone
from keras_linattn.models.causal_lm import LinearCausalLM
from keras_linattn.models.preprocessor import LinearCausalLMPreprocessor

__all__ = ["linearize", "linearize_keras_hub"]

_weights_by_path = weights_by_path


def _attention_own(path):
    """True for a weight of the new attention itself (feature map, gamma, decay, ...), not of a projection."""
    if "/self_attention/" not in path:
        return False
    projection = path.split("/self_attention/", 1)[1].split("/", 1)[0]
    return projection not in ("query", "key", "value", "attention_output", "query_norm", "key_norm")


def _relinearize(backbone, feature_map, window_size, attention_kwargs):
    """The package's own LM with another attention (feature map, window, ...): every other weight copied.

    The attention settings of the teacher are replaced as a whole by
    `feature_map`, `window_size` and `attention_kwargs`; weights the two
    attentions share (projections, short convolutions) are copied where the
    paths and shapes match, the new attention's own weights keep their
    initialization.
    """
    config = backbone.get_config()
    for key in ARGUMENTS:
        if key not in PRETRAINED_ARGUMENTS:  # RoPE and GQA are the architecture's: kept
            config.pop(key, None)
    config.pop("name", None)
    config.pop("layout", None)  # a record of the config, not a constructor argument
    config.update(attention_kwargs)
    config["window_size"] = window_size
    config["feature_map"] = feature_map
    student = LinearBackbone(**config)
    source = _weights_by_path(backbone)
    target = _weights_by_path(student)
    maps = (
        {id(w) for block in student.decoder_blocks for w in block.attention.feature_map.weights}
        if any(block.attention.feature_map is not None for block in student.decoder_blocks)
        else set()
    )
    missing = []
    for path, w in target.items():
        if id(w) in maps:
            continue
        if path in source and tuple(source[path].shape) == tuple(w.shape):
            w.assign(source[path])
        elif not _attention_own(path):
            missing.append(path)
    if missing:
        raise ValueError(f"The teacher has no weight for these student weights (shapes or paths differ): {missing}")
    return student


def linearize_keras_hub(teacher, *, feature_map="hedgehog", window_size=64, **attention_kwargs):
    """A keras-hub `CausalLM` / `Backbone` of a registered family -> `LinearCausalLM` / `LinearBackbone`.

    Families: `keras_linattn.linearization.families.names()`. The student
    has the teacher's architecture and weights, with linear
    attention (`feature_map`, a softmax window of `window_size` tokens and
    `attention_kwargs`) in each attention slot. A `CausalLM` teacher gives a
    `LinearCausalLM` whose preprocessor is a `LinearCausalLMPreprocessor`
    over the teacher's tokenizer. The teacher is not changed. A ``dtype``
    in `attention_kwargs` is the student's dtype policy (default: the
    teacher's).

    Raises:
        TypeError: for a keras-hub family that is not supported (named,
            with the reason).
        ValueError: if a teacher weight has no place in the student or a
            shape differs (nothing is copied silently in part).
    """
    # The student computes the teacher's function where the window covers the sequence: no random
    # short convolution unless asked for (the feature map is passed on explicitly too).
    attention_kwargs = {"conv_size": None, **attention_kwargs}
    is_task = isinstance(teacher, keras_hub.models.CausalLM)
    backbone = teacher.backbone if is_task else teacher
    if not isinstance(backbone, keras_hub.models.Backbone):
        raise TypeError(f"Expected a keras-hub CausalLM or Backbone. Received: {type(teacher).__name__}")
    if isinstance(backbone, LinearBackbone):
        student = _relinearize(backbone, feature_map, window_size, attention_kwargs)
    else:
        family = families.get(backbone)
        config = family.config(backbone.get_config(), backbone, window_size)
        # A teacher layer that is already local stays so, whatever the student's attention arguments.
        local = {key: config[key] for key in ("window_size", "linear_weight", "logit_soft_cap") if key in config}
        config["dtype"] = backbone.dtype_policy.name
        config.update(attention_kwargs)  # a `dtype` there is the student's policy
        config.update(local)
        config.setdefault("window_size", window_size)
        # Built with its variables' initialization deferred: the teacher's weights are their first values.
        with _deferred.deferred(lambda: LinearBackbone(feature_map=feature_map, **config)) as student:
            copier = Copier(backbone)
            family.weights(copier, student, backbone)
            copier.check_all_used()
    if not is_task:
        return student
    preprocessor = None
    if teacher.preprocessor is not None:
        preprocessor = LinearCausalLMPreprocessor(
            teacher.preprocessor.tokenizer, sequence_length=teacher.preprocessor.sequence_length
        )
    return LinearCausalLM(student, preprocessor=preprocessor)


def linearize(teacher, *, feature_map, window_size, **attention_kwargs):
    """`keras_linattn.linearize` for a keras-hub teacher (`linearize_keras_hub`)."""
    return linearize_keras_hub(teacher, feature_map=feature_map, window_size=window_size, **attention_kwargs)
