"""The block pool: every block, the free queue, and the prefix-cache index.

Mirrors ``vllm/v1/core/block_pool.py``. The pool knows blocks, not requests:

- ``get_new_blocks(n)`` pops ``n`` blocks from the head of the free queue. A
  popped block that was still cached loses its hash here (a ``BlockRemoved``
  event): this is the LRU eviction, the only one that makes room. Two other
  calls drop hashes without reusing any block: ``evict_blocks`` (a KV
  connector reports those blocks' content bad) and ``reset_prefix_cache``
  (forget everything, e.g. after new weights).
- ``touch(blocks)`` takes a reference on prefix-hit blocks; a hit block that
  sat in the free queue leaves it.
- ``free_blocks(blocks)`` drops a reference; blocks reaching 0 go back to the
  queue, uncached ones at the head, cached ones at the tail (LRU order).
- ``cache_full_blocks(...)`` gives full blocks their hashes and indexes them so
  later requests can hit them (a ``BlockStored`` event).
- ``cache_partial_block(...)`` indexes a block under a prefix that ends inside
  it (a *partial entry*); when the block fills up, ``cache_full_blocks``
  replaces the entry by the full key. In vLLM 0.25.1 only these primitives
  exist: no manager calls them yet.

Block 0 is the *null block*: a placeholder for blocks a request no longer needs
(outside a sliding window, before a local-attention chunk, old Mamba states).
It is never in the free queue, never cached, never freed; like vLLM, its
``ref_cnt`` is not kept meaningful.

    >>> pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    >>> [b.block_id for b in pool.get_new_blocks(2)]
    [1, 2]
    >>> pool.get_num_free_blocks()
    1

Eviction lives here, in the free queue and in the managers' free order:
``docs/contributing.md`` ("Adding an eviction rule") lists each place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvref.core.kv_cache_utils import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    generate_block_hash_extra_keys,
    has_extra_keys,
    get_block_hash,
    get_group_id,
    int_block_hashes_enabled,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from kvref.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvref.request import Request


class BlockHashToBlockMap:
    """Prefix-cache index: hash (with group id) -> the cached blocks holding it.

    Several blocks can hold the same content: two requests that computed the
    same block before either was cached each keep their own copy, because block
    tables are append-only and a block id, once handed out, never changes. A hit
    takes the oldest copy (insertion order).
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        return next(iter(blocks.values())) if blocks else None

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        return block_id in self._cache.get(key, {})

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove one block under ``key``; ``None`` if it was not there."""
        blocks = self._cache.get(key)
        if not blocks or block_id not in blocks:
            return None
        block = blocks.pop(block_id)
        if not blocks:
            del self._cache[key]
        return block

    def items(self):
        """``(key, block)`` for every indexed block."""
        for key, blocks in self._cache.items():
            for block in blocks.values():
                yield key, block

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All ``num_gpu_blocks`` blocks of one KV cache, shared by every group.

    Args:
        num_gpu_blocks: pool size, the null block included.
        enable_caching: index full blocks by hash for prefix caching.
        hash_block_size: tokens per entry of ``request.block_hashes``; a group
            with bigger blocks reads every ``block_size // hash_block_size``-th.
        enable_kv_cache_events: queue ``BlockStored``/``BlockRemoved``/
            ``AllBlocksCleared`` for ``take_events``.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False) -> None:
        if isinstance(num_gpu_blocks, bool) or not isinstance(num_gpu_blocks, int) \
                or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int (the null block "
                             f"counts), got {num_gpu_blocks!r}")
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # block id -> the keys it is indexed under besides its own hash (partial
        # entries). A list, where vLLM keeps a set: the keys leave in the order
        # they came, so the BlockRemoved events of one block do not depend on
        # PYTHONHASHSEED.
        self.cached_block_hashes_by_block: dict[int, list[BlockHashWithGroupId]] = {}
        # The first block becomes the null block and never returns to the queue.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list = []
        # Read once, as a running vLLM engine caches its environment: not per event hash.
        self._int_event_hashes = int_block_hashes_enabled()

    # -- lookup and caching ------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]
                         ) -> list[KVCacheBlock] | None:
        """One cached block per group for this hash, or ``None`` if any group misses."""
        found = []
        for group_id in kv_cache_group_ids:
            key = make_block_hash_with_group_id(block_hash, group_id)
            block = self.cached_block_hash_to_block.get_one_block(key)
            if block is None:
                return None
            found.append(block)
        return found

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: list[bool] | None = None) -> None:
        """Hash and index ``blocks[num_cached_blocks:num_full_blocks]`` of a request.

        Null blocks, and blocks whose ``block_mask`` entry is False (a sliding
        window can never hit them), are skipped. One ``BlockStored`` event covers
        the whole range: its ``token_ids`` span every block of the range, its
        ``block_hashes`` only the blocks actually stored.

        A block of the range may already hold a partial entry of a shorter
        prefix (``cache_partial_block``): it is promoted, every key it had
        leaving the index first (one ``BlockRemoved`` each, before the
        ``BlockStored``). Any other hash there is a ``RuntimeError``.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_blocks):
            raise ValueError(f"block_mask has {len(block_mask)} entries for "
                             f"{len(new_blocks)} blocks")
        hashes = self._hashes_at_block_size(request, block_size)
        if len(hashes) < num_full_blocks:
            raise ValueError(f"request {request.request_id!r} has {len(hashes)} block "
                             f"hashes of size {block_size}, cannot cache "
                             f"{num_full_blocks} blocks")

        stored = [i for i, block in enumerate(new_blocks, start=num_cached_blocks)
                  if not block.is_null
                  and (block_mask is None or block_mask[i - num_cached_blocks])]
        for i in stored:  # checked before any change, so a refusal changes nothing
            covered = blocks[i].block_hash_num_tokens
            if blocks[i].block_hash is not None and (covered is None
                                                     or covered >= (i + 1) * block_size):
                raise RuntimeError(f"block {blocks[i].block_id} is already cached (covering "
                                   f"{covered} tokens); only a partial entry of a shorter "
                                   f"prefix can be promoted to the full block")
        for i in stored:
            block = blocks[i]
            if block.block_hash is not None:
                self._maybe_evict_cached_block(block)  # a partial entry is promoted
            key = make_block_hash_with_group_id(hashes[i], kv_cache_group_id)
            block.set_block_hash(key, num_tokens=(i + 1) * block_size)
            self.cached_block_hash_to_block.insert(key, block)

        if self.enable_kv_cache_events:
            self._emit_block_stored(request, hashes, stored, num_cached_blocks,
                                    num_full_blocks, block_size, kv_cache_group_id)

    def cache_partial_block(self, request: Request, block: KVCacheBlock, num_tokens: int,
                            kv_cache_group_id: int, block_size: int
                            ) -> BlockHashWithGroupId | None:
        """Index ``block`` under the request's first ``num_tokens`` tokens, a
        prefix that ends inside the block; return that key (``None``, and
        nothing done, for the null block).

        The key is the fine hash at ``num_tokens`` (every hash chains over the
        whole prefix before it) with the group id; nothing is allocated or
        copied. ``hash_block_size`` 2, ``block_size`` 6, 10 tokens::

            tokens  | 0 1 . 2 3 . 4 5 | 6 7 . 8 9 . _ _ |
            fine    |  a     b     c  |  d     e        |
            full    |        c        |                 |   c -> the request's 1st block
            partial |                 |        e        |   e -> its 2nd block

        What the key becomes depends on the block's hash, which covers
        ``block.block_hash_num_tokens`` tokens:

        - no hash: the key is its hash now;
        - a hash of fewer tokens: the longer prefix replaces it; every key of
          the block leaves first (a ``BlockRemoved`` each);
        - a hash of as many tokens or more (or of a number not recorded, as
          ``set_block_hash(key)`` from outside leaves it): the key is an extra one, in
          ``cached_block_hashes_by_block[block.block_id]``; it leaves the index
          with the block's hash (eviction, promotion, replacement, reset).

        Asking again for a key the block has changes nothing and emits nothing.
        With events on, a new key queues one ``BlockStored`` for its last
        ``hash_block_size`` tokens (parent: the fine hash before them).

        Raises ``AssertionError`` (vLLM's asserts; nothing changed) unless
        ``block_size`` is a multiple of ``hash_block_size`` and larger,
        ``num_tokens`` is a multiple of ``hash_block_size`` and not of
        ``block_size``, and the request has hashes for ``num_tokens`` tokens.
        O(keys of the block).
        """
        if block.is_null:
            return None
        hbs = self.hash_block_size
        if block_size <= hbs or block_size % hbs != 0:
            raise AssertionError(f"cache_partial_block: block_size {block_size} must be a "
                                 f"multiple of hash_block_size {hbs} and larger")
        if num_tokens % block_size == 0 or num_tokens % hbs != 0:
            raise AssertionError(f"cache_partial_block: num_tokens {num_tokens} must be a "
                                 f"multiple of hash_block_size {hbs} and not of block_size "
                                 f"{block_size}")
        num_hashes = num_tokens // hbs
        if not 0 < num_hashes <= len(request.block_hashes):
            raise AssertionError(f"cache_partial_block: num_tokens {num_tokens} needs "
                                 f"{num_hashes} block hashes, request "
                                 f"{request.request_id!r} has {len(request.block_hashes)}")
        key = make_block_hash_with_group_id(request.block_hashes[num_hashes - 1],
                                            kv_cache_group_id)
        if self._has_key(block, key):
            return key
        covered = block.block_hash_num_tokens
        if block.block_hash is not None and covered is not None and covered < num_tokens:
            self._maybe_evict_cached_block(block)  # the longer prefix replaces it
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens=num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, []).append(key)
        self.cached_block_hash_to_block.insert(key, block)
        if self.enable_kv_cache_events:
            self._emit_partial_block_stored(request, num_hashes, kv_cache_group_id)
        return key

    def _has_key(self, block: KVCacheBlock, key: BlockHashWithGroupId) -> bool:
        return block.block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id)

    def _emit_partial_block_stored(self, request: Request, num_hashes: int,
                                   group_id: int) -> None:
        hashes = request.block_hashes
        start, end = (num_hashes - 1) * self.hash_block_size, num_hashes * self.hash_block_size
        # Past the first block, only the request's last multimodal item can reach here.
        keys, _ = generate_block_hash_extra_keys(request, start, end, -1 if start else 0)
        lora = request.lora_request
        self.kv_event_queue.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[num_hashes - 1],
                                                   self._int_event_hashes)],
            parent_block_hash=(maybe_convert_block_hash(hashes[num_hashes - 2],
                                                        self._int_event_hashes)
                               if num_hashes > 1 else None),
            token_ids=list(request.all_token_ids[start:end]),
            block_size=end - start,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=[keys],
            group_idx=group_id,
        ))

    def _hashes_at_block_size(self, request: Request, block_size: int) -> Sequence[BlockHash]:
        if block_size == self.hash_block_size:
            return request.block_hashes
        return BlockHashListWithBlockSize(request.block_hashes, self.hash_block_size,
                                          block_size)

    def _emit_block_stored(self, request: Request, hashes: Sequence[BlockHash],
                           stored: list[int], first: int, end: int, block_size: int,
                           group_id: int) -> None:
        if has_extra_keys(request):
            extra_keys = []
            mm_idx = 0
            for i in stored:
                keys, mm_idx = generate_block_hash_extra_keys(
                    request, i * block_size, (i + 1) * block_size, mm_idx)
                extra_keys.append(keys)
        else:
            extra_keys = [None] * len(stored)  # what the loop would give, without it
        lora = request.lora_request
        self.kv_event_queue.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[i], self._int_event_hashes)
                          for i in stored],
            parent_block_hash=(maybe_convert_block_hash(hashes[first - 1], self._int_event_hashes)
                               if first else None),
            token_ids=list(request.all_token_ids[first * block_size:end * block_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora.name if lora else None,
            extra_keys=extra_keys or None,
            group_idx=group_id,
        ))

    # -- allocation and release -------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with
        ``ref_cnt`` 1. Cached ones among them are evicted first."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            # The test is _maybe_evict_cached_block's early return, made here: a
            # never-cached block is the common case.
            if self.enable_caching and (block.block_hash is not None
                                        or self.cached_block_hashes_by_block):
                self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop the block's hash and its partial entries from the index, one
        ``BlockRemoved`` per key, its hash first; True if any key was indexed."""
        key = block.block_hash
        extra = (self.cached_block_hashes_by_block.pop(block.block_id, None)
                 if self.cached_block_hashes_by_block else None)
        if key is None and extra is None:
            return False  # never cached: the common case, on every allocation
        block.reset_hash()
        keys = ([] if key is None else [key]) + (extra or [])
        removed = [key for key in keys
                   if self.cached_block_hash_to_block.pop(key, block.block_id) is not None]
        for key in removed:
            self._emit_block_removed(key)
        return bool(removed)

    def _emit_block_removed(self, key: BlockHashWithGroupId) -> None:
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(get_block_hash(key),
                                                       self._int_event_hashes)],
                medium=MEDIUM_GPU, group_idx=get_group_id(key)))

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit).

        A block at ``ref_cnt == 0`` is a cached block waiting in the free queue:
        it leaves the queue so it cannot be evicted while in use.
        """
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; ``ordered_blocks`` comes in eviction
        order (first = evicted first), so callers pass a request's blocks reversed.

        Blocks reaching 0 return to the queue: unhashed ones at the head, since
        nobody can hit them, hashed ones at the tail, so the cache keeps them
        longest. ``ValueError`` if a block would drop below 0: the references
        already dropped are given back first, so the pool is left as it was.
        """
        blocks = list(ordered_blocks)
        uncached, cached, over_freed = [], [], []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0 or block.is_null:
                continue  # still held by another request (a shared prefix): one test
            if block.ref_cnt == 0:
                (uncached if block.block_hash is None else cached).append(block)
            else:
                over_freed.append(block.block_id)
        # Over-freeing is found in the same pass, and undone before raising.
        if over_freed:
            for block in blocks:
                block.ref_cnt += 1
            raise ValueError(f"free_blocks: blocks {sorted(set(over_freed))} are freed "
                             "more times than they are referenced")
        # Unchecked, and only when there is something to queue: every block here
        # was held until now, so none is queued (INV-QUEUE-4).
        if uncached:
            self.free_block_queue.prepend_n(uncached, check=False)
        if cached:
            self.free_block_queue.append_n(cached, check=False)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the hashes of these blocks from the index (a KV connector found
        their content stale). Blocks in use stay in use; the queue keeps its order."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(f"evict_blocks: block id {block_id} is outside the "
                                 f"pool [0, {self.num_gpu_blocks})")
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (after a weight update, say).

        Refuses (returns False) while any block but the null block is in use,
        since running requests would otherwise cache into a fresh index
        inconsistently. Does not reorder the free queue.
        """
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- views --------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-unused ones included). O(1)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the pool in use, the null block not counted."""
        usable = self.num_gpu_blocks - 1
        if usable == 0:
            return 0
        return 1.0 - self.get_num_free_blocks() / usable

    def take_events(self) -> list:
        """Return and clear the queued events (``[]`` when events are off)."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
