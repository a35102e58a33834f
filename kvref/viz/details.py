"""What one block or one request is, read from a replayed manager's real state.

No vLLM counterpart. The terminal viewer's details panel, the HTML player's
hover cards and their tests all read a ``TracePlayer`` position through these
two functions, so what a picture says about a block is what the manager holds::

    player.seek_op(40)
    info = block_details(player, 7)
    info.ref_cnt, info.hash, info.parent, info.holders, info.free_position

* ``block_details``: state, ref count, hash (hex) and KV cache group, the
  parent hash in its chain (``None`` for a request's first block), the requests
  holding it (per group), its place in the free queue (0 = allocated next), and
  the ops that touched it so far (changed its ref count, hash or free-queue
  membership), the last ones by name, and the KV cache events about it (when
  the trace has them on), each with the op that queued it.
* ``request_details``: status, tokens, block ids per group, number of block
  hashes, and the request's ops so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.core.kv_cache_utils import get_block_hash, get_group_id
from kvref.viz.player import TracePlayer
from kvref.viz.pool import block_state

TOUCHES_SHOWN = 5           # the last ops that touched a block, listed by name

@dataclass
class BlockDetails:
    block_id: int
    state: str                              # kvref.viz.pool: null/used/used_cached/...
    ref_cnt: int
    hash: str | None                        # hex of the block hash (without the group id)
    group: int | None                       # the KV cache group its hash is indexed under
    parent: str | None                      # hex of the previous hash in the chain
    holders: list[tuple[str, int]] = field(default_factory=list)    # (request, group)
    free_position: int | None = None        # 0 = the head of the free queue
    free_length: int = 0
    touched_by: list[int] = field(default_factory=list)             # op indices
    touched_ops: list[str] = field(default_factory=list)            # "free r3", one per index
    kv_events: list[tuple[int, str]] | None = None  # (op that queued it, type); None: off

    def lines(self) -> list[str]:
        """The details as short lines of text (what the viewers print)."""
        out = [f"block {self.block_id}: {self.state.replace('_', ' + ')}, "
               f"ref count {self.ref_cnt}"]
        if self.hash is not None:
            out.append(f"hash {self.hash[:16]}… (group {self.group})")
            out.append("parent: first block of its chain" if self.parent is None
                       else f"parent {self.parent[:16]}…")
        else:
            out.append("no hash: nobody can hit it")
        out.append("held by " + (", ".join(f"{r} (g{g})" for r, g in self.holders)
                                 if self.holders else "no request"))
        if self.free_position is not None:
            out.append(f"free queue: position {self.free_position} of {self.free_length} "
                       f"({'allocated next' if self.free_position == 0 else 'from the head'})")
        elif self.state != "null":
            out.append("not in the free queue (in use)")
        ops = self.touched_by
        out.append(f"touched by {len(ops)} op(s)" + (":" if ops else ""))
        if len(ops) > TOUCHES_SHOWN:
            out.append(f"  … {len(ops) - TOUCHES_SHOWN} earlier")
        out += [f"  #{i} {what}" for i, what in zip(ops[-TOUCHES_SHOWN:],
                                                    self.touched_ops[-TOUCHES_SHOWN:])]
        if self.kv_events is not None:
            shown = ", ".join(f"#{i} {kind}" for i, kind in self.kv_events[-TOUCHES_SHOWN:])
            out.append(f"KV events: {'… ' if len(self.kv_events) > TOUCHES_SHOWN else ''}"
                       f"{shown or 'none yet'}")
        return out


@dataclass
class RequestDetails:
    request_id: str
    status: str
    num_computed_tokens: int
    num_tokens: int
    num_block_hashes: int
    block_ids: list[list[int]]
    ops: list[int]

    def lines(self) -> list[str]:
        from kvref.viz.tables import compress_ids

        out = [f"request {self.request_id}: {self.status.lower()}, "
               f"{self.num_computed_tokens}/{self.num_tokens} tokens computed, "
               f"{self.num_block_hashes} block hashes"]
        for g, ids in enumerate(self.block_ids):
            out.append(f"g{g} blocks: {compress_ids(ids)}")
        shown = ", ".join(f"#{i}" for i in self.ops[-8:])
        out.append(f"{len(self.ops)} op(s): {'… ' if len(self.ops) > 8 else ''}{shown}")
        return out


def holders_of(manager: KVCacheManager) -> dict[int, list[tuple[str, int]]]:
    """block id -> the (request, group) pairs whose block tables hold it."""
    out: dict[int, list[tuple[str, int]]] = {}
    for g, stm in enumerate(manager.coordinator.single_type_managers):
        for rid, blocks in stm.req_to_blocks.items():
            for block in blocks:
                if not block.is_null:
                    out.setdefault(block.block_id, []).append((rid, g))
    return out


def block_details(player: TracePlayer, block_id: int) -> BlockDetails:
    """One block of the pool at the player's position."""
    pool = player.manager.block_pool
    if not 0 <= block_id < len(pool.blocks):
        raise IndexError(f"no block {block_id}: blocks are 0..{len(pool.blocks) - 1}")
    block = pool.blocks[block_id]
    key = block.block_hash
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    details = BlockDetails(
        block_id, block_state(block), block.ref_cnt,
        None if key is None else get_block_hash(key).hex(),
        None if key is None else get_group_id(key),
        player.parents.get(block_id) if key is not None else None,
        holders_of(player.manager).get(block_id, []),
        queue.index(block_id) if block_id in queue else None, len(queue),
        list(player.touches.get(block_id, [])))
    details.touched_ops = [op_label(player.ops[i]) for i in details.touched_by]
    if pool.enable_kv_cache_events:
        details.kv_events = list(player.kv_events.get(block_id, []))
    return details


def op_label(op: dict) -> str:
    """An op's name and request: ``allocate_slots r2``."""
    return f"{op['op']} {op['req']}" if "req" in op else op["op"]


def request_details(player: TracePlayer, request_id: str) -> RequestDetails:
    """One request at the player's position (``KeyError`` if the trace has not added it)."""
    req = player.requests.get(request_id)
    if req is None:
        raise KeyError(f"no request {request_id!r} at op {player.position - 1}")
    return RequestDetails(request_id, req.status.name, req.num_computed_tokens,
                          req.num_tokens, len(req.block_hashes),
                          [list(ids) for ids in player.manager.get_block_ids(request_id)],
                          list(player.request_ops.get(request_id, [])))
