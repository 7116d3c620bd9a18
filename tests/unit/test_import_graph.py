"""The import graph of tensorrpc/ has no cycle, lazy (function-level) imports included.

Read from the source with ast: every ``import``/``from ... import`` anywhere in a module
(top level, ``if TYPE_CHECKING:`` blocks excepted, inside functions and classes) is an
edge to the tensorrpc module it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tensorrpc"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, except those under ``if TYPE_CHECKING:`` (never run)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(base: str, level: int, module: str | None, is_package: bool) -> str:
    if level == 0:
        return module or ""
    parts = base.split(".")
    if not is_package:
        parts.pop()
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (lazy imports included)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    top = root.name
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, node.level, node.module, is_package)
                # ``from pkg import mod`` names a module; ``from mod import obj`` needs mod.
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for target in targets:
                if target.split(".")[0] != top:
                    continue
                # The module itself, or the nearest enclosing module that is a file (a
                # package's ``__init__``: importing a name it defines needs all it runs).
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (as a path that returns to its start), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    for start in sorted(graph):
        if colour[start] != white:
            continue
        path = [start]
        iters = [iter(sorted(graph[start]))]
        colour[start] = grey
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                colour[path.pop()] = black
                iters.pop()
            elif colour[nxt] == grey:
                return [*path[path.index(nxt) :], nxt]
            elif colour[nxt] == white:
                colour[nxt] = grey
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_tensorrpc_import_graph_has_no_cycle():
    graph = import_graph(PACKAGE)
    assert "tensorrpc._observe" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_sees_lazy_and_relative_imports_and_skips_type_checking(tmp_path: Path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.c\n"
        "from .sub import d\n"
    )
    (pkg / "c.py").write_text("import pkg.b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from ..a import f\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.d"}
    assert graph["pkg.c"] == {"pkg.b"}
    assert graph["pkg.sub.d"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.d", "pkg.a"]
    assert find_cycle({"x": {"y"}, "y": set()}) is None


#: The client's and the engine's I/O shells (those that exist): statistics are read
#: without them.
SHELLS = frozenset(
    {
        "tensorrpc._client",
        "tensorrpc._client_calls",
        "tensorrpc._client_io",
        "tensorrpc._dispatch",
        "tensorrpc._server",
        "tensorrpc._server_calls",
    }
)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (lazy imports included)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_metrics_and_observe_reach_no_shell():
    graph = import_graph(PACKAGE)
    shells = SHELLS & set(graph)
    assert {"tensorrpc._client", "tensorrpc._server"} <= shells
    for module in ("tensorrpc.metrics", "tensorrpc._observe", "tensorrpc._statistics"):
        assert reachable(graph, module) & shells == set(), module


def test_reachable_follows_imports_through_other_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert reachable(graph, "a") == {"a", "b", "c"}
    assert reachable(graph, "d") == set()
