"""The README is the front door: short, linking every page under docs/, and no
relative link of the README or of a docs page leads nowhere.

No vLLM counterpart. The README keeps what kvref is, the two set-up commands,
the three layers and the map of the tree; everything else lives on
``docs/*.md`` pages (their commands run in ``tests/test_readme_commands.py``).
A link ``page.md#anchor`` must name a heading of that page, slugged as GitHub
slugs headings (lower case, punctuation dropped, spaces to hyphens, ``-1``,
``-2`` for repeats).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 15_000
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+).*?\1")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """Every link target of the page's prose (code spans and blocks left out)."""
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        targets += LINK.findall(INLINE_CODE.sub("", line))
    return targets


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in "
                          f"{file_part or 'this page'})")
    return broken


def test_the_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move a section to a "
        "page under docs/ and link it from 'Where to go next'")


def test_the_readme_links_every_docs_page():
    assert len(DOCS) >= 9, [p.name for p in DOCS]
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    unlinked = [p.relative_to(ROOT).as_posix() for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link these docs pages: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_somewhere(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT).as_posix()}: broken links: {broken}"


def test_the_link_check_is_not_blind(tmp_path):
    """A missing file, a missing heading and a link hidden in code are told apart."""
    (tmp_path / "other.md").write_text("# Other page\n\n## vLLM's own tests, on kvref\n",
                                       encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## A heading\n\nSee [x](other.md#vllms-own-tests-on-kvref), "
                    "[y](#a-heading), [z](https://example.org/nope) and `[c](nowhere.md)`.\n"
                    "```text\n[d](nowhere-either.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == []
    page.write_text("[a](missing.md) [b](other.md#no-such-heading) [c](#nope) "
                    "![d](pic.png)\n", encoding="utf-8")
    assert [b.split(" ")[0] for b in broken_links(page)] == [
        "missing.md", "other.md#no-such-heading", "#nope", "pic.png"]
