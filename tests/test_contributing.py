"""The contributor checklists (``docs/contributing.md``) name files and names that exist.

Each step of a checklist names its file, then the classes, functions and
fields to touch there: within one step (a numbered item or a bullet, with
its continuation lines), a backquoted path (``kvref/...py``, ``tests/...``,
``specs/...md``) sets the file, and each backquoted name after it must be
defined in that file (a class, a function, a method, a module-level or
class-level assignment) until the next path. Code moves; this test says which
step went stale.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "contributing.md"
TOKEN = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^(kvref|tests|tools|specs|docs|benchmarks|tutorials)(/[\w.<>-]*)*/?$")
NAME = re.compile(r"^[A-Za-z_]\w*$")
STEP_START = re.compile(r"^\s*(\d+\.|-|#)|^\s*$")


@functools.cache
def defined_names(path: pathlib.Path) -> frozenset[str]:
    """Every name a module defines, at any depth: defs, classes, assignments."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def stale_references(text: str, root: pathlib.Path) -> list[str]:
    """``line: what`` for each path that does not exist and each name its file lacks."""
    stale = []
    current: pathlib.Path | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if STEP_START.match(line):
            current = None
        for token in TOKEN.findall(line):
            if PATH.match(token):
                if "<" in token:            # a placeholder path ("traces/<class>/")
                    current = None
                    continue
                current = root / token
                if not current.exists():
                    stale.append(f"{number}: {token} does not exist")
                    current = None
            elif current is not None and current.suffix == ".py" and NAME.match(token):
                if token not in defined_names(current):
                    stale.append(f"{number}: {current.relative_to(root)} defines no {token}")
    return stale


def test_the_checker_finds_a_missing_file_and_a_missing_name():
    text = ("1. `kvref/core/block_pool.py`: `BlockPool`, `get_new_blocks`, `no_such_thing`\n"
            "   and on the next line `free_blocks`, `not_here_either`\n"
            "2. `kvref/core/no_such_module.py`: `BlockPool`\n"
            "3. `specs/block_pool.md`, `kvref/kv_cache_interface.py` (`FullAttentionSpec`)\n"
            "4. a new step forgets the file: `not_checked`\n")
    assert stale_references(text, ROOT) == [
        "1: kvref/core/block_pool.py defines no no_such_thing",
        "2: kvref/core/block_pool.py defines no not_here_either",
        "3: kvref/core/no_such_module.py does not exist"]


def test_every_file_and_name_on_the_contributing_page_exists():
    text = PAGE.read_text(encoding="utf-8")
    for heading in ("## Adding an attention type", "## Adding a KV connector",
                    "## Adding an eviction rule"):
        assert heading in text
    assert stale_references(text, ROOT) == []


def test_the_readme_links_the_contributing_page():
    assert "(docs/contributing.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
