"""The package's shape, checked from its source: no import cycles among cudal2's modules,
no function-level import of its own modules (optional heavy dependencies, such as torch and
cupy, stay lazy), and no function longer than 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cudal2"
MAX_LINES = 80


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def own_imports(name: str, path: Path, node: ast.AST, known: dict[str, Path]) -> set[str]:
    """The package's modules an import statement of module `name` loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    found = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
    return found | ({target} if target in known and len(found) < len(node.names) else set())


def functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_import_cycles_among_the_package_s_modules():
    known = modules()
    graph = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            graph[name] |= own_imports(name, path, node, known) - {name}
    cycles, state = [], {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_no_function_imports_the_package_s_own_modules():
    known = modules()
    lazy = []
    for name, path in known.items():
        for fn in functions(ast.parse(path.read_text())):
            for node in ast.walk(fn):
                if own_imports(name, path, node, known):
                    lazy.append(f"{path.name}:{node.lineno} in {fn.name}")
    assert not lazy, lazy


def test_no_function_is_longer_than_80_lines():
    long = [f"{path.name}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for path in modules().values() for fn in functions(ast.parse(path.read_text()))
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not long, long
