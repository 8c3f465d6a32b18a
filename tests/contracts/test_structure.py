"""The package's structure: no import circle, no arrow back up a layer, files and functions within their limits.

The figures come from tools/code_metrics.py (docs/dev/structure.md): the
same code the documented command runs. Nothing here imports the package.
"""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "tools" / "code_metrics.py")
metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metrics)

ARROWS, FUNCTION_LEVEL = metrics.import_graph()
EVERY_IMPORT = metrics.with_function_level(ARROWS, FUNCTION_LEVEL)


def test_no_import_circle():
    assert metrics.cycles(ARROWS) == []
    assert metrics.cycles(EVERY_IMPORT) == []  # the imports inside functions close no circle either


def test_no_arrow_back_up():
    assert metrics.upward_arrows(ARROWS) == []
    assert metrics.upward_arrows(EVERY_IMPORT) == []


def test_function_level_imports_of_the_package_are_the_documented_boundaries():
    found = {(module, target) for module, _, target in FUNCTION_LEVEL}
    assert found == set(metrics.FUNCTION_LEVEL_ALLOWED), "update FUNCTION_LEVEL_ALLOWED and docs/dev/structure.md"
    doc = (ROOT / "docs" / "dev" / "structure.md").read_text()
    for module, target in metrics.FUNCTION_LEVEL_ALLOWED:
        assert f"`{module}` -> `{target}`" in doc, (module, target)


def test_no_module_over_600_lines():
    over = {path: n for path, n in metrics.lines_per_module().items() if n > metrics.MAX_MODULE_LINES}
    assert metrics.MAX_MODULE_LINES == 600
    assert over == {}


def test_no_function_over_100_lines():
    over = [(n, name) for n, name in metrics.functions() if n > metrics.MAX_FUNCTION_LINES]
    assert metrics.MAX_FUNCTION_LINES == 100
    assert over == []


def test_the_graph_tools_find_circles_and_arrows_back_up():
    arrows = {
        "keras_linattn.ops.core": ["keras_linattn.layers.spec"],  # kernels -> layers: back up
        "keras_linattn.layers.spec": ["keras_linattn.ops.core"],
        "keras_linattn.models.backbone": ["keras_linattn.layers.spec"],
    }
    assert metrics.cycles(arrows) == [["keras_linattn.layers.spec", "keras_linattn.ops.core"]]
    assert metrics.upward_arrows(arrows) == [("keras_linattn.ops.core", "keras_linattn.layers.spec")]
    assert metrics.layer_of("keras_linattn._compat") == 0
    assert metrics.layer_of("keras_linattn") == len(metrics.LAYERS) - 1
    assert metrics.layer_of("keras_linattn.ops._common") == metrics.layer_of("keras_linattn.ops")


def test_the_graph_reads_imports_as_python_resolves_them(tmp_path, monkeypatch):
    package = tmp_path / "keras_linattn"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_compat.py").write_text("")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "a.py").write_text(
        "from keras_linattn import _compat\nfrom . import b\nimport keras_linattn.models.b\n"
        "def f():\n    from keras_linattn.models.b import name\n"
    )
    (package / "models" / "b.py").write_text("from keras_linattn.models import a\n")
    monkeypatch.setattr(metrics, "ROOT", tmp_path)
    monkeypatch.setattr(metrics, "PACKAGE", package)
    arrows, function_level = metrics.import_graph()
    assert arrows["keras_linattn.models.a"] == ["keras_linattn._compat", "keras_linattn.models.b"]
    assert function_level == [("keras_linattn.models.a", 5, "keras_linattn.models.b")]
    assert metrics.cycles(arrows) == [["keras_linattn.models.a", "keras_linattn.models.b"]]
