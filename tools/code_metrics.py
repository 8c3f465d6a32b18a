"""Structure figures for the package: lines per module, the longest functions,
the files that name an argument, and the private Keras/TF accesses.

    python tools/code_metrics.py [--name window_size] [--top 15] [--json out.json]

Lines are physical lines (blank and comment lines included), as `wc -l` counts
them. A function's length runs from its `def` line to its last line, less its
docstring.
"""

import argparse
import ast
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_linattn"


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path):
    return str(path.relative_to(ROOT))


def lines_per_module():
    return {_rel(p): len(p.read_text().splitlines()) for p in modules()}


def functions():
    """(length, "module:qualname") for every function and method."""
    out = []
    for path in modules():
        tree = ast.parse(path.read_text())

        def visit(node, prefix, path=path):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    length = child.end_lineno - child.lineno + 1
                    doc = child.body[0] if child.body else None
                    if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                        if isinstance(doc.value.value, str):
                            length -= doc.end_lineno - doc.lineno + 1
                    out.append((length, f"{_rel(path)}:{name}"))
                    visit(child, name + ".", path)
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.", path)

        visit(tree, "")
    return sorted(out, reverse=True)


def files_naming(name):
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    return [_rel(p) for p in modules() if pattern.search(p.read_text())]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="window_size")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()
    lines = lines_per_module()
    funcs = functions()
    naming = files_naming(args.name)
    print(f"{len(lines)} modules, {sum(lines.values())} lines")
    print("\nlongest modules (lines):")
    for path, n in sorted(lines.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {n:5d}  {path}")
    print("\nlongest functions (lines):")
    for n, name in funcs[: args.top]:
        print(f"  {n:5d}  {name}")
    print(f"\nfunctions over 80 lines: {sum(1 for n, _ in funcs if n > 80)}")
    print(f"\nfiles naming `{args.name}`: {len(naming)}")
    for path in naming:
        print(f"  {path}")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "modules": len(lines),
                    "lines": sum(lines.values()),
                    "lines_per_module": lines,
                    "longest_functions": [[n, name] for n, name in funcs[: args.top]],
                    "functions_over_80_lines": sum(1 for n, _ in funcs if n > 80),
                    f"files_naming_{args.name}": naming,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
