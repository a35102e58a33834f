"""What ``kvref watch`` draws: a running vLLM's prefix cache, from its KV events.

No vLLM counterpart. ``render_watch`` gives one frame for ``rich.live.Live``
(or a plain print when not in a terminal): where the watcher listens and what
has arrived, each KV cache group's cached blocks, every query's hit as it
stands now (a bar of the prompt, the hit part filled), and the last events::

    Console().print(render_watch(watcher, [Query("system prompt", tokens)]))
"""

from __future__ import annotations

from typing import NamedTuple

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvref.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvref.watch import Watcher

BAR = 24


class Query(NamedTuple):
    name: str
    tokens: list[int]


def hit_bar(hit: int, total: int, width: int = BAR) -> Text:
    """``█████░░░░░``: the share of the prompt served from the cache."""
    filled = 0 if total == 0 else round(width * hit / total)
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="dim")


def describe_event(event) -> str:
    if isinstance(event, BlockStored):
        sparse = len(event.token_ids) != event.block_size * len(event.block_hashes)
        first = event.token_ids[:4]
        return (f"stored {len(event.block_hashes)} block(s) in group {event.group_idx}, "
                f"tokens {first}{'...' if len(event.token_ids) > 4 else ''}"
                f"{' (sparse)' if sparse else ''}")
    if isinstance(event, BlockRemoved):
        return f"removed {len(event.block_hashes)} block(s) from group {event.group_idx}"
    if isinstance(event, AllBlocksCleared):
        return "prefix cache reset: everything cleared"
    return type(event).__name__


def render_watch(watcher: Watcher, queries: list[Query]) -> Group:
    status = watcher.status()
    verb = "bound at" if status["bound"] else "connected to"
    head = Text.assemble(("kvref watch ", "bold"), f"{verb} {status['endpoint']}: ",
                         (f"{status['batches']} batches", "bold"))
    if status["batches"]:
        counts = status["events"]
        head.append(f" (seq {status['first_seq']}..{status['next_seq'] - 1}); "
                    f"{counts.get('BlockStored', 0)} stored, "
                    f"{counts.get('BlockRemoved', 0)} removed, "
                    f"{counts.get('AllBlocksCleared', 0)} resets")
    else:
        head.append(" (waiting for vLLM's first KV events)", style="dim")
    lines = [head]
    if status["missed_batches"]:
        lines.append(Text(f"{status['missed_batches']} batches were never received (joined "
                          "late or dropped): blocks they stored are not in the index; "
                          "--replay ENDPOINT fetches them from vLLM", style="yellow"))
    groups = Table(title="KV cache groups", title_justify="left", box=None, pad_edge=False)
    for column in ("group", "kind", "block size", "cached blocks"):
        groups.add_column(column, justify="right" if column != "kind" else "left")
    for g in status["groups"]:
        groups.add_row(str(g["group"]), str(g["kind"]), str(g["block_size"]),
                       str(g["cached_blocks"]))
    lines.append(groups)
    if queries:
        table = Table(title="would it hit? (a new request with this prompt, now)",
                      title_justify="left", box=None, pad_edge=False)
        for column in ("query", "tokens", "hit", "", "note"):
            table.add_column(column)
        for q in queries:
            answer = watcher.index.query(q.tokens)
            table.add_row(q.name, str(answer.num_tokens), str(answer.hit_tokens),
                          hit_bar(answer.hit_tokens, answer.num_tokens), answer.note)
        lines.append(table)
    if watcher.recent:
        recent = Text("last events:\n", style="bold")
        for seq, event in watcher.recent:
            recent.append(f"  #{seq} {describe_event(event)}\n")
        lines.append(recent)
    return Group(*lines)
