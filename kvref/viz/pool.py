"""Pictures of the block pool for a terminal (``rich``).

Not part of vLLM: a teaching aid used by ``kvref demo``. One cell per block::

    [0 ∅] [1 ◉2] [2 ●1] [3 ○] [4 ·] ...
     null  cached, in use  free,   free,
           2 refs  1 ref   cached  empty

followed by the free queue from head (evicted next) to tail, and each
request's block table per group.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvref.core.kv_cache_manager import KVCacheManager

CELLS_PER_ROW = 16


def block_cell(block) -> Text:
    """One block as a short coloured label."""
    if block.is_null:
        return Text(f"{block.block_id:>2} ∅ ", style="dim white")
    if block.ref_cnt > 0:
        cached = block.block_hash is not None
        return Text(f"{block.block_id:>2} {'◉' if cached else '●'}{block.ref_cnt}",
                    style="bold green" if cached else "green")
    if block.block_hash is not None:
        return Text(f"{block.block_id:>2} ○ ", style="yellow")
    return Text(f"{block.block_id:>2} · ", style="dim")


def render_pool(manager: KVCacheManager, request_ids=None) -> Group:
    """The pool, the free queue and the block tables of ``request_ids``
    (default: every request that holds blocks)."""
    pool = manager.block_pool
    grid = Table.grid(padding=(0, 1))
    for _ in range(min(CELLS_PER_ROW, len(pool.blocks))):
        grid.add_column()
    for start in range(0, len(pool.blocks), CELLS_PER_ROW):
        grid.add_row(*[block_cell(b) for b in pool.blocks[start:start + CELLS_PER_ROW]])

    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    queue_line = Text("free queue (next evicted first): ", style="bold")
    queue_line.append(" ".join(map(str, queue)) or "(empty)")
    legend = Text("∅ null   ●n in use, n refs   ◉n in use and cached   ○ free, cached   · free",
                  style="dim")

    tables = Table(show_header=True, header_style="bold", box=None)
    tables.add_column("request")
    for i, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        tables.add_column(f"group {i}: {type(group.kv_cache_spec).__name__}")
    if request_ids is None:
        request_ids = sorted({rid for m in manager.coordinator.single_type_managers
                              for rid, blocks in m.req_to_blocks.items() if blocks})
    for rid in request_ids:
        tables.add_row(rid, *[str(ids) for ids in manager.get_block_ids(rid)])

    usage = Text(f"usage {manager.usage:.0%}   free blocks {pool.get_num_free_blocks()}"
                 f" of {pool.num_gpu_blocks - 1}")
    return Group(grid, legend, queue_line, usage, tables)
