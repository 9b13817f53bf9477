"""The gateway's package layout: no import of the worker package, no import cycle between gateway modules, and the
pipeline's users on the right side of the HTTP layer (DESIGN.md, Layout of the gateway)."""

from __future__ import annotations

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def _module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[str]:
    """Return the modules ``tree`` imports at run time (imports under ``if TYPE_CHECKING:`` left out)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    """Return gateway module → the gateway modules it imports."""
    trees = {_module_name(path): ast.parse(path.read_text()) for path in GATEWAY.rglob("*.py")}
    return {name: {imported for imported in _imports(tree) if imported in trees and imported != name}
            for name, tree in trees.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """Return one import cycle as [a, b, …, a], or None (depth-first search with colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == 1:
                return stack[stack.index(nxt):] + [nxt]
            if colour[nxt] == 0 and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_find_cycle_finds_a_cycle_and_accepts_a_tree():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_gateway_modules_import_no_cycle():
    assert _find_cycle(_graph()) is None


def test_gateway_never_imports_the_worker_package():
    trees = ((_module_name(path), ast.parse(path.read_text())) for path in GATEWAY.rglob("*.py"))
    offenders = sorted(name for name, tree in trees
                       if any(m == "worker" or m.startswith("worker.") for m in _imports(tree)))
    assert offenders == []


def test_jobs_and_pipeline_never_import_the_http_layer():
    graph = _graph()
    offenders = sorted((name, imported) for name, imports in graph.items()
                       if name.startswith(("gateway.jobs", "gateway.pipeline")) for imported in imports
                       if imported.startswith("gateway.http"))
    assert offenders == []
