"""Every ``>>>`` example in the package's docstrings runs, and what it prints must match."""

import doctest
import importlib
import pkgutil

import pytest

import keras_linattn


def _modules_with_examples():
    finder = doctest.DocTestFinder()
    names = ["keras_linattn"] + [m.name for m in pkgutil.walk_packages(keras_linattn.__path__, "keras_linattn.")]
    return [name for name in names if any(t.examples for t in finder.find(importlib.import_module(name)))]


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    # The public layers, feature maps, samplers, export helpers and the package itself all show one.
    assert len(MODULES) >= 20, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(importlib.import_module(name)):
        if test.examples:
            runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, "".join(report)
