"""No subpackage of cpshard imports a subpackage that imports it back (function-level imports
included): the package graph, read from every module's import statements, has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cpshard"


def _unit(path: Path) -> str:
    """The top-level unit a module belongs to: its subpackage, or itself at the top."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _edges() -> dict[str, set[str]]:
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "cpshard" and len(parts) > 1 and parts[1] in units:
                    if parts[1] != _unit(path) and parts[1] != "__init__":
                        edges.setdefault(_unit(path), set()).add(parts[1])
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (as a path), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        stack.append(unit)
        for other in sorted(edges.get(unit, ())):
            if state.get(other) == 1:
                return stack[stack.index(other):] + [other]
            if other not in state and (found := visit(other)) is not None:
                return found
        stack.pop()
        state[unit] = 2
        return None

    for unit in sorted(edges):
        if unit not in state and (found := visit(unit)) is not None:
            return found
    return None


def test_no_subpackage_imports_one_that_imports_it_back() -> None:
    edges = _edges()
    assert edges.get("attention") and "guard" in edges["attention"]  # the graph was read
    assert _cycle(edges) is None, f"import cycle: {' -> '.join(_cycle(edges))}"


def test_a_cycle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
