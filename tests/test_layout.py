"""The package layout is the map of vLLM: no import cycles, every module says what it mirrors.

A reader opens ``kvref/core/block_pool.py`` next to ``vllm/v1/core/block_pool.py``;
these tests keep that promise true as files move.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "kvref"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """kvref modules ``path`` imports anywhere in its text (function bodies too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvref"):
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in known)
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    return found & known


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first search, as the cycle it closes."""
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_package_import_graph_has_no_cycles():
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # ``from kvref import X`` inside a submodule goes through the package's
    # __init__, which must then not import that submodule back: a real cycle.
    assert import_cycles(graph) == []


def test_core_never_imports_torch():
    core = [p for name, p in _modules().items()
            if not name.startswith(("kvref.worker", "kvref.attention", "kvref.engine",
                                    "kvref.tutorials", "kvref.distributed"))]
    for path in core:
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in names, f"{path} imports torch; the core must stay pure Python"


@pytest.mark.parametrize("name", sorted(n for n in _modules() if n.startswith("kvref.core.")))
def test_core_module_names_the_vllm_file_it_mirrors(name):
    path = _modules()[name]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    expected = "vllm/v1/core/" + path.name
    assert expected in doc, f"{path} should say in its docstring that it mirrors {expected}"
