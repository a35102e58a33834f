"""Block tables and the prefix tree, drawn for a terminal (``rich``).

No vLLM counterpart: pictures of ``SingleTypeKVCacheManager.req_to_blocks``.

* ``render_block_tables``: each request's block ids per KV cache group, runs
  written short (``3-9`` for blocks 3 to 9, ``∅×4`` for four null blocks).
* ``render_prefix_tree``: the requests' tables of one full-attention group
  merged into a radix tree, so shared prefixes show as shared branches::

      prefix tree (group 0: full, block size 4)
      └── 1-2  ◉ held by A B C
          ├── 3  ◉ A
          └── 5  ● B C
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.request import Request
from kvref.viz.pool import GLYPH, STYLE, block_state

MAX_REQUEST_ROWS = 12


def spec_label(spec: KVCacheSpec) -> str:
    """A short name for a group's attention type."""
    if isinstance(spec, SlidingWindowSpec):
        return f"window {spec.sliding_window}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunk {spec.attention_chunk_size}"
    if isinstance(spec, MambaSpec):
        return f"mamba ({spec.mamba_cache_mode})"
    if isinstance(spec, CrossAttentionSpec):
        return "cross"
    if isinstance(spec, FullAttentionSpec):
        return "full"
    return type(spec).__name__


def compress_ids(ids: Sequence[int]) -> str:
    """``[0, 0, 3, 4, 5, 9]`` -> ``"∅×2 3-5 9"``: runs of nulls and of consecutive ids."""
    parts: list[str] = []
    i = 0
    ids = list(ids)
    while i < len(ids):
        j = i
        if ids[i] == 0:
            while j + 1 < len(ids) and ids[j + 1] == 0:
                j += 1
            parts.append("∅" if j == i else f"∅×{j - i + 1}")
        else:
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            parts.append(str(ids[i]) if j == i else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return " ".join(parts) or "-"


def requests_with_blocks(manager: KVCacheManager) -> list[str]:
    """Ids of requests holding blocks in any group, in the order they first got them."""
    seen: dict[str, None] = {}
    for m in manager.coordinator.single_type_managers:
        for rid, blocks in m.req_to_blocks.items():
            if blocks:
                seen.setdefault(rid, None)
    return list(seen)


def render_block_tables(manager: KVCacheManager, request_ids: Sequence[str] | None = None,
                        requests: dict[str, Request] | None = None) -> Group | Text:
    """One row per request, one column per group. ``requests`` (id -> Request)
    adds each request's computed/total tokens and status."""
    if request_ids is None:
        request_ids = requests_with_blocks(manager)
    if not request_ids:
        return Text("block tables: no request holds blocks", style="dim")
    groups = manager.kv_cache_config.kv_cache_groups
    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("request", no_wrap=True)
    if requests is not None:
        table.add_column("tokens", justify="right", no_wrap=True)
    for i, group in enumerate(groups):
        table.add_column(f"g{i} {spec_label(group.kv_cache_spec)}"
                         f" /{group.kv_cache_spec.block_size}", overflow="fold")
    shown = request_ids[:MAX_REQUEST_ROWS]
    for rid in shown:
        row = [rid]
        if requests is not None:
            req = requests.get(rid)
            row.append("" if req is None else
                       f"{req.num_computed_tokens}/{req.num_tokens} {req.status.name.lower()}")
        row += [compress_ids(ids) for ids in manager.get_block_ids(rid)]
        table.add_row(*row)
    parts = [Text("block tables (block ids per KV cache group, /block size)", style="bold"),
             table]
    if len(request_ids) > len(shown):
        parts.append(Text(f"… and {len(request_ids) - len(shown)} more requests not shown",
                          style="italic"))
    return Group(*parts)


def prefix_group(manager: KVCacheManager) -> int | None:
    """The group the prefix tree is drawn for: the first plain full-attention one."""
    for i, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and type(spec) is FullAttentionSpec:
            return i
    return None


def _build_trie(tables: dict[str, list]) -> dict:
    """Nested ``{block: (holders, children)}`` from request -> block list."""
    root: dict = {}
    for rid, blocks in tables.items():
        node = root
        for block in blocks:
            holders, children = node.setdefault(block.block_id, ([], {}))
            holders.append(rid)
            node = children
    return root


def render_prefix_tree(manager: KVCacheManager, max_nodes: int = 24) -> Tree | Text:
    """The full-attention block tables of all requests as one radix tree.

    A chain of blocks held by the same requests is one node; a branch is where
    requests stop sharing. Only requests that hold blocks appear (free cached
    blocks are in the pool grid and the free queue).
    """
    gid = prefix_group(manager)
    if gid is None:
        return Text("prefix tree: no full-attention group to draw", style="dim")
    block_size = manager.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
    stm = manager.coordinator.single_type_managers[gid]
    tables = {rid: blocks for rid, blocks in stm.req_to_blocks.items() if blocks}
    tree = Tree(Text(f"prefix tree (group {gid}: full, block size {block_size})", style="bold"))
    if not tables:
        tree.add(Text("no request holds blocks", style="dim"))
        return tree
    by_id = {b.block_id: b for blocks in tables.values() for b in blocks}
    count = [0]

    def add(parent: Tree, trie: dict) -> None:
        for block_id, (holders, children) in trie.items():
            if count[0] >= max_nodes:
                parent.add(Text(f"… more branches not shown (over {max_nodes} nodes)",
                                style="italic"))
                return
            run = [block_id]
            # Follow the chain while exactly the same requests go on together.
            while len(children) == 1:
                (next_id, (next_holders, next_children)), = children.items()
                if sorted(next_holders) != sorted(holders):
                    break
                run.append(next_id)
                children = next_children
            states = {block_state(by_id[b]) for b in run}
            state = "used_cached" if states == {"used_cached"} else \
                "used" if "used" in states else sorted(states)[0]
            label = Text(compress_ids(run) + " ", style="bold")
            label.append(GLYPH[state], style=STYLE[state])
            label.append(f" {'shared by ' if len(holders) > 1 else ''}{' '.join(holders)}")
            count[0] += 1
            add(parent.add(label), children)

    add(tree, _build_trie(tables))
    return tree
