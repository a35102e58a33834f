"""What happened: one line per op, the step's events, figures over time.

No vLLM counterpart. Text panels for a ``TracePlayer`` position:

* ``describe_op``: an op and its answer in words
  (``r2 looks up the cache: 8 of 13 tokens hit (blocks 1-2)``);
* ``render_events``: the ``take_events`` answers of the current step;
* ``render_stats``: usage, evictable cached blocks and hit rate per step as
  sparklines (``▁▃▅█``), with the current value;
* ``render_frame``: everything for one position, within 80 columns;
* ``render_pool``: grid, free queue and block tables of any live manager;
* ``render_summary``: the totals ``kvref demo`` ends with.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.stats import HIT_RATE, PREEMPTED_APART, RETRIES_ARE_QUERIES, SERVED_ONCE
from kvref.viz.player import OpFacts, TracePlayer, TraceSummary
from kvref.viz.pool import render_free_queue, render_grid
from kvref.viz.tables import compress_ids, render_block_tables, render_prefix_tree

SPARK = "▁▂▃▄▅▆▇█"
# Scheduler bookkeeping and read-only queries: listed only in verbose mode.
BOOKKEEPING = {"set_num_computed_tokens", "set_status", "set_num_preemptions",
               "append_output_token_ids", "new_step_starts",
               # read-only queries
               "get_block_ids", "get_block_ids_for_computed_tokens", "usage",
               "num_free_blocks", "get_num_common_prefix_blocks", "make_prefix_cache_stats"}


def _blocks(ret: object) -> str:
    return " | ".join(compress_ids(g) for g in ret)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "block")`` -> ``"1 block"``, ``plural(7, "block")`` -> ``"7 blocks"``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _tokens_asked(op: dict) -> str:
    """What an ``allocate_slots`` call asked room for, every part named."""
    parts = [plural(op["num_new_tokens"], "new token")]
    for key, words in (("num_new_computed_tokens", "hit"),
                       ("num_external_computed_tokens", "loaded externally"),
                       ("num_lookahead_tokens", "lookahead")):
        if op.get(key):
            parts.append(f"{op[key]} {words}")
    return " + ".join(parts)


# What the viewer's header says the last op run was, in a reader's words.
OP_WORDS = {
    "add_request": "{req} arrives", "get_computed_blocks": "{req} looks up the prefix cache",
    "allocate_slots": "{req} asks for slots", "free": "{req}'s blocks are freed",
    "take_events": "KV events are taken", "reset_prefix_cache": "the prefix cache is reset",
    "evict_blocks": "blocks are evicted", "new_step_starts": "a new step begins",
    "make_prefix_cache_stats": "the hit counters are read",
    "append_output_token_ids": "{req} samples tokens",
    "cache_blocks": "{req}'s full blocks are cached",
    "remove_skipped_blocks": "{req} drops blocks it no longer needs",
    "get_num_common_prefix_blocks": "the shared leading blocks are counted",
    "usage": "the pool's usage is read",
}


def op_words(op: dict) -> str:
    """``{"op": "add_request", "req": "c0"}`` -> ``"c0 arrives"``; a call with no words
    of its own is scheduler bookkeeping."""
    words = OP_WORDS.get(op["op"])
    if words is None:
        return f"{op['req']}: scheduler bookkeeping" if op.get("req") else "scheduler bookkeeping"
    return words.format(req=op.get("req") or "a request")


def describe_op(facts: OpFacts) -> str:
    """One op and what it did, in words."""
    op, obs = facts.op, facts.observed
    name, rid = op["op"], op.get("req")
    ret = obs.get("ret")
    if "raises" in obs:
        return f"{name}({rid or ''}) raised {obs['raises']}"
    if name == "add_request":
        return f"{rid} arrives with {len(op['prompt'])} prompt tokens"
    if name == "get_computed_blocks":
        hit = f" (blocks {_blocks(ret['blocks'])})" if facts.hit_tokens else ""
        return (f"{rid} looks up the prefix cache: {facts.hit_tokens} of "
                f"{facts.query_tokens} tokens hit{hit}")
    if name == "allocate_slots":
        if ret is None:
            return f"{rid}: no room for {_tokens_asked(op)} (allocate_slots → None)"
        n = op["num_new_tokens"]
        text = f"{rid} schedules {plural(n, 'token')}"
        if op.get("num_external_computed_tokens"):
            text += f" (+ {op['num_external_computed_tokens']} loaded externally)"
        new = sum(len(g) for g in ret)
        text += (f", new {'block' if new == 1 else 'blocks'} {_blocks(ret)}" if new
                 else ", no new block")
        if facts.evicted:
            text += f"; evicts cached {compress_ids(facts.evicted)}"
        return text
    if name == "free":
        if facts.is_preemption:
            return f"{rid} is preempted: its blocks go back to the pool"
        return f"{rid} finishes ({(facts.freed_status or '?').lower()}): blocks freed"
    if name == "take_events":
        kinds = {}
        for ev in ret or []:
            kinds[ev["type"]] = kinds.get(ev["type"], 0) + 1
        return "events: " + (", ".join(f"{n} {k}" for k, n in kinds.items()) or "none")
    if name == "reset_prefix_cache":
        return (f"reset_prefix_cache → {ret}"
                + (f": {plural(len(facts.uncached), 'cached block')} forgotten" if ret else
                   " (refused: blocks are in use)"))
    if name == "evict_blocks":
        return f"evict_blocks {compress_ids(op['block_ids'])}: uncached {compress_ids(facts.uncached)}"
    if name == "append_output_token_ids":
        return f"{rid} samples {plural(len(op['tokens']), 'token')}"
    if name in ("set_num_computed_tokens", "set_status", "set_num_preemptions"):
        return f"{rid}.{name[4:]} = {op['value']}"
    if name == "make_prefix_cache_stats" and ret is not None:
        return (f"prefix-cache stats: {ret['requests']} lookups, {ret['hits']} of "
                f"{ret['queries']} tokens hit; after preemption {ret['preempted_hits']} of "
                f"{ret['preempted_queries']}")
    if name == "usage":
        return f"usage = {ret:.0%}"
    args = " ".join(f"{k}={v}" for k, v in op.items() if k not in ("op", "expect", "tag"))
    return f"{name} {args}".strip() + ("" if ret is None else f" → {ret}")


def render_step_ops(facts: list[OpFacts], verbose: bool = False, limit: int = 14) -> Text:
    lines = [f for f in facts if verbose or f.op["op"] not in BOOKKEEPING]
    text = Text()
    for f in lines[:limit]:
        text.append(f"#{f.index:<4}", style="dim")
        text.append(describe_op(f) + "\n")
    if len(lines) > limit:
        text.append(f"… {len(lines) - limit} more ops in this step\n", style="italic")
    if not lines:
        text.append("(only scheduler bookkeeping in this step)\n", style="dim")
    return text


def event_line(ev: dict) -> str:
    """One KV event of a trace (its JSON form) as one line of text."""
    kind = ev["type"]
    if kind == "BlockStored":
        return (f"stored  g{ev['group_idx']} {plural(len(ev['block_hashes']), 'block')}, "
                f"{plural(len(ev['token_ids']), 'token')}, {ev['kv_cache_spec_kind']}")
    if kind == "BlockRemoved":
        return f"removed g{ev['group_idx']} {plural(len(ev['block_hashes']), 'block')}"
    return "all blocks cleared"


def render_events(facts: list[OpFacts], limit: int = 8) -> Text:
    """The KV cache events the step's ``take_events`` ops returned."""
    events = [ev for f in facts if f.op["op"] == "take_events" for ev in f.observed.get("ret") or []]
    text = Text("events this step: ", style="bold")
    if not events:
        return text.append("none" if any(f.op["op"] == "take_events" for f in facts)
                           else "not taken this step", style="dim")
    text.append(f"{len(events)}\n")
    for ev in events[:limit]:
        text.append("  " + event_line(ev) + "\n")
    if len(events) > limit:
        text.append(f"  … {len(events) - limit} more events\n", style="italic")
    return text


