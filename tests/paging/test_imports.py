"""kgen.paging and kgen.tune import without cycles, counting imports inside functions and
under TYPE_CHECKING (manager.py and invariants.py used to import each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports anywhere in its body."""
    files = {_module_name(p): p for p in (ROOT / package.replace(".", "/")).glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            for name in names:
                if name in files and name != mod:
                    graph[mod].add(name)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, [*path, n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


@pytest.mark.parametrize("package", ["kgen.paging", "kgen.tune"])
def test_no_import_cycle(package):
    graph = import_graph(package)
    assert len(graph) >= 5
    assert cycle(graph) is None, cycle(graph)


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    graph = import_graph("kgen.paging")
    assert "kgen.paging.invariants" in graph["kgen.paging.manager"]  # the manager calls the checker
