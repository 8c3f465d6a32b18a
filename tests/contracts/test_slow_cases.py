"""tests/slow_cases.txt names tests that exist: a renamed or removed test would otherwise return silently to
`make test` (or vanish from `make test-slow`) without anyone noticing."""

import ast
import os

from tests.conftest import SLOW_CASES_FILE, read_slow_cases

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _test_functions(path):
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
    return names


def test_every_listed_case_names_an_existing_test_once():
    cases = read_slow_cases()
    assert cases, f"{SLOW_CASES_FILE} lists no case"
    assert len(cases) == len(set(cases)), "a case is listed twice"
    missing = []
    for case in cases:
        path, _, rest = case.partition("::")
        name = rest.split("[", 1)[0].split("::")[-1]
        if not os.path.isfile(os.path.join(ROOT, path)) or name not in _test_functions(path):
            missing.append(case)
    assert not missing, f"slow_cases.txt names tests that do not exist: {missing}"


def test_the_reader_drops_comments_and_blank_lines(tmp_path):
    listed = tmp_path / "cases.txt"
    listed.write_text("# a header\n\ntests/a.py::test_x[1]  # 31\n  tests/b.py::test_y\n")
    assert read_slow_cases(str(listed)) == ["tests/a.py::test_x[1]", "tests/b.py::test_y"]
