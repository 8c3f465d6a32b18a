"""Public API contract: complete docstrings and keyword-only shared arguments."""

import inspect
import re

import pytest

import keras_linattn
from keras_linattn import feature_maps
from keras_linattn._docstrings import fill

PUBLIC_CLASSES = [
    keras_linattn.layers.LinearAttention,
    keras_linattn.layers.EfficientAttention,
    keras_linattn.layers.LinearTransformerEncoder,
    keras_linattn.layers.LinearTransformerDecoder,
] + [type(feature_maps.get(name)) for name in feature_maps.available()]


def _constructor_arguments(cls):
    """Named constructor arguments of `cls` and its keras_linattn base classes."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("keras_linattn") and "__init__" in vars(klass):
            names |= {
                name
                for name, p in inspect.signature(klass.__init__).parameters.items()
                if name != "self" and p.kind is not p.VAR_KEYWORD
            }
    # _GLUStack's internal arguments, fixed by each public GLU map.
    return names - {"filter_initializer", "gate_initializer", "filter_penalty"}


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda c: c.__name__)
def test_docstrings_have_no_unfilled_section(cls):
    for placeholder in ("{shared_args}", "{call}", "{projection_args}", "{block_args}"):
        assert placeholder not in cls.__doc__


@pytest.mark.parametrize("cls", PUBLIC_CLASSES, ids=lambda c: c.__name__)
def test_every_constructor_argument_is_documented(cls):
    names = _constructor_arguments(cls)
    if not names:
        assert "Args:" not in cls.__doc__
        return
    documented = cls.__doc__.split("Args:")[1].split("Call arguments:")[0]
    # An entry starts a line: "name:" or a comma-separated group "a, name, b:".
    entries = set()
    for match in re.finditer(r"^ {8}([\w, ]+?):", documented, flags=re.M):
        entries |= {part.strip() for part in match.group(1).split(",")}
    for line in re.finditer(r"^ {8}([\w, ]+),$", documented, flags=re.M):
        entries |= {part.strip() for part in line.group(1).split(",")}
    missing = sorted(names - entries)
    assert not missing, f"{cls.__name__} does not document {missing}"


def test_fill_refuses_a_missing_placeholder():
    class NoPlaceholder:
        """Args: nothing here."""

    with pytest.raises(ValueError, match=r"\{extra\}"):
        fill(extra="text")(NoPlaceholder)


def test_fill_leaves_other_braces_alone():
    @fill(part="x: an argument.")
    class Doc:
        """h_{k-1} and {part}"""

    assert Doc.__doc__ == "h_{k-1} and x: an argument."


@pytest.mark.parametrize(
    "build",
    [
        # Positionally, the sixth argument used to be `dropout`: refusing it beats reading it as epsilon.
        lambda: keras_linattn.layers.LinearAttention(4, 16, None, "elu", 64, 0.1),
        lambda: keras_linattn.layers.EfficientAttention(4, 16, None, None, None, None, 1.0, 0.1),
        lambda: feature_maps.get("oglu").__class__(2),
        lambda: feature_maps.get("ffn").__class__(2),
        lambda: feature_maps.get("aoglu").__class__(8),
    ],
    ids=["LinearAttention", "EfficientAttention", "oglu", "ffn", "aoglu"],
)
def test_shared_arguments_are_keyword_only(build):
    with pytest.raises(TypeError, match="positional"):
        build()