def sparkline(values: list[float], top: float | None = None, width: int = 48) -> str:
    values = values[-width:]
    top = max(values, default=0) if top is None else top
    if not values:
        return ""
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def render_stats(player: TracePlayer) -> Text:
    """Usage, evictable cached blocks and the running hit rate, one sparkline each."""
    history = player.history
    text = Text("over time (one mark per step, last 48)\n", style="bold")
    if not history:
        return text.append("no step has finished yet", style="dim")
    size = player.manager.block_pool.num_gpu_blocks - 1
    rows = (("usage     ", [h.usage for h in history], 1.0, f"{history[-1].usage:.0%}"),
            ("evictable ", [h.evictable_cached for h in history], size,
             plural(history[-1].evictable_cached, "block")),
            ("hit rate  ", [h.hit_rate for h in history], 1.0,     # vLLM's (kvref.stats)
             f"{history[-1].hit_rate:.0%} ({history[-1].hits}/{history[-1].queries} tokens)"))
    for label, values, top, now in rows:
        text.append(label)
        text.append(sparkline(values, top), style="cyan")
        text.append(f" {now}\n")
    return text


def frame_title(player: TracePlayer) -> str:
    name = player.trace.get("name", "trace")
    return (f"{name}: step {player.current_step}/{len(player.steps) - 1}, "
            f"op {player.position - 1}/{len(player.ops) - 1}")


