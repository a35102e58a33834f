"""A block pool whose cost grows with the blocks used, not the blocks configured.

No vLLM counterpart: vLLM's ``BlockPool`` makes every block and links every one
into its free queue at startup (``vllm/v1/core/block_pool.py``), which is what
kvref's ``BlockPool`` does too. On a GPU a pool has some thousands of blocks;
a simulation asked for a small model on a large GPU gets millions (18 million
blocks took 30 s and 2.7 GB before its first request). ``LazyBlockPool``
hands out exactly the same blocks in exactly the same order, making each block
only when it is first handed out.

Why that is exact: vLLM's free queue starts as every block in id order, and
blocks come back only at its head (freed without a hash: ``prepend_n``) or its
tail (freed with one: ``append_n``); a block leaves from the head, or from
anywhere when a cache hit revives it (``remove``), and only a block with a
hash is ever revived. So the queue is always three runs::

    head <-> [freed, no hash] <-> [never handed out: ids k .. n-1] <-> [freed, hashed] <-> tail

and the middle run is a range of ids, which needs no blocks: ``LazyFreeQueue``
keeps it as one marker node in the linked list, between the other two runs,
and makes its blocks as ``popleft_n`` reaches them. ``tests/simulate/
test_lazy_pool.py`` checks the lazy pool against the plain one, op for op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

__all__ = ["LazyBlockPool", "LazyFreeQueue", "MadeOnDemand", "lazy_block_pools"]


class MadeOnDemand:
    """``pool.blocks`` for block ids ``0 .. n-1``: each ``KVCacheBlock`` is made
    the first time it is asked for (iterating makes them all)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.made: dict[int, KVCacheBlock] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, block_id: int) -> KVCacheBlock:
        if isinstance(block_id, slice):
            return [self[i] for i in range(*block_id.indices(self.n))]
        if block_id < 0:
            block_id += self.n
        if not 0 <= block_id < self.n:
            raise IndexError(f"block id {block_id} outside the pool [0, {self.n})")
        block = self.made.get(block_id)
        if block is None:
            block = self.made[block_id] = KVCacheBlock(block_id)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return (self[i] for i in range(self.n))


class LazyFreeQueue(FreeKVCacheBlockQueue):
    """vLLM's free queue with the run of never-used blocks kept as a range
    (``next_untouched .. n-1``) behind one marker node (see the module docstring)."""

    def __init__(self, blocks: MadeOnDemand) -> None:
        super().__init__([])
        self.blocks = blocks
        self.next_untouched = 0
        self.marker = KVCacheBlock(block_id=-2)
        if blocks.n:
            self._insert_after(self.fake_free_list_head, [self.marker], check=True)
        self.num_free_blocks = blocks.n       # the marker is no block; the range is

    @property
    def num_untouched(self) -> int:
        return self.blocks.n - self.next_untouched

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        taken: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while len(taken) < n:
            if block is self.marker:
                count = min(n - len(taken), self.num_untouched)
                start = self.next_untouched
                taken.extend(self.blocks[i] for i in range(start, start + count))
                self.next_untouched += count
                if self.num_untouched == 0:            # the range is used up: drop the marker
                    block = self.marker.next_free_block
                    self.marker.prev_free_block.next_free_block = block
                    block.prev_free_block = self.marker.prev_free_block
                    self.marker.prev_free_block = self.marker.next_free_block = None
                continue
            taken.append(block)
            block = block.next_free_block
        # ``block`` is the new head (the marker, if the range is not used up).
        first = self.fake_free_list_head
        first.next_free_block = block
        block.prev_free_block = first
        for popped in taken:
            popped.prev_free_block = popped.next_free_block = None
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        if block is self.marker:
            raise RuntimeError("remove() called on the queue's own marker")
        super().remove(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            if block is self.marker:
                yield from (self.blocks[i] for i in range(self.next_untouched, self.blocks.n))
            else:
                yield block
            block = block.next_free_block


class LazyBlockPool(BlockPool):
    """kvref's ``BlockPool`` with blocks made on first use: the same blocks, in the
    same order, as the plain pool hands out."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False) -> None:
        # The plain pool's own checks and fields, on a pool of one block; then the
        # blocks and the queue are replaced, and the null block taken as it does.
        super().__init__(1 if type(num_gpu_blocks) is int and num_gpu_blocks > 0
                         else num_gpu_blocks, enable_caching, hash_block_size,
                         enable_kv_cache_events)
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = MadeOnDemand(num_gpu_blocks)
        self.free_block_queue = LazyFreeQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def reset_prefix_cache(self) -> bool:
        """As the plain pool's, touching only the blocks ever made (the others
        have no hash to drop)."""
        blocks, self.blocks = self.blocks, list(self.blocks.made.values())
        try:
            return super().reset_prefix_cache()
        finally:
            self.blocks = blocks


@contextmanager
def lazy_block_pools():
    """While inside, a ``KVCacheManager`` built here gets a ``LazyBlockPool``
    (its coordinator builds the pool; ``simulate`` builds its manager inside)."""
    import kvref.core.kv_cache_coordinator as coordinator_module

    plain = coordinator_module.BlockPool
    coordinator_module.BlockPool = LazyBlockPool
    try:
        yield
    finally:
        coordinator_module.BlockPool = plain
