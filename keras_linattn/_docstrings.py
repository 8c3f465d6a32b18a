"""Docstring sections shared by several public classes, written once.

A class docstring names a section with a placeholder such as
``{projection_args}``; the `fill` decorator replaces it when the class is
defined, so `help()` and the API docs show the whole text.
"""

import re
import textwrap


def fill(**sections):
    """Class decorator replacing ``{name}`` in the docstring by ``sections[name]``.

    Only the named placeholders are replaced (other braces, as in ``h_{k-1}``,
    are left alone). Raises ValueError if a named placeholder is missing, so
    a section cannot silently drop out of a docstring.
    """

    def decorate(cls):
        doc = cls.__doc__
        for name, text in sections.items():
            placeholder = "{" + name + "}"
            if placeholder not in doc:
                raise ValueError(f"{cls.__name__}'s docstring has no {placeholder} placeholder.")
            match = re.search(r"^( *)" + re.escape(placeholder) + r"$", doc, flags=re.MULTILINE)
            if match is None:  # inside a line: replaced as is
                doc = doc.replace(placeholder, text)
                continue
            # On a line of its own: the sections are written for a placeholder at
            # column 0; a formatter that indents the docstring (ruff format)
            # indents the placeholder with it, and the section follows by as much.
            indent = match.group(1)
            doc = doc.replace(indent + placeholder, textwrap.indent(text, indent))
        cls.__doc__ = doc
        return cls

    return decorate
