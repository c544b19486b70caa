"""The package's shape, checked: no import circle among objfs's modules, no module over 700
lines, and no module but the command itself imports ``objfs.cli``.

Imports are read from the source (every ``import`` and ``from ... import`` anywhere in a module,
function-level ones included, since a deferred import is still a dependency), then the strongly
connected components of that graph are found (Tarjan). A component of more than one module, or
a module that imports itself, is a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "objfs"
MAX_LINES = 700
#: The modules allowed to import ``objfs.cli``: the ``python -m objfs`` entry point.
CLI_IMPORTERS = frozenset({"objfs.__main__"})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The objfs modules ``name`` (at ``path``) imports, as names in ``known``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # ``from objfs import mount`` names the module objfs.mount.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported_modules(name, path, known) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_relative_imports() -> None:
    graph = import_graph()
    # objfs/__main__.py imports the command at module level; the command defers the sidecar's.
    assert "objfs.cli" in graph["objfs.__main__"]
    assert "objfs.sidecar" in graph["objfs.cli"]
    assert len(graph) > 30


def test_no_import_circle() -> None:
    graph = import_graph()
    found = circles(graph)
    detail = [
        {member: sorted(graph[member] & set(component)) for member in component}
        for component in found
    ]
    assert not found, f"import circles among objfs's modules: {detail}"


def test_only_the_entry_point_imports_the_command() -> None:
    importers = {name for name, deps in import_graph().items() if "objfs.cli" in deps}
    assert importers <= CLI_IMPORTERS, (
        f"{sorted(importers - CLI_IMPORTERS)} import objfs.cli: options live in objfs.options"
    )


def test_no_module_over_the_line_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them along their jobs): {over}"
