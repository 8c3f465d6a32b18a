"""griffe extension: read Keras-style docstrings as the Google style that mkdocstrings renders.

Keras writes its examples as ``Example:`` followed by doctest lines at the docstring's own indentation, lists
``Call arguments:`` as a section that Google style does not know, and documents two parameters on one line
(``q_t, k_t: ...``). Before griffe parses a docstring this extension

- wraps each doctest block (``>>>`` lines and their output) in a ``pycon`` code fence;
- turns ``Call arguments:`` into a bold title over a list of the arguments;
- splits ``a, b: text`` inside ``Args:`` into one entry per name, each with the text (names may run over two
  lines);
- does not warn about documented parameters that a class or function takes through ``**kwargs`` (Keras layers
  document their base class's keyword arguments); elsewhere an unknown parameter name still fails the build;
- takes the docstring a class has at run time where its source has a ``{placeholder}`` that
  ``keras_linattn._docstrings.fill`` replaces when the class is defined.

The source docstrings stay as they are (tests/contracts/test_doctests.py runs their examples).
"""

import importlib
import inspect
import re

import griffe

_KNOWN = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Attributes|Note|Notes|Warning|Warnings):$")
_EXTRA = re.compile(r"^(Call arguments|Input shape|Output shape):$")
_ENTRY = re.compile(r"^    (\*{0,2}[\w.]+(?:, \*{0,2}[\w.]+)*): ?(.*)$")


def _indented(line):
    return not line.strip() or line.startswith("    ")


_NAMES_CONTINUED = re.compile(r"^    [\w]+(?:, [\w]+)*,$")


def convert(text):
    lines, out, i = text.split("\n"), [], 0
    # "    a, b,\n    c,\n    d: text" -> "    a, b, c, d: text"
    joined = []
    for line in lines:
        if joined and _NAMES_CONTINUED.match(joined[-1]) and (_ENTRY.match(line) or _NAMES_CONTINUED.match(line)):
            joined[-1] = joined[-1] + " " + line.strip()
        else:
            joined.append(line)
    lines = joined
    section = None
    while i < len(lines):
        line = lines[i]
        if line.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        if line in ("Example:", "Examples:"):
            out.append(f"**{line}**")
            section = None
            i += 1
            continue
        extra = _EXTRA.match(line)
        if extra:
            out += [f"**{extra.group(1)}:**", ""]
            i += 1
            while i < len(lines) and _indented(lines[i]):
                entry = _ENTRY.match(lines[i])
                if entry:
                    out.append(f"- **`{entry.group(1)}`** – {entry.group(2)}")
                elif lines[i].strip():
                    out.append("  " + lines[i].strip())
                else:
                    out.append("")
                i += 1
            section = None
            continue
        if _KNOWN.match(line):
            section = line
        elif line.strip() and not line.startswith(" "):
            section = None
        entry = _ENTRY.match(line)
        if section in ("Args:", "Arguments:") and entry and ", " in entry.group(1):
            rest = []
            j = i + 1
            while j < len(lines) and lines[j].startswith("        "):
                rest.append(lines[j])
                j += 1
            for name in entry.group(1).split(", "):
                out += [f"    {name}: {entry.group(2)}", *rest]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


_PLACEHOLDER = re.compile(r"^\{[a-z_]+\}$", re.MULTILINE)


def _runtime_docstring(obj):
    runtime = importlib.import_module(obj.module.path)
    for part in obj.path[len(obj.module.path) + 1 :].split("."):
        runtime = getattr(runtime, part)
    return inspect.cleandoc(runtime.__doc__)


class _KwargsDocstring(griffe.Docstring):
    """A docstring whose parser never warns about parameters absent from the signature (they go to ``**kwargs``).

    A property, because mkdocstrings sets ``parser_options`` again on the object it renders.
    """

    @property
    def parser_options(self):
        return {**self.__dict__.get("_options", {}), "warn_unknown_params": False}

    @parser_options.setter
    def parser_options(self, value):
        self.__dict__["_options"] = dict(value or {})


class KerasDocstrings(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs):
        if obj.docstring is None:
            return
        if obj.is_class and _PLACEHOLDER.search(obj.docstring.value):
            obj.docstring.value = _runtime_docstring(obj)
        obj.docstring.value = convert(obj.docstring.value)

    def on_object(self, *, obj, loader, **kwargs):
        if obj.docstring is None or not (obj.is_class or obj.is_function):
            return
        try:
            parameters = list(obj.parameters)
        except Exception:  # a class without __init__ of its own in the tree
            return
        if any(p.kind is not None and p.kind.value == "variadic keyword" for p in parameters):
            options = obj.docstring.__dict__.pop("parser_options", {})
            obj.docstring.__class__ = _KwargsDocstring
            obj.docstring.parser_options = options
