"""The README: its first lines are the two commands, its links resolve, its Python blocks run as written.

Every ```python block runs on its own (a fresh namespace: nothing carried over from the block above,
as a reader copies one), all in one subprocess in an empty folder, offline, in seconds each.
"""

import os
import re
import subprocess
import sys
import textwrap

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
    assert len(text.splitlines()) <= 180
    # No planning vocabulary, references outside the repository or figures measured on some host (docs/results.md
    # has the figures, each with its command).
    for word in ("FACTS", "missed", "target", "floor", "machine B", "this release", "host"):
        assert word not in text, word
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text), "a commit hash"


def test_relative_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", _text())
    local = [link.split("#")[0] for link in links if not re.match(r"^[a-z]+:", link)]
    assert local, "no relative links found"
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


_RUNNER = textwrap.dedent(
    """
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1], encoding="utf-8"))
    for k, block in enumerate(blocks):
        print(f"=== block {k}", flush=True)
        try:
            exec(compile(block, f"README.md (python block {k})", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            print(f"=== block {k} failed", flush=True)
            sys.exit(1)
    """
)


def test_every_python_block_runs_as_written(tmp_path):
    blocks = _python_blocks()
    assert len(blocks) >= 4
    (tmp_path / "blocks.json").write_text(__import__("json").dumps(blocks), encoding="utf-8")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    printed = result.stdout.split("=== block ")
    quick_start, keras_hub, linearize, export = printed[1:5]
    assert quick_start.strip().endswith("(2, 12)"), quick_start
    # The generated texts, printed as a list (repr quotes a text with ' in it with ").
    generated = __import__("ast").literal_eval(keras_hub.strip().splitlines()[-1])
    assert generated[0].startswith("def f(x):"), keras_hub
    assert (tmp_path / "my_lm" / "config.json").exists()
    assert (tmp_path / "models" / "classifier" / "1" / "saved_model.pb").exists()
    assert (tmp_path / "onnx" / "classifier.onnx").exists()
    assert "saved_model" in export and "onnx" in export
    assert "DivergenceWarning" not in out and "Traceback" not in out
