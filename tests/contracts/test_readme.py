"""The README: its first lines are the two commands, its links resolve, its Python snippets run.

The quick start runs here as written; the export snippet (SavedModel + ONNX conversion) is slow and runs
under `make test-slow` (tests/export/test_export.py and tests/export/test_onnx.py cover the same functions fast).
"""

import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
README = os.path.join(ROOT, "README.md")


def _text():
    with open(README, encoding="utf-8") as f:
        return f.read()


def _python_blocks():
    return re.findall(r"^```python\n(.*?)^```$", _text(), flags=re.DOTALL | re.MULTILINE)


def test_the_two_commands_come_first():
    lines = _text().splitlines()
    assert lines[0] == "# keras_linattn"
    assert lines[2:4] == [
        "    make demo   # creates .venv, installs everything, runs the main job end to end",
        "    make test   # creates .venv if missing, runs the whole test suite",
    ]


def test_short_and_for_users():
    text = _text()
    assert len(text.splitlines()) <= 190
    # No planning vocabulary or references outside the repository.
    for word in ("FACTS", "missed", "target", "floor", "machine B", "this release"):
        assert word not in text, word
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text), "a commit hash"


def test_relative_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", _text())
    local = [link.split("#")[0] for link in links if not re.match(r"^[a-z]+:", link)]
    assert local, "no relative links found"
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


def test_quick_start_runs(capsys):
    quick_start = _python_blocks()[0]
    assert "LinearAttention" in quick_start and "generate" in quick_start
    exec(compile(quick_start, "README.md (quick start)", "exec"), {})
    assert capsys.readouterr().out.strip().endswith("(2, 12)")


@pytest.mark.slow
def test_export_snippet_runs(tmp_path, monkeypatch, capsys):
    blocks = _python_blocks()
    quick_start = blocks[0]
    exports = [block for block in blocks if "export_saved_model" in block]
    assert len(exports) == 1, "one README block exports the quick start's model"
    export_snippet = exports[0]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(quick_start, "README.md (quick start)", "exec"), namespace)
    exec(compile(export_snippet, "README.md (export)", "exec"), namespace)
    assert (tmp_path / "models" / "classifier" / "1" / "saved_model.pb").exists()
    assert (tmp_path / "onnx" / "classifier.onnx").exists()
    assert "onnx" in capsys.readouterr().out.lower()
