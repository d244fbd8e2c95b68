"""hvdcomp's layers import one way (docs/architecture.md): the import graph of hvdcomp/, built from the sources (every
import statement, those inside functions too; only ``if TYPE_CHECKING:`` blocks, which never run, are left out), has
no cycle, and the layers the architecture names stay apart."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hvdcomp"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    """Module -> the hvdcomp modules it imports. ``from package import name`` is an edge to the submodule ``name``
    where there is one (importing a submodule runs its package's ``__init__``, which is the package's own layer)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
        while pending:
            node = pending.pop()
            if isinstance(node, ast.If) and _type_checking(node):
                pending.extend(node.orelse)
                continue
            pending.extend(ast.iter_child_nodes(node))
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, pending = set(), [start]
    while pending:
        for other in graph[pending.pop()] - seen:
            seen.add(other)
            pending.append(other)
    return seen


def test_the_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_hvdcomp_has_no_import_cycle() -> None:
    graph = import_graph()
    assert {"hvdcomp.optimizer", "hvdcomp.auto", "hvdcomp.compressor"} <= graph.keys()
    assert "hvdcomp.compressor" in graph["hvdcomp.error_feedback"]  # the graph sees imports at all
    assert cycles(graph) == []


def test_the_layers_import_one_way() -> None:
    """The optimizer and the configuration do not reach auto (auto sits above the optimizer); the performance model
    reaches neither the optimizer nor the tools; the interface (compressor) reaches no transport or method."""
    graph = import_graph()
    assert "hvdcomp.auto" not in _reaches(graph, "hvdcomp.optimizer")
    assert "hvdcomp.auto" not in _reaches(graph, "hvdcomp.config")
    for module in (m for m in graph if m.startswith("hvdcomp.perfmodel")):
        reached = _reaches(graph, module)
        assert "hvdcomp.optimizer" not in reached and not any(m.startswith("hvdcomp.tools") for m in reached), module
    below = _reaches(graph, "hvdcomp.compressor")
    assert not below & {"hvdcomp.collectives", "hvdcomp.reductions", "hvdcomp.optimizer", "hvdcomp.methods"}, below
