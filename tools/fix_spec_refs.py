#!/usr/bin/env python3
"""Rewrite the line numbers of ``file:line`` references in ``specs/`` after code moves.

A reference reads ``` `Class.method` (kvref/path.py:LINE) ```; this script sets
LINE to where ``Class.method`` is defined now. ``tests/test_spec_refs.py``
fails until it is run (or the numbers are fixed by hand).

    python tools/fix_spec_refs.py          # rewrite in place, list what changed
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_spec_refs import REF, definitions  # noqa: E402  (the test owns the format)


def main() -> int:
    changed = 0
    for page in sorted((ROOT / "specs").glob("*.md")):
        text = page.read_text()

        def fix(m):
            nonlocal changed
            line = definitions(m["path"]).get(m["name"])
            if line is None:
                print(f"{page.name}: {m['path']} defines no {m['name']} (left as is)")
                return m[0]
            if line != int(m["line"]):
                changed += 1
                print(f"{page.name}: {m['name']} {m['line']} -> {line}")
            return f"`{m['name']}` ({m['path']}:{line})"

        new = REF.sub(fix, text)
        if new != text:
            page.write_text(new)
    print(f"{changed} reference(s) updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
