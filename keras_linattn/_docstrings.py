"""Docstring sections shared by several public classes, written once.

A class docstring names a section with a placeholder such as
``{projection_args}``; the `fill` decorator replaces it when the class is
defined, so `help()` and the API docs show the whole text.
"""


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
            doc = doc.replace(placeholder, text)
        cls.__doc__ = doc
        return cls

    return decorate
