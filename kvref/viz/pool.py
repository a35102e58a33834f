"""The block pool and its free queue, drawn for a terminal (``rich``).

No vLLM counterpart: a picture of ``vllm/v1/core/block_pool.py``'s state.
Every block is in one of five states::

    ∅  the null block (block 0, a placeholder for skipped blocks)
    ●  in use, not cached        ◉  in use and cached (others can hit it)
    ○  free but cached: evictable, still hittable until reused
    ·  free and empty

Small pools (``DETAILED_MAX`` blocks) get one cell per block with its id and
ref count (``  7◉2`` = block 7, cached, held by two requests). Larger pools get
one character per block, with the ref count as a digit where blocks are shared.
Pools too large for that are drawn aggregated, one character per run of blocks
(its most common state), and say so; the exact counts are always printed::

    from rich.console import Console
    Console(width=80).print(render_grid(manager.block_pool))
"""

from __future__ import annotations

from collections import Counter

from rich.console import Group
from rich.text import Text

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import KVCacheBlock
from kvref.math_utils import cdiv

NULL, USED, USED_CACHED, FREE_CACHED, FREE = "null", "used", "used_cached", "free_cached", "free"
GLYPH = {NULL: "∅", USED: "●", USED_CACHED: "◉", FREE_CACHED: "○", FREE: "·"}
# Explicit colours: terminal themes (and rich's SVG theme) render named greens as olive.
STYLE = {NULL: "#b57edc", USED: "bold #4aa3ff", USED_CACHED: "bold #3ccf4e",
         FREE_CACHED: "#f0a030", FREE: "#808080"}
DETAILED_MAX = 120          # one labelled cell per block up to here
DETAILED_PER_ROW = 10       # 10 cells of 7 columns: 70 columns
COMPACT_PER_ROW = 64        # plus a 6-column row label: 70 columns
COMPACT_MAX_CELLS = 1024    # 16 rows of 64


def block_state(block: KVCacheBlock) -> str:
    if block.is_null:
        return NULL
    if block.ref_cnt > 0:
        return USED_CACHED if block.block_hash is not None else USED
    return FREE_CACHED if block.block_hash is not None else FREE


def legend() -> Text:
    text = Text()
    for state, words in ((NULL, "null  "), (USED, "in use  "), (USED_CACHED, "in use+cached  "),
                         (FREE_CACHED, "free, cached (evictable)  "), (FREE, "free")):
        text.append(GLYPH[state], style=STYLE[state])
        text.append(" " + words, style="dim")
    return text


def _detailed_cell(block: KVCacheBlock) -> Text:
    state = block_state(block)
    refs = ""
    if state in (USED, USED_CACHED):
        refs = str(block.ref_cnt) if block.ref_cnt < 100 else "+"
    return Text(f"{block.block_id:>3}{GLYPH[state]}{refs:<2}", style=STYLE[state])


def _compact_char(block: KVCacheBlock) -> Text:
    state = block_state(block)
    glyph = GLYPH[state]
    if state in (USED, USED_CACHED) and block.ref_cnt > 1:
        glyph = str(block.ref_cnt) if block.ref_cnt < 10 else "+"
    return Text(glyph, style=STYLE[state])


def state_counts(pool: BlockPool) -> Counter:
    return Counter(block_state(b) for b in pool.blocks)


def render_grid(pool: BlockPool, width: int | None = None, selected: int | None = None,
                highlight: frozenset[int] | set[int] = frozenset()) -> Group:
    """The pool as a grid; its scale is stated whenever a cell is not one block.

    ``width`` (columns, default 80) sets how many cells a row holds, so a wide
    terminal gets wider rows; the ``selected`` block is drawn reversed and the
    ``highlight`` ones underlined (the terminal viewer's selection)."""
    blocks = pool.blocks
    rows: list[Text] = []

    def mark(text: Text, block_id: int) -> Text:
        if block_id == selected:
            text.stylize("reverse")
        elif block_id in highlight:
            text.stylize("underline")
        return text

    if len(blocks) <= DETAILED_MAX:
        per_row = DETAILED_PER_ROW if width is None else max(1, width // 7)
        for start in range(0, len(blocks), per_row):
            row = Text()
            for block in blocks[start:start + per_row]:
                row.append_text(mark(_detailed_cell(block), block.block_id))
                row.append(" ")
            rows.append(row)
        scale = Text(f"{len(blocks)} blocks (block 0 is the null block), one cell each: id, state, "
                     "ref count", style="dim")
        return _with_totals(pool, rows, scale)
    # One character per block (or per run of blocks), in rows of a multiple of 8.
    per_row = COMPACT_PER_ROW if width is None else max(8, (width - 6) // 8 * 8)
    max_cells = COMPACT_MAX_CELLS // COMPACT_PER_ROW * per_row
    if len(blocks) <= max_cells:
        for start in range(0, len(blocks), per_row):
            row = Text(f"{start:>5} ", style="dim")
            for block in blocks[start:start + per_row]:
                row.append_text(mark(_compact_char(block), block.block_id))
            rows.append(row)
        scale = Text(f"{len(blocks)} blocks, one character each (a digit: shared by that "
                     "many requests)", style="dim")
    else:
        per_cell = cdiv(len(blocks), max_cells)
        cells = [blocks[i:i + per_cell] for i in range(0, len(blocks), per_cell)]
        for start in range(0, len(cells), per_row):
            row = Text(f"{start * per_cell:>5} ", style="dim")
            for cell in cells[start:start + per_row]:
                state = Counter(block_state(b) for b in cell).most_common(1)[0][0]
                row.append(GLYPH[state], style=STYLE[state])
            rows.append(row)
        scale = Text(f"{len(blocks)} blocks drawn aggregated: one character = {per_cell} "
                     "blocks (their most common state)", style="bold")
    return _with_totals(pool, rows, scale)


def _with_totals(pool: BlockPool, rows: list[Text], scale: Text) -> Group:
    counts = state_counts(pool)
    totals = Text(f"in use {counts[USED] + counts[USED_CACHED]} "
                  f"(cached {counts[USED_CACHED]})  evictable cached {counts[FREE_CACHED]}  "
                  f"free empty {counts[FREE]}  null {counts[NULL]}")
    return Group(*rows, scale, legend(), totals)


def render_free_queue(pool: BlockPool, head: int = 16, tail: int = 6) -> Text:
    """The free queue from head (allocated, and so evicted, first) to tail.

    Freed blocks without a hash go to the head (nobody can hit them), cached
    ones to the tail, so the least recently used cached block is evicted first.
    Long queues show their two ends and say how many are left out.
    """
    queue = pool.free_block_queue.get_all_free_blocks()
    text = Text("free queue, next evicted first: ", style="bold")
    if not queue:
        return text.append("(empty)")
    shown = queue if len(queue) <= head + tail + 1 else queue[:head] + [None] + queue[-tail:]
    for block in shown:
        if block is None:
            text.append(f"…{len(queue) - head - tail} more… ", style="italic")
            continue
        state = block_state(block)
        text.append(f"{block.block_id}{GLYPH[state]} ", style=STYLE[state])
    cached = sum(1 for b in queue if b.block_hash is not None)
    text.append(f"\n({len(queue)} free: {len(queue) - cached} empty, {cached} cached)", style="dim")
    return text

