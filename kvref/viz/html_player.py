"""The whole trace in one self-contained HTML page (``kvref viz TRACE --export player.html``).

No vLLM counterpart. The page plays a ``kvtrace/1`` trace op by op in a
browser or inline in a Jupyter notebook: a step and an op slider, the keys of
the terminal viewer, the pool grid coloured by state or by request, block
tables, free queue, prefix tree, the step's ops and events, usage and hit-rate
plots over time, and the details of the block under the mouse. It needs no
network: the script, the styles and the data are inline, the fonts are the
system's monospace.

Every state the page shows was read in Python from a real replay
(``TracePlayer``) after each op, and stored as the change from the op before
(``player_data``): the blocks the op touched, the free queue as
removed / put at the head / put at the tail, the requests whose table or
tokens changed. The script rebuilds the state of any op from a key frame
every ``KEYFRAME`` ops, so a 1,000-op trace stays a few hundred kB and any
op is a few dozen small deltas away::

    write_player(trace, "player.html")
    Player(trace)          # in a notebook: the same page, inline
"""

from __future__ import annotations

import html
import json
from importlib import resources

from kvref.core.kv_cache_utils import KVCacheBlock
from kvref.viz.panels import BOOKKEEPING, describe_op, event_line
from kvref.viz.player import TracePlayer
from kvref.viz.pool import GLYPH, STYLE, block_state
from kvref.viz.tables import prefix_group, spec_label

KEYFRAME = 64       # the page keeps a full state every this many ops
HASH_CHARS = 16     # hex digits of a hash shown (as the terminal's details)

# The legend's words, as the terminal's (kvref.viz.pool.legend).
LEGEND = [("null", "null"), ("used", "in use"), ("used_cached", "in use+cached"),
          ("free_cached", "free, cached (evictable)"), ("free", "free")]


def _colour(style: str) -> str:
    return next(word for word in style.split() if word.startswith("#"))


class _Hashes:
    """Hash hex strings interned into one list; blocks refer to them by index."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.values: list[str] = []

    def __call__(self, hex_hash: str | None) -> int:
        if hex_hash is None:
            return -1
        short = hex_hash[:HASH_CHARS]
        if short not in self.index:
            self.index[short] = len(self.values)
            self.values.append(short)
        return self.index[short]


def _block_record(player: TracePlayer, block: KVCacheBlock, hashes: _Hashes) -> list:
    """[ref count, hash index, parent index, group] (-1: none). The null block's
    ref count is not kept (vLLM does not keep it either): 0."""
    key = block.block_hash
    if block.is_null:
        return [0, -1, -1, -1]
    if key is None:
        return [block.ref_cnt, -1, -1, -1]
    from kvref.core.kv_cache_utils import get_block_hash, get_group_id

    return [block.ref_cnt, hashes(get_block_hash(key).hex()),
            hashes(player.parents.get(block.block_id)), get_group_id(key)]


def _request_record(player: TracePlayer, rid: str) -> list:
    """[status, computed tokens, tokens, block hashes, block ids per group]."""
    req = player.requests[rid]
    return [req.status.name, req.num_computed_tokens, req.num_tokens, len(req.block_hashes),
            [list(ids) for ids in player.manager.get_block_ids(rid)]]


def queue_delta(old: list[int], new: list[int]) -> dict:
    """How the free queue went from ``old`` to ``new``: ``{"rm", "h", "t"}`` (removed
    blocks, then blocks put at the head and at the tail), or ``{"all": new}``."""
    if old == new:
        return {}
    gone = set(old) - set(new)
    kept = [b for b in old if b not in gone]
    for start in range(len(new) - len(kept) + 1):
        if new[start:start + len(kept)] == kept:
            delta = {"rm": [b for b in old if b in gone], "h": new[:start],
                     "t": new[start + len(kept):]}
            if sum(map(len, delta.values())) < len(new):
                return {k: v for k, v in delta.items() if v}
            break
    return {"all": list(new)}


def apply_queue_delta(old: list[int], delta: dict) -> list[int]:
    """The inverse of ``queue_delta`` (what the page's script does)."""
    if "all" in delta:
        return list(delta["all"])
    gone = set(delta.get("rm", ()))
    return list(delta.get("h", [])) + [b for b in old if b not in gone] + list(delta.get("t", []))


def player_data(trace: dict) -> dict:
    """Everything the page shows, for every op, read from a replay of ``trace``."""
    player = TracePlayer(trace)
    manager = player.manager
    pool = manager.block_pool
    hashes = _Hashes()
    groups = manager.kv_cache_config.kv_cache_groups
    blocks = [_block_record(player, b, hashes) for b in pool.blocks]
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    initial = {"blocks": [list(b) for b in blocks], "queue": list(queue)}
    requests: dict[str, list] = {}
    frames, usage, evictable, hits, queries, ops = [], [], [], [], [], []
    for k, op in enumerate(player.ops):
        player.seek(k + 1)
        facts = player.facts[k]
        frame: dict = {}
        changed = []
        for block_id in facts.touched:
            record = _block_record(player, pool.blocks[block_id], hashes)
            if record != blocks[block_id]:
                blocks[block_id] = record
                changed.append([block_id, *record])
        if changed:
            frame["b"] = changed
        new_queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        delta = queue_delta(queue, new_queue)
        if delta:
            frame["q"] = delta
        queue = new_queue
        rid = op.get("req")
        candidates = [rid] if rid in player.requests else list(player.requests)
        updates = {}
        for r in candidates:
            record = _request_record(player, r)
            if requests.get(r) != record:
                requests[r] = record
                updates[r] = record
        if updates:
            frame["r"] = updates
        if op["op"] == "take_events" and facts.observed.get("ret"):
            frame["e"] = [event_line(ev) for ev in facts.observed["ret"]]
        frames.append(frame)
        usage.append(round(pool.get_usage(), 4))
        evictable.append(sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                             if b.block_hash is not None))
        hits.append(player._hits)
        queries.append(player._queries)
        text = describe_op(facts)
        ops.append([op["op"], rid or "", text, 1 if op["op"] in BOOKKEEPING else 0])
    return {
        "format": "kvref-player/1",
        "name": trace.get("name", "trace"),
        "description": (trace.get("generator") or {}).get("description", ""),
        "num_blocks": len(pool.blocks),
        "groups": [f"g{i} {spec_label(g.kv_cache_spec)} /{g.kv_cache_spec.block_size}"
                   for i, g in enumerate(groups)],
        "prefix_group": prefix_group(manager),
        "steps": [list(s) for s in player.steps],
        "narration": {str(k): v for k, v in player.narration.items()},
        "ops": ops,
        "initial": initial,
        "frames": frames,
        "keyframe": KEYFRAME,
        "hashes": hashes.values,
        "usage": usage, "evictable": evictable, "hits": hits, "queries": queries,
        "touches": {str(b): ops_ for b, ops_ in sorted(player.touches.items())},
        "kv_events": ({str(b): [list(e) for e in events]
                       for b, events in sorted(player.kv_events.items())}
                      if pool.enable_kv_cache_events else None),
        "legend": [[state, GLYPH[state], _colour(STYLE[state]), words]
                   for state, words in LEGEND],
    }


