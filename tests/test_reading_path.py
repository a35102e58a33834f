"""The README's "Read first" path names files that exist and code that is in them.

Each numbered item links one or more files; every name in backticks that looks
like code (``allocate_slots``, ``FreeKVCacheBlockQueue``,
``HybridKVCacheCoordinator.find_longest_cache_hit``) must be defined (``def`` or
``class``) in one of the item's linked Python files, so the path cannot send a
reader to something that moved or was renamed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def items() -> list[str]:
    section = README.split("## Read first", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d+\. )", section.strip())[1:]


def test_the_path_has_its_items_in_order():
    numbers = [int(item.split(".", 1)[0]) for item in items()]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7


def test_every_link_exists_and_every_name_is_defined_where_the_item_points():
    for item in items():
        links = re.findall(r"\]\(([^)#]+)\)", item)
        assert links, item
        for link in links:
            assert (ROOT / link).exists(), f"{link} (README's reading path) does not exist"
        sources = "\n".join((ROOT / link).read_text(encoding="utf-8") for link in links
                            if link.endswith(".py"))
        if not sources:                          # a page to read, not code
            continue
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)`", item):
            if "/" in name or name.endswith((".py", ".md")):
                continue
            last = name.split(".")[-1]
            assert re.search(rf"^\s*(?:def|class) {re.escape(last)}\b", sources, re.M), (
                f"README's reading path names `{name}`, which none of {links} defines")
            if "." in name:                      # Class.method: the class is there too
                assert re.search(rf"^class {re.escape(name.split('.')[0])}\b", sources, re.M)
