"""kvsieve's modules import each other without a circle at module level (imports under ``TYPE_CHECKING`` or inside
functions do not count): each module can be read, and imported, after the modules it names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvsieve

ROOT = Path(kvsieve.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ("kvsieve", *path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvsieve modules ``name`` imports when it is imported (the innermost module each import names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for statement in node.body if isinstance(node, ast.Try) else [node]:
            if isinstance(statement, ast.Import):
                named |= {alias.name for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom):
                base = statement.module or ""
                if statement.level:
                    parts = package.split(".")[: len(package.split(".")) - statement.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                named |= {base, *(f"{base}.{alias.name}" for alias in statement.names)}
    found = set()
    for module in named:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module.startswith("kvsieve") and module != name:
            found.add(module)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_module_level_import_circle() -> None:
    modules = _modules()
    graph = {name: _module_level_imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 50 and "kvsieve.engine.step" in graph["kvsieve.engine.layer"]
    assert _circles(graph) == []


def test_a_circle_is_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