def _asset(name: str) -> str:
    return resources.files("kvref.viz").joinpath("assets", name).read_text(encoding="utf-8")


def render_html(trace: dict, start_op: int | None = None, data: dict | None = None) -> str:
    """The page, as a string. ``start_op``: where it opens (default: the end of step 0);
    ``data``: ``player_data(trace)`` if already made."""
    data = dict(player_data(trace) if data is None else data)
    if start_op is None:
        start_op = data["steps"][0][1] - 1 if data["steps"] else 0
    if data["ops"] and not 0 <= start_op < len(data["ops"]):
        raise IndexError(f"op {start_op} out of range 0..{len(data['ops']) - 1}")
    data["start"] = start_op
    payload = json.dumps(data, separators=(",", ":"))
    # Inside <script> only "</" could end the element early.
    payload = payload.replace("</", "<\\/")
    colours = "\n".join(f"  --{state}: {colour};" for state, _, colour, _ in data["legend"])
    # The data goes in last, so nothing in it is taken for a placeholder.
    return (_asset("player.html")
            .replace("@TITLE@", html.escape(f"kvref player: {data['name']}"))
            .replace("/*COLOURS*/", colours)
            .replace("/*CSS*/", _asset("player.css"))
            .replace("/*JS*/", _asset("player.js"))
            .replace("/*DATA*/", payload))


def write_player(trace: dict, path: str, start_op: int | None = None) -> int:
    """Write the page to ``path``; return its size in bytes."""
    text = render_html(trace, start_op)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return len(text.encode("utf-8"))


class Player:
    """The page inline in a Jupyter notebook (an ``iframe`` with the page as ``srcdoc``,
    so its script and styles cannot clash with the notebook's)::

        from kvref.viz.html_player import Player
        Player(record_workload("pressure"))          # the last line of a cell
    """

    def __init__(self, trace: dict, start_op: int | None = None, height: int = 860) -> None:
        self.data = player_data(trace)          # what the page shows, op by op
        self.html = render_html(trace, start_op, self.data)
        self.height = height

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:0" '
                'sandbox="allow-scripts" title="kvref player"></iframe>')

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
