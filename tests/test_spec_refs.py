"""Every ``file:line`` reference in ``specs/`` still points at the function it names.

The specs cite code as ``` `Name` (kvref/path.py:LINE) ```, e.g.
``KVCacheManager.allocate_slots`` followed by its file and the line of its
``def``. Code moves; this test fails with the right line number when a
reference goes stale, so the walk-throughs cannot rot.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC_PAGES = sorted((ROOT / "specs").glob("*.md"))
REF = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)` \((?P<path>kvref/[\w/]+\.py):(?P<line>\d+)\)")


@functools.cache
def definitions(path: str) -> dict[str, int]:
    """Qualified name (``Class.method``) -> line of its ``def``/``class``."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                found[name] = child.lineno
                walk(child, f"{name}.")

    walk(ast.parse((ROOT / path).read_text()), "")
    return found


def references() -> list[tuple[str, int, str, str, int]]:
    refs = []
    for page in SPEC_PAGES:
        for number, text in enumerate(page.read_text().splitlines(), start=1):
            for m in REF.finditer(text):
                refs.append((page.name, number, m["name"], m["path"], int(m["line"])))
    return refs


REFS = references()


def test_the_walk_through_cites_code():
    pages = {page for page, *_ in REFS}
    assert "allocate_slots_walkthrough.md" in pages, "the walk-through lost its references"


@pytest.mark.parametrize("page, page_line, name, path, line", REFS,
                         ids=[f"{p}:{n}:{name}" for p, n, name, *_ in REFS])
def test_reference_points_at_the_named_definition(page, page_line, name, path, line):
    assert (ROOT / path).exists(), f"specs/{page}:{page_line} cites {path}, which does not exist"
    defs = definitions(path)
    assert name in defs, f"specs/{page}:{page_line}: {path} defines no {name}"
    assert defs[name] == line, (
        f"specs/{page}:{page_line}: `{name}` is at {path}:{defs[name]}, not line {line}")


def test_the_checker_catches_a_stale_line():
    """A reference one line off is reported (the check is not vacuous)."""
    defs = definitions("kvref/core/kv_cache_manager.py")
    line = defs["KVCacheManager.allocate_slots"]
    text = f"`KVCacheManager.allocate_slots` (kvref/core/kv_cache_manager.py:{line + 1})"
    m = REF.search(text)
    assert m and int(m["line"]) != defs[m["name"]]
