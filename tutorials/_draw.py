"""The lessons' pictures: pools, block tables and slots drawn with rich.

No vLLM counterpart: a teaching aid. Each function draws one thing the
lessons look at; none of them changes what it draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from rich.table import Table
from rich.text import Text

from kvref import generate_block_hash_extra_keys

REQUEST_COLOURS = ["green", "cyan", "magenta", "yellow", "blue"]


def table_row(block_ids: Sequence[int]) -> str:
    """A block table as text, the null block as ``∅``: ``∅ ∅ 7 8``."""
    return " ".join("∅" if b == 0 else str(b) for b in block_ids)


def slot_picture(kv_cache: torch.Tensor, owner: dict[int, str], block_size: int) -> Text:
    """One line per block of ``kv_cache`` ``[blocks, 2, block_size, H, D]``: a
    cell per slot, the request letter where a key was written (``owner``:
    slot -> letter), ``·`` where the slot still holds NaN (lesson 04)."""
    text = Text()
    written = ~torch.isnan(kv_cache[:, 0]).any(dim=-1).any(dim=-1)     # [blocks, slots]
    for b in range(kv_cache.shape[0]):
        text.append(f"block {b}: ")
        for s in range(kv_cache.shape[2]):
            who = owner.get(b * block_size + s, "?") if written[b, s] else "·"
            text.append(f" {who}", style={"a": "green", "b": "cyan"}.get(who, "dim"))
        text.append("\n")
    return text


def window_timeline(rows: list[tuple], title: str) -> Table:
    """Lesson 06's decode runs: per step, the last position, the block table and
    the real blocks it holds (``rows``: ``(last, table, ...)``)."""
    table = Table("last position", "block table (∅ = null block)", "real blocks held",
                  title=title, title_justify="left")
    for last, ids, *_ in rows:
        table.add_row(str(last), table_row(ids), str(sum(b != 0 for b in ids)))
    return table


def pool_row(llm) -> Text:
    """An engine's pool as one line: each block shows the request holding it
    (its id), ``○`` free but cached, ``·`` free and empty (the null block left
    out). ``llm``: a ``kvref.engine.LLM`` (lesson 09)."""
    manager = llm.kv_cache_manager
    owner = {b.block_id: rid for rid in llm.scheduler.requests
             for b in manager.get_blocks(rid).blocks[0]}
    row = Text()
    for block in manager.block_pool.blocks[1:]:
        if block.block_id in owner:
            rid = owner[block.block_id]
            row.append(rid, style=f"bold {REQUEST_COLOURS[int(rid) % len(REQUEST_COLOURS)]}")
        else:
            row.append("○" if block.block_hash is not None else "·", style="dim")
    return row


def step_timeline(llm, pictures: list[Text]) -> Table:
    """Per engine step: the tokens scheduled, who was admitted, preempted,
    resumed or finished, the free blocks, and the pool drawn after the step."""
    table = Table("step", "scheduled tokens", "what happened", "free after\nscheduling",
                  "the pool after the step",
                  box=None, header_style="bold")
    for record, picture in zip(llm.scheduler.step_records, pictures):
        happened = [f"admit {r}" for r in record.admitted] + \
            [f"PREEMPT {r}" for r in record.preempted] + \
            [f"resume {r} (hit {record.prefix_hit_tokens[r]})" for r in record.resumed] + \
            [f"finish {r}" for r in record.finished]
        table.add_row(str(record.step), str(record.num_scheduled_tokens), ", ".join(happened),
                      str(record.num_free_blocks), picture)
    return table


def hash_table(req, title: str, block_size: int) -> Table:
    """One row per full block of ``req`` (a ``kvref.Request``): its tokens, the
    extra keys mixed into its hash, and the start of the hash (lesson 02)."""
    table = Table(title=title, title_justify="left")
    for column in ("block", "tokens", "extra keys", "hash"):
        table.add_column(column)
    mm_idx = 0
    for i, block_hash in enumerate(req.block_hashes):
        start_tok = i * block_size
        keys, mm_idx = generate_block_hash_extra_keys(req, start_tok, start_tok + block_size,
                                                      mm_idx)
        table.add_row(str(i), str(list(req.all_token_ids[start_tok:start_tok + block_size])),
                      str(keys), block_hash.hex()[:12])
    return table