def render_frame(player: TracePlayer, verbose: bool = False, compact: bool = False) -> Group:
    """Everything about the player's position, fitting 80 columns
    (``compact``: without the events panel, for the animated demo)."""
    parts = [Rule(frame_title(player))]
    story = player.narration.get(player.current_step)
    if story:
        parts.append(Text(story, style="italic"))
    facts = player.step_facts()
    parts += [render_step_ops(facts, verbose), render_grid(player.manager.block_pool),
              render_free_queue(player.manager.block_pool),
              render_block_tables(player.manager, requests=player.requests),
              render_prefix_tree(player.manager)]
    if not compact:
        parts.append(render_events(facts))
    parts.append(render_stats(player))
    return Group(*parts)


def render_pool(manager: KVCacheManager, request_ids: Sequence[str] | None = None) -> Group:
    """The grid, the free queue, usage and the block tables of a live manager."""
    pool = manager.block_pool
    usage = Text(f"usage {manager.usage:.0%}   free blocks {pool.get_num_free_blocks()} "
                 f"of {pool.num_gpu_blocks - 1} (the pool's {pool.num_gpu_blocks} blocks "
                 "less the null block)")
    return Group(render_grid(pool), render_free_queue(pool), usage,
                 render_block_tables(manager, request_ids))


def render_summary(summary: TraceSummary, title: str = "summary") -> Table:
    """The totals; where two of them differ by definition, the table says why."""
    table = Table(title=title, title_justify="left", show_header=False,
                  caption_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("steps / ops / requests",
                  f"{summary.num_steps} / {summary.num_ops} / {summary.num_requests}")
    table.add_row(f"{HIT_RATE} (hits / queries)",
                  f"{summary.hit_rate:.1%} ({summary.hits} of {summary.queries} tokens)")
    if summary.preempted_queries:
        table.add_row(PREEMPTED_APART, f"{summary.preempted_hits} of "
                      f"{summary.preempted_queries} tokens")
    table.add_row(SERVED_ONCE, f"{summary.served_once_ratio:.1%} ({summary.served_once} of "
                  f"{summary.prompt_tokens} prompt tokens)")
    table.add_row("cached blocks evicted", str(summary.evictions))
    table.add_row("preemptions", str(summary.preemptions))
    notes = [f"Frames number steps 0-{summary.num_steps - 1} and ops "
             f"0-{summary.num_ops - 1}."]
    if summary.queries + summary.preempted_queries != summary.prompt_tokens:
        notes.append(f"vLLM counts a query each time the scheduler looks a request up: "
                     "again each step a request waits for room, and again after a "
                     f"preemption ({PREEMPTED_APART}: {RETRIES_ARE_QUERIES}); "
                     f"{SERVED_ONCE} counts each request's first admission only.")
    table.caption = " ".join(notes)
    return table
