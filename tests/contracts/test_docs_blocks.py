"""The Python blocks of docs/*.md and docs/dev/*.md run as written (``make test-slow``: some pages train or export).

A page's blocks run in order in one namespace (a guide builds on its earlier blocks), in a fresh
subprocess in an empty folder, offline. A block that cannot run alone says so on its first line,
``# Fragment: <why>; complete and runnable: <path>``, and the path must exist in the repository.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "docs", "dev", "*.md")))
FRAGMENT = re.compile(r"#\s*Fragment\b.*?runnable:\s*(\S+)", re.I)

_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for k, block in enumerate(json.load(open(sys.argv[1], encoding="utf-8"))):
    print(f"=== block {k}", flush=True)
    exec(compile(block, f"{sys.argv[2]} (python block {k})", "exec"), namespace)
"""


def python_blocks(path):
    with open(path, encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.DOTALL | re.MULTILINE)


def _is_fragment(block):
    first = block.lstrip().splitlines()[0] if block.strip() else ""
    return first.lstrip().lower().startswith("# fragment")


def test_fragments_link_a_runnable_file():
    for page in PAGES:
        for block in python_blocks(page):
            if _is_fragment(block):
                match = FRAGMENT.search(block.splitlines()[0])
                assert match, f"{page}: a fragment names the runnable file: {block.splitlines()[0]!r}"
                target = match.group(1).rstrip(".,;)")
                assert os.path.exists(os.path.join(ROOT, target)), f"{page}: {target} does not exist"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=os.path.basename)
def test_page_blocks_run(page, tmp_path):
    runnable = [b for b in python_blocks(page) if not _is_fragment(b)]
    if not runnable:
        pytest.skip("every block of this page is a fragment")
    (tmp_path / "blocks.json").write_text(json.dumps(runnable), encoding="utf-8")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json"), os.path.relpath(page, ROOT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
