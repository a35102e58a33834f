"""Invariant checker: assert every structural invariant of the KV layer, now.

The specification (``specs/``) numbers the invariants of the block pool, the
free queue, the prefix-cache index and the managers' block tables. This module
checks the ones that hold of a *single snapshot* of the objects; the others
(eviction order, events, hit lengths, contents) are properties of transitions
and need a model, so ``tests/stateful`` checks them instead.

    >>> from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
    >>> config = KVCacheConfig(8, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    >>> manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
    ...                          hash_block_size=4)
    >>> check(manager)                      # silent when healthy
    >>> manager.block_pool.blocks[3].ref_cnt = 1      # a free block, now "in use"
    >>> try:
    ...     check(manager)
    ... except InvariantViolation as e:
    ...     print(e.invariant, e.block_id, "|", e)
    INV-QUEUE-4 3 | INV-QUEUE-4 (block 3): block 3 is in the free queue but has ref_cnt 1

Entry points: ``check(obj)`` dispatches to ``check_kv_cache_manager`` (an object
with ``.coordinator``) or ``check_block_pool`` (an object with
``.free_block_queue``). ``check_prefix_hit(manager, request, blocks, n)`` checks
one ``get_computed_blocks`` answer (INV-HIT-1, INV-HIT-2). A violation raises ``InvariantViolation``, an
``AssertionError`` that names the invariant id and, where there is one, the block.

Works on vLLM too. The checker reads only attributes that kvref and vLLM
v0.25.1 share (``blocks``, ``null_block``, ``free_block_queue`` with its
``fake_free_list_head``/``fake_free_list_tail`` sentinels and
``num_free_blocks``, ``cached_block_hash_to_block._cache``, ``enable_caching``,
``get_usage()``; ``coordinator.single_type_managers`` with ``block_pool``,
``req_to_blocks``, ``num_cached_block``, ``kv_cache_group_id``), so it accepts a
real ``vllm.v1.core.kv_cache_manager.KVCacheManager`` or ``BlockPool``. Where
vLLM differs it is handled: an index entry may be a single block or a dict of
blocks, a block's extra partial-prefix keys in
``pool.cached_block_hashes_by_block`` are a set (kvref: a list), and blocks are compared by identity,
never with ``==`` or ``hash()`` (vLLM's ``KVCacheBlock`` is an ``eq=True``
dataclass, so two distinct blocks can compare equal and none is hashable).

Cost: O(num_blocks + total block-table length + index size), no allocation
beyond a few dicts keyed by block id.

Blocks a caller popped with ``pop_blocks_for_free`` and has not yet handed to
``block_pool.free_blocks`` still hold a reference but sit in no table; pass
them as ``popped_blocks`` so the reference count adds up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# The invariants this module checks, by id; specs/ states each with its reason.
CHECKED_INVARIANTS: dict[str, str] = {
    "INV-POOL-1": "blocks[i].block_id == i for every i, and len(blocks) == num_gpu_blocks",
    "INV-POOL-2": "the null block is blocks[0], is_null, and the only block with is_null",
    "INV-POOL-3": "the null block is never in the free queue and never hashed or indexed",
    "INV-POOL-4": "every block but the null block has ref_cnt >= 0",
    "INV-POOL-5": "0.0 <= get_usage() <= 1.0",
    "INV-QUEUE-1": "the free queue links form one chain head -> ... -> tail, both ways",
    "INV-QUEUE-2": "num_free_blocks equals the number of blocks on the chain",
    "INV-QUEUE-3": "every queued node is a block of this pool",
    "INV-QUEUE-4": "every queued block has ref_cnt == 0",
    "INV-QUEUE-5": "every non-null block with ref_cnt == 0 is in the queue (or a sink block)",
    "INV-QUEUE-6": "a block outside the queue has no queue links",
    "INV-HASH-1": "every index entry is a pool block whose hash is that key",
    "INV-HASH-2": "every hashed block is indexed under its hash",
    "INV-HASH-3": "no index key maps to an empty set of blocks",
    "INV-HASH-4": "with caching disabled, no block is hashed and the index is empty",
    "INV-HASH-5": "a block's extra (partial-entry) keys are a non-empty collection of "
                  "distinct keys, none its own hash, of a pool block",
    "INV-MGR-1": "a block's ref_cnt equals the number of table slots (and popped lists) holding it",
    "INV-MGR-2": "every group's manager uses the coordinator's pool",
    "INV-MGR-3": "every table entry is a block of the pool (or the pool's null block)",
    "INV-MGR-4": "no block is held by two KV cache groups",
    "INV-MGR-5": "num_cached_block[r] <= len(req_to_blocks[r])",
    "INV-MGR-6": "a hashed block sits at a table index below its holder's num_cached_block",
    "INV-MGR-7": "a hashed block held by group g is indexed under group id g",
    "INV-MGR-8": "full/cross-attention tables hold no null block; sliding-window and "
                 "chunked-local tables hold null blocks only as a prefix",
}

# INV-MGR-8 by manager class name (the same in vLLM); subclasses such as vLLM's
# RSWAManager place null blocks differently and are not checked.
_NO_NULLS = ("FullAttentionManager", "CrossAttentionManager")
_NULL_PREFIX = ("SlidingWindowManager", "ChunkedLocalAttentionManager")


class InvariantViolation(AssertionError):
    """An invariant does not hold. ``invariant`` is its id (``"INV-QUEUE-4"``),
    ``block_id`` the block concerned, or ``None`` when no single block is."""

    def __init__(self, invariant: str, message: str, block_id: int | None = None) -> None:
        self.invariant = invariant
        self.block_id = block_id
        where = "" if block_id is None else f" (block {block_id})"
        super().__init__(f"{invariant}{where}: {message}")


def _fail(invariant: str, message: str, block_id: int | None = None) -> None:
    raise InvariantViolation(invariant, message, block_id)


def check(obj: Any, popped_blocks: Iterable[Iterable[Any]] = ()) -> None:
    """Check a KVCacheManager (has ``.coordinator``) or a BlockPool (has
    ``.free_block_queue``); raise ``InvariantViolation`` on the first failure."""
    if hasattr(obj, "coordinator"):
        check_kv_cache_manager(obj, popped_blocks)
    elif hasattr(obj, "free_block_queue"):
        check_block_pool(obj)
    else:
        raise TypeError(f"check() takes a KVCacheManager or a BlockPool, "
                        f"got {type(obj).__name__}")


# --------------------------------------------------------------------------
# The pool: blocks, free queue, prefix-cache index


def check_block_pool(pool: Any, sink_blocks: Iterable[Any] = ()) -> None:
    """INV-POOL-*, INV-QUEUE-*, INV-HASH-*: the pool on its own (no requests).

    ``sink_blocks``: blocks a sink-attention manager took off the queue without
    a reference when it was built; only the manager knows them, so the pool
    alone would call them leaked (``check_kv_cache_manager`` passes them)."""
    _check_blocks(pool)
    queued = _check_free_queue(pool)
    _check_queue_membership(pool, queued, {id(b): b for b in sink_blocks})
    _check_hash_index(pool)
    usage = pool.get_usage()
    if not 0.0 <= usage <= 1.0:
        _fail("INV-POOL-5", f"get_usage() returned {usage!r}, outside [0, 1]")


def _check_blocks(pool: Any) -> None:
    blocks = pool.blocks
    if len(blocks) != pool.num_gpu_blocks:
        _fail("INV-POOL-1", f"pool has {len(blocks)} blocks, num_gpu_blocks is "
                            f"{pool.num_gpu_blocks}")
    for i, block in enumerate(blocks):
        if block.block_id != i:
            _fail("INV-POOL-1", f"blocks[{i}] has block_id {block.block_id}", i)
    null = pool.null_block
    if not blocks or blocks[0] is not null or not null.is_null:
        _fail("INV-POOL-2", "pool.null_block must be blocks[0] with is_null set",
              getattr(null, "block_id", None))
    for block in blocks[1:]:
        if block.is_null:
            _fail("INV-POOL-2", f"block {block.block_id} is marked is_null but is not "
                                "the pool's null block", block.block_id)
        if block.ref_cnt < 0:
            _fail("INV-POOL-4", f"block {block.block_id} has ref_cnt {block.ref_cnt}",
                  block.block_id)
    if null.prev_free_block is not None or null.next_free_block is not None:
        _fail("INV-POOL-3", "the null block has free-queue links", null.block_id)


def _check_free_queue(pool: Any) -> dict[int, Any]:
    """Walk head to tail; return the queued blocks by ``id()``."""
    queue = pool.free_block_queue
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    if head.prev_free_block is not None or tail.next_free_block is not None:
        _fail("INV-QUEUE-1", "a sentinel links outward (head.prev or tail.next is set)")
    queued: dict[int, Any] = {}  # id() -> block: blocks are not hashable in vLLM
    node = head
    while True:
        nxt = node.next_free_block
        where = "the head sentinel" if node is head else f"block {node.block_id}"
        if nxt is None:
            _fail("INV-QUEUE-1", f"the chain ends at {where} before reaching the tail "
                                 "sentinel", None if node is head else node.block_id)
        if nxt.prev_free_block is not node:
            back = nxt.prev_free_block
            _fail("INV-QUEUE-1", f"{where} links forward to block {nxt.block_id}, whose "
                                 f"prev link is {getattr(back, 'block_id', None)}",
                  nxt.block_id)
        if nxt is tail:
            break
        if id(nxt) in queued:
            _fail("INV-QUEUE-1", f"block {nxt.block_id} appears twice on the chain "
                                 "(a cycle)", nxt.block_id)
        queued[id(nxt)] = nxt
        node = nxt
    if queue.num_free_blocks != len(queued):
        _fail("INV-QUEUE-2", f"num_free_blocks is {queue.num_free_blocks} but the chain "
                             f"holds {len(queued)} blocks")
    return queued


def _check_queue_membership(pool: Any, queued: dict[int, Any], sinks: dict[int, Any]) -> None:
    blocks = pool.blocks
    for block in queued.values():
        bid = block.block_id
        if block.is_null or block is pool.null_block:
            _fail("INV-POOL-3", "the null block is in the free queue", bid)
        if not (isinstance(bid, int) and 0 <= bid < len(blocks)) or blocks[bid] is not block:
            _fail("INV-QUEUE-3", f"queued node with block_id {bid} is not a block of "
                                 "this pool", bid)
        if block.ref_cnt != 0:
            _fail("INV-QUEUE-4", f"block {bid} is in the free queue but has ref_cnt "
                                 f"{block.ref_cnt}", bid)
    for block in blocks[1:]:
        if id(block) in queued:
            continue
        if block.ref_cnt == 0 and id(block) not in sinks:
            _fail("INV-QUEUE-5", f"block {block.block_id} has ref_cnt 0 but is not in "
                                 "the free queue (leaked)", block.block_id)
        if block.prev_free_block is not None or block.next_free_block is not None:
            _fail("INV-QUEUE-6", f"block {block.block_id} is not in the free queue but "
                                 "still has queue links", block.block_id)


def _index_entries(value: Any) -> list[tuple[int | None, Any]]:
    """An index value as ``(stored id, block)`` pairs: vLLM keeps one block
    bare and several in a dict; kvref always uses a dict."""
    if isinstance(value, dict):
        return list(value.items())
    return [(None, value)]


def _is_indexed(index: dict, key: Any, block: Any) -> bool:
    value = index.get(key)
    if isinstance(value, dict):
        return value.get(block.block_id) is block
    return value is block


def _check_hash_index(pool: Any) -> None:
    index = pool.cached_block_hash_to_block._cache
    # Keys of partial-prefix entries a block holds besides its hash.
    extra_keys: dict[int, Any] = getattr(pool, "cached_block_hashes_by_block", None) or {}
    _check_extra_keys(pool, extra_keys)
    caching = pool.enable_caching
    blocks = pool.blocks
    for key, value in index.items():
        entries = _index_entries(value)
        if not entries:
            _fail("INV-HASH-3", f"index key {_short(key)} maps to no block")
        for stored_id, block in entries:
            bid = block.block_id
            if not caching:
                _fail("INV-HASH-4", f"caching is disabled but block {bid} is indexed", bid)
            if block.is_null:
                _fail("INV-POOL-3", "the null block is in the prefix-cache index", bid)
            if not (isinstance(bid, int) and 0 <= bid < len(blocks)) or blocks[bid] is not block:
                _fail("INV-HASH-1", f"index key {_short(key)} holds a block with id {bid} "
                                    "that is not a block of this pool", bid)
            if stored_id is not None and stored_id != bid:
                _fail("INV-HASH-1", f"index key {_short(key)} stores block {bid} under "
                                    f"id {stored_id}", bid)
            if block.block_hash != key and key not in extra_keys.get(bid, ()):
                _fail("INV-HASH-1", f"block {bid} is indexed under {_short(key)} but its "
                                    f"hash is {_short(block.block_hash)}", bid)
    for block in blocks:
        bid = block.block_id
        own = [] if block.block_hash is None else [block.block_hash]
        more = list(extra_keys.get(bid, ()))
        if not own and not more:
            continue
        if not caching:
            _fail("INV-HASH-4", f"caching is disabled but block {bid} has a hash", bid)
        if block.is_null:
            _fail("INV-POOL-3", "the null block has a hash", bid)
        if not own:
            _fail("INV-HASH-2", f"block {bid} has partial-prefix keys but no hash", bid)
        for key in own + more:
            if not _is_indexed(index, key, block):
                _fail("INV-HASH-2", f"block {bid} has hash {_short(key)} but the index "
                                    "does not map that key to it", bid)


def _check_extra_keys(pool: Any, extra_keys: dict[int, Any]) -> None:
    for bid, keys in extra_keys.items():
        if not (isinstance(bid, int) and 0 < bid < len(pool.blocks)):
            _fail("INV-HASH-5", f"cached_block_hashes_by_block names block {bid!r}, not a "
                                "non-null block of this pool")
        keys = list(keys)
        if not keys:
            _fail("INV-HASH-5", f"block {bid} has an empty list of extra keys", bid)
        if len(set(keys)) != len(keys):
            _fail("INV-HASH-5", f"block {bid} lists an extra key twice", bid)
        if pool.blocks[bid].block_hash in keys:
            _fail("INV-HASH-5", f"block {bid} lists its own hash as an extra key", bid)


def _short(key: Any) -> str:
    if isinstance(key, (bytes, bytearray)):
        return key.hex()[:12] + "..."
    return repr(key)


# --------------------------------------------------------------------------
# One prefix hit: what get_computed_blocks answered


def check_prefix_hit(manager: Any, request: Any, computed_blocks: Any,
                     num_computed_tokens: int) -> None:
    """INV-HIT-1 and INV-HIT-2 for one ``get_computed_blocks`` answer.

    INV-HIT-1: the hit is at most ``num_tokens - 1`` tokens and a whole number
    of blocks of every group. INV-HIT-2: every group's hit list covers exactly
    the hit, ``len(blocks) * block_size == num_computed_tokens``, so the table
    ``allocate_slots`` builds from it has KV for every token it skips.

    Unlike the stateful suite, this check knows no exception: vLLM 0.25.1
    itself breaks INV-HIT-2 with EAGLE + Mamba (``specs/coordinator.md``),
    and the check flags it, as tutorial 10 shows. ``computed_blocks`` is the
    ``KVCacheBlocks`` (or anything with ``.blocks``, one list per group).
    O(number of groups).
    """
    if not 0 <= num_computed_tokens <= max(request.num_tokens - 1, 0):
        _fail("INV-HIT-1", f"{request.request_id} with {request.num_tokens} tokens got a "
              f"hit of {num_computed_tokens}; at most num_tokens - 1 = "
              f"{request.num_tokens - 1} (the last token is computed for its logits)")
    managers = manager.coordinator.single_type_managers
    groups = computed_blocks.blocks
    if len(groups) != len(managers):
        _fail("INV-HIT-2", f"the hit has {len(groups)} block lists for "
              f"{len(managers)} KV cache groups")
    for g, (group_manager, blocks) in enumerate(zip(managers, groups)):
        block_size = group_manager.block_size
        if num_computed_tokens % block_size:
            _fail("INV-HIT-1", f"a hit of {num_computed_tokens} tokens is not a whole "
                  f"number of group {g}'s blocks of {block_size}")
        if len(blocks) * block_size != num_computed_tokens:
            _fail("INV-HIT-2", f"group {g}'s hit has {len(blocks)} "
                  f"block{'' if len(blocks) == 1 else 's'} of {block_size} "
                  f"= {len(blocks) * block_size} tokens, but the hit is "
                  f"{num_computed_tokens} tokens: allocate_slots would skip tokens that "
                  f"group holds no KV for")


# --------------------------------------------------------------------------
# The managers: block tables against the pool


def check_kv_cache_manager(manager: Any, popped_blocks: Iterable[Iterable[Any]] = ()) -> None:
    """The pool (``check_block_pool``) plus INV-MGR-*: every group manager's
    ``req_to_blocks`` and ``num_cached_block`` against the pool.

    ``popped_blocks``: lists returned by ``pop_blocks_for_free`` that have not
    been freed yet (each block in them still holds one reference).
    """
    coordinator = manager.coordinator
    pool = coordinator.block_pool
    if manager.block_pool is not pool:
        _fail("INV-MGR-2", "manager.block_pool is not coordinator.block_pool")
    managers = coordinator.single_type_managers
    for g, group_manager in enumerate(managers):
        if group_manager.block_pool is not pool:
            _fail("INV-MGR-2", f"group {g}'s manager uses a different block pool")
    check_block_pool(pool, [b for m in managers for b in getattr(m, "sink_blocks", ())])

    holders: dict[int, list[str]] = {}  # block id -> who holds it, one entry per slot
    group_of: dict[int, int] = {}
    for g, group_manager in enumerate(managers):
        for request_id, table in group_manager.req_to_blocks.items():
            for block in table:
                if _table_block_id(pool, block) is None:
                    continue
                owner = group_of.setdefault(block.block_id, g)
                if owner != g:
                    _fail("INV-MGR-4", f"block {block.block_id} is held by group {owner} "
                                       f"and by group {g} (request {request_id!r})",
                          block.block_id)
                holders.setdefault(block.block_id, []).append(f"{request_id!r}@group{g}")
    for popped in popped_blocks:
        for block in popped:
            if _table_block_id(pool, block) is not None:
                holders.setdefault(block.block_id, []).append("popped")

    for block in pool.blocks[1:]:
        held_by = holders.get(block.block_id, [])
        if block.ref_cnt != len(held_by):
            _fail("INV-MGR-1", f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                               f"{len(held_by)} holder slot(s): {held_by}", block.block_id)

    for g, group_manager in enumerate(managers):
        group_id = getattr(group_manager, "kv_cache_group_id", g)
        tables = group_manager.req_to_blocks
        for request_id, num_cached in group_manager.num_cached_block.items():
            table_len = len(tables.get(request_id, ()))
            if num_cached > table_len:
                _fail("INV-MGR-5", f"request {request_id!r} in group {g}: num_cached_block "
                                   f"{num_cached} > table length {table_len}")
        kind = type(group_manager).__name__
        for request_id, table in tables.items():
            _check_null_layout(pool, kind, g, request_id, table)
            num_cached = group_manager.num_cached_block.get(request_id, 0)
            for i, block in enumerate(table):
                key = block.block_hash
                if key is None or block.is_null:
                    continue
                if i >= num_cached:
                    _fail("INV-MGR-6", f"block {block.block_id} at index {i} of request "
                                       f"{request_id!r} (group {g}) is hashed, but only "
                                       f"the first {num_cached} are cached", block.block_id)
                if isinstance(key, (bytes, bytearray)) and \
                        int.from_bytes(key[-4:], "big") != group_id:
                    _fail("INV-MGR-7", f"block {block.block_id} is held by group {group_id} "
                                       f"but indexed for group "
                                       f"{int.from_bytes(key[-4:], 'big')}", block.block_id)


def _check_null_layout(pool: Any, kind: str, g: int, request_id: Any, table: list) -> None:
    """INV-MGR-8: where a group type may hold null blocks."""
    if kind in _NO_NULLS:
        if any(block is pool.null_block for block in table):
            _fail("INV-MGR-8", f"request {request_id!r} holds the null block in group {g} "
                               f"({kind} tables have none)", pool.null_block.block_id)
    elif kind in _NULL_PREFIX:
        seen_real = None
        for block in table:
            if block is not pool.null_block:
                seen_real = block
            elif seen_real is not None:
                _fail("INV-MGR-8", f"request {request_id!r} in group {g} ({kind}) has a null "
                                   f"block right of block {seen_real.block_id}; freeing "
                                   "skipped blocks would never reach it", seen_real.block_id)


def _table_block_id(pool: Any, block: Any) -> int | None:
    """The id of a real block in a table; None for the null block. INV-MGR-3."""
    if block is pool.null_block:
        return None
    bid = block.block_id
    if block.is_null or not (isinstance(bid, int) and 0 <= bid < len(pool.blocks)) \
            or pool.blocks[bid] is not block:
        _fail("INV-MGR-3", f"a block table holds a block with id {bid} that is not a "
                           "block of this pool", bid)
    return bid


__all__ = ["CHECKED_INVARIANTS", "InvariantViolation", "check", "check_block_pool",
           "check_kv_cache_manager"]
