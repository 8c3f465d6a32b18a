"""Structure figures for the package: lines per module, the longest functions,
the files that name an argument, and the import graph.

    python tools/code_metrics.py [--name window_size] [--top 15] [--json out.json]

Lines are physical lines (blank and comment lines included), as `wc -l` counts
them. A function's length runs from its `def` line to its last line, less its
docstring.

The import graph has one node per module of the package (a package's
`__init__` is the package) and an arrow for each of its own modules that a
module imports at module level (class bodies included, as they run at
import). Importing a submodule also runs its parents' `__init__`; those
implicit arrows are left out (the packages' `__init__`s load their names
lazily, `keras_linattn._lazy`), and so are names loaded by `importlib` at
run time. Each module belongs to one layer of `LAYERS`, lowest first; an
arrow from a lower layer to a higher one is an arrow back up, and a
strongly connected component of more than one module is an import circle.
Imports inside a function are counted apart: each must be one of
`FUNCTION_LEVEL_ALLOWED`, with its reason (docs/dev/structure.md).
"""

import argparse
import ast
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "keras_linattn"


# The layers, lowest first: (name, module prefixes). A module belongs to the layer of its longest matching prefix;
# a prefix ending in "." matches the modules under it, any other the module of that name.
LAYERS = (
    ("foundation", ("keras_linattn._", "keras_linattn.version")),
    ("kernels", ("keras_linattn.ops", "keras_linattn.regularizers", "keras_linattn.samplers")),
    ("mechanisms", ("keras_linattn.feature_maps", "keras_linattn.recurrences", "keras_linattn.generation")),
    ("layers", ("keras_linattn.layers",)),
    ("models", ("keras_linattn.models",)),
    (
        "applications",
        (
            "keras_linattn.linearization",
            "keras_linattn.export",
            "keras_linattn.distill",
            "keras_linattn.callbacks",
            "keras_linattn.serving",
            "keras_linattn.upgrade",
        ),
    ),
    ("entry points", ("keras_linattn.cli", "keras_linattn")),
)

# Imports of the package's own modules inside a function: (importing module, imported module) -> why it waits.
FUNCTION_LEVEL_ALLOWED = {
    ("keras_linattn.cli", "keras_linattn.export.warmup"): "TensorFlow boundary: only `export` with warm-up requests "
    "needs it; `verify` of ONNX files and the argument checks run without TensorFlow",
    ("keras_linattn.cli", "keras_linattn.export.saved_model"): "TensorFlow boundary: only a manifest with a "
    "SavedModel needs it; `verify` of ONNX files runs without TensorFlow",
    ("keras_linattn.upgrade", "keras_linattn.models.backbone"): "keras_hub boundary: `python -m keras_linattn.upgrade` "
    "reads its arguments and checks the paths before importing Keras and keras_hub; nothing in the package imports it",
    ("keras_linattn.upgrade", "keras_linattn.models.causal_lm"): "keras_hub boundary, as for models.backbone",
}

# The limits tests/contracts/test_structure.py holds the package to.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


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


def module_name(path):
    """`keras_linattn/models/backbone.py` -> `keras_linattn.models.backbone`; an `__init__` -> its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported(node, name, names, is_package):
    """The package's modules that the import statement `node` of module `name` imports."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        # `from a import b`: the module a.b where it is one, else a (b is a name in a).
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]
    out = []
    for target in targets:
        while target and target not in names:  # `import a.b.c` of a name inside a module: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph():
    """The package's imports of its own modules.

    Returns:
        ``(arrows, function_level)``: ``{module: sorted imported modules}``
        at module level, for every module; and ``[(module, line,
        imported module)]`` for the imports inside functions.
    """
    paths = {module_name(p): p for p in modules()}
    arrows = {name: set() for name in paths}
    function_level = []
    for name, path in paths.items():
        is_package = path.name == "__init__.py"

        def visit(node, in_function, name=name, is_package=is_package):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, name, paths, is_package):
                        if in_function:
                            function_level.append((name, child.lineno, target))
                        else:
                            arrows[name].add(target)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text()), False)
    return {name: sorted(targets) for name, targets in arrows.items()}, function_level


def with_function_level(arrows, function_level):
    """`arrows` plus the function-level imports: the graph of every import the package can run."""
    out = {name: set(targets) for name, targets in arrows.items()}
    for name, _, target in function_level:
        out[name].add(target)
    return {name: sorted(targets) for name, targets in out.items()}


def layer_of(module):
    """The index in `LAYERS` of `module`'s layer (its longest matching prefix)."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.endswith("_"):
                hit = module.startswith(prefix) and "." not in module[len(prefix) :]
            else:
                hit = module == prefix or module.startswith(prefix + ".")
            if hit and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise ValueError(f"No layer of LAYERS holds {module}: add its prefix there. Received: {module}")
    return best


def upward_arrows(arrows):
    """``[(module, imported module)]`` where the imported module's layer is higher than the importer's."""
    return [(a, b) for a, targets in sorted(arrows.items()) for b in targets if layer_of(b) > layer_of(a)]


def cycles(arrows):
    """The strongly connected components of more than one module (import circles), each sorted (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in arrows.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(arrows):
        if node not in index:
            connect(node)
    return sorted(out)


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
    print(f"modules over {MAX_MODULE_LINES} lines: {sum(1 for n in lines.values() if n > MAX_MODULE_LINES)}")
    print(f"functions over {MAX_FUNCTION_LINES} lines: {sum(1 for n, _ in funcs if n > MAX_FUNCTION_LINES)}")
    arrows, function_level = import_graph()
    up, circles = upward_arrows(arrows), cycles(arrows)
    print(
        f"\nimport graph: {len(arrows)} modules, {sum(len(t) for t in arrows.values())} module-level arrows; "
        f"import circles: {len(circles)}; arrows back up: {len(up)}"
    )
    print("layers, lowest first: " + " -> ".join(name for name, _ in LAYERS))
    for circle in circles:
        print(f"  circle: {' <-> '.join(circle)}")
    for a, b in up:
        print(f"  back up: {a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    every = with_function_level(arrows, function_level)
    up_all, circles_all = upward_arrows(every), cycles(every)
    print(f"with the function-level imports: import circles: {len(circles_all)}; arrows back up: {len(up_all)}")
    for circle in circles_all:
        print(f"  circle: {' <-> '.join(circle)}")
    for a, b in up_all:
        print(f"  back up: {a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    print(f"function-level imports of the package's own modules: {len(function_level)}")
    for module, line, target in function_level:
        known = "allowed" if (module, target) in FUNCTION_LEVEL_ALLOWED else "NOT ALLOWED"
        print(f"  {module}:{line} -> {target} ({known})")
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
                    "import_arrows": sum(len(t) for t in arrows.values()),
                    "import_circles": circles,
                    "arrows_back_up": [list(arrow) for arrow in up],
                    "function_level_imports": [list(entry) for entry in function_level],
                    "import_circles_with_function_level": circles_all,
                    "arrows_back_up_with_function_level": [list(arrow) for arrow in up_all],
                    f"files_naming_{args.name}": naming,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
