"""Blocks, the free queue, and block hashing: the nouns of the KV layer.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (the parts the scheduler side uses).

- ``KVCacheBlock``: one physical block of the pool, its reference count and,
  once full and cached, its hash.
- ``FreeKVCacheBlockQueue``: the blocks nobody uses, in eviction order. It is a
  doubly linked list threaded through the blocks themselves, with two sentinel
  nodes, so that a cache hit can pull a block out of the middle in O(1)
  (a ``deque`` would need an O(n) scan to remove by value).
- Block hashing: block ``i`` of a request hashes
  ``(hash of block i-1, its token ids, extra keys)``, so one hash fingerprints
  the whole prefix up to the end of that block::

      tokens   | t0 .. t15 | t16 .. t31 | t32 .. t47 |
      hash     |    h0     |     h1     |     h2     |
      h1 = H((h0, (t16..t31), extra_keys_1)),  h0 = H((NONE_HASH, (t0..t15), ...))

  Extra keys keep apart equal tokens that mean different things: the LoRA
  name, each multimodal item overlapping the block as
  ``(identifier, offset of the item relative to the block start)``, and the
  cache salt (first block only).
- Capacity: how many blocks a memory budget buys (``get_num_blocks``), how
  much one request needs at its peak (``max_memory_usage_bytes``), how many
  requests of ``max_model_len`` fit (``get_max_concurrency_for_kv_cache_config``),
  the longest sequence a budget serves (``estimate_max_model_len``)::

      >>> from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
      >>> spec = FullAttentionSpec(16, num_kv_heads=8, head_size=128)  # 64 KiB a block
      >>> get_num_blocks(num_layers=32, available_memory=8 * 2**30,
      ...                page_size=spec.page_size_bytes)
      4096
      >>> config = KVCacheConfig(4096, [KVCacheGroupSpec([f"l{i}" for i in range(32)], spec)])
      >>> get_max_concurrency_for_kv_cache_config(config, max_model_len=8192)
      8.0
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NewType

from kvref.hashing import sha256, sha256_cbor
from kvref.kv_cache_interface import KVCacheConfig, KVCacheSpec
from kvref.math_utils import cdiv
from kvref.request import Request

# A block hash is the 32 bytes a hash function returns. In the pool's index it
# is followed by 4 big-endian bytes of the KV cache group id, so that groups
# sharing one pool never hit each other's blocks. Two NewTypes, as in vLLM: both
# are bytes at run time, but a type checker tells the pool's key from a hash.
BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

# Parent hash of every request's first block. ``init_none_hash`` sets it.
NONE_HASH: BlockHash | None = None


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Seed the hash chain: ``hash_fn(PYTHONHASHSEED)``, or 32 random bytes
    when that variable is unset (then hashes differ between processes)."""
    global NONE_HASH
    seed = os.getenv("PYTHONHASHSEED")
    NONE_HASH = BlockHash(os.urandom(32) if seed is None else hash_fn(seed))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The pool's index key: the hash followed by the group id in 4 bytes."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def int_block_hashes_enabled() -> bool:
    """Whether KV events carry hashes as ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    on unless ``0``/``false``)."""
    return os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").lower() not in ("0", "false")


def maybe_convert_block_hash(block_hash: BlockHash, as_int: bool | None = None) -> int | bytes:
    """The hash as KV events carry it: by default the low 64 bits as an int
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` keeps the bytes, as in vLLM).
    ``as_int`` given: the caller read the switch already (the block pool, once)."""
    if as_int is None:
        as_int = int_block_hashes_enabled()
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the pool.

    ``ref_cnt`` counts the requests holding the block; at 0 the block sits in the
    free queue (still cached if it has a hash, so a later request may revive
    it). ``prev_free_block``/``next_free_block`` are the free queue's links and
    belong to ``FreeKVCacheBlockQueue`` alone. Blocks compare by identity.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: stands in for blocks a request no longer needs.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    def set_block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} is already cached; "
                               "reset its hash before caching it again")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        # Ids, not blocks, for the links: printing a block must not walk the queue.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        cached = self._block_hash.hex()[:8] if self._block_hash else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"hash={cached}, prev={prev_id}, next={next_id})")


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is reused first.

    ::

        head <-> b5 <-> b6 <-> b9 <-> b2 <-> tail      (sentinels at both ends)
                 ^ next popleft()            ^ last append()

    Starts in block-id order. ``BlockPool.free_blocks`` puts blocks without a
    hash at the front (nothing to lose) and cached blocks at the back (least
    recently freed is evicted first; a request frees its tail first, so the tail
    of a prefix goes before its head). All operations are O(1) per block and
    allocate nothing.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head. O(1). ``ValueError`` when empty."""
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        block = self.fake_free_list_head.next_free_block
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head, in queue order. O(n)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        # One walk and one relink, not n popleft() calls: every allocation comes here.
        blocks = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            blocks.append(block)
            block = block.next_free_block
        self.fake_free_list_head.next_free_block = block   # the new head
        block.prev_free_block = self.fake_free_list_head
        for popped in blocks:
            popped.prev_free_block = popped.next_free_block = None
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a cache hit revives it). O(1)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"remove() called on a block that is not in the "
                               f"free queue: {block}")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last). O(1)."""
        self._insert_after(self.fake_free_list_tail.prev_free_block, [block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the tail, keeping their order. O(len(blocks))."""
        self._insert_after(self.fake_free_list_tail.prev_free_block, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head, keeping their order. O(len(blocks))."""
        self._insert_after(self.fake_free_list_head, blocks)

    def _insert_after(self, anchor: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return  # the common case: one of free_blocks' two lists is usually empty
        # Check every block before linking any: a failure leaves the queue intact.
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise RuntimeError(f"block {block.block_id} is already in the free queue")
        after = anchor.next_free_block
        for block in blocks:
            anchor.next_free_block = block
            block.prev_free_block = anchor
            anchor = block
        anchor.next_free_block = after
        after.prev_free_block = anchor
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail. O(n); for tests and views."""
        return list(self)


# --------------------------------------------------------------------------
# Block hashing


def need_extra_keys(request: Request) -> bool:
    """Whether any block of this request hashes extra keys."""
    return bool(request.mm_features) or request.lora_request is not None \
        or request.cache_salt is not None


def _mm_extra_keys(request: Request, start: int, end: int, mm_idx: int) -> tuple[list, int]:
    """``(identifier, offset - start)`` for each multimodal item overlapping the
    block ``[start, end)``, and the index of the item the next block starts at.

    Items are sorted by offset, so the walk resumes where the previous block
    stopped. ``mm_idx == -1`` means "only the last item", which is what vLLM
    does for blocks completed by output tokens.
    """
    features = request.mm_features
    if not features:
        return [], mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start:
        return [], mm_idx  # past every item: nothing to add
    if mm_idx < 0:
        mm_idx += len(features)
    keys = []
    while mm_idx < len(features):
        feature = features[mm_idx]
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if offset >= end:
            break  # the item starts after this block
        if start >= offset + length:
            mm_idx += 1  # the item ended before this block
            continue
        keys.append((feature.identifier, offset - start))
        if end >= offset + length:
            mm_idx += 1  # the item ends here; the next one may start in this block
        else:
            break  # the item runs into the next block
    return keys, mm_idx


def generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int) -> tuple[tuple | None, int]:
    """Extra keys of the block ``[start_token_idx, end_token_idx)``, in vLLM's
    order: LoRA name, multimodal items, cache salt (first block only).
    Returns ``(keys or None, next multimodal index)``."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx,
                                          start_mm_idx)
    keys: list = []
    if request.lora_request:
        keys.append(request.lora_request.lora_name)
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return (tuple(keys) if keys else None), next_mm_idx


def hash_block_tokens(hash_function: Callable[[Any], bytes],
                      parent_block_hash: BlockHash | None,
                      curr_block_token_ids: Sequence[int],
                      extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block, chained to its parent (``NONE_HASH`` for the first)."""
    if not parent_block_hash:
        if NONE_HASH is None:
            raise RuntimeError("call init_none_hash(hash_fn) before hashing blocks")
        parent_block_hash = NONE_HASH
    return BlockHash(hash_function((parent_block_hash, tuple(curr_block_token_ids),
                                    extra_keys)))


def get_request_block_hasher(hash_block_size: int, caching_hash_fn: Callable[[Any], bytes]
                             ) -> Callable[[Any], list[BlockHash]]:
    """A function ``request -> hashes of its full blocks not hashed yet``.

    ``Request`` calls it on construction and after every appended output, and
    extends ``request.block_hashes`` with the result.
    """
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * hash_block_size
        # Blocks completed later by output tokens consider only the last item.
        mm_idx = 0 if start == 0 else -1
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + hash_block_size <= request.num_tokens:
            end = start + hash_block_size
            extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(caching_hash_fn, parent,
                                       request.all_token_ids[start:end], extra_keys)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


class BlockHashListWithBlockSize(Sequence):
    """A request's hashes seen at a coarser block size.

    Hashes are computed every ``hash_block_size`` tokens and chain over the
    whole prefix, so the hash of a ``target_block_size`` block is simply the
    fine hash at its end::

        fine (16):    | A | B | C | D |
        coarse (32):  |   B   |   D   |      coarse[i] = fine[(i + 1) * 2 - 1]
    """

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int,
                 target_block_size: int) -> None:
        if target_block_size % hash_block_size != 0:
            raise ValueError(f"block size {target_block_size} is not a multiple of "
                             f"hash_block_size {hash_block_size}")
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]


# --------------------------------------------------------------------------
# Capacity: bytes, blocks and requests
#
# vLLM's versions take the whole ``VllmConfig`` and read ``max_model_len``,
# ``max_num_batched_tokens`` and ``max_num_encoder_input_tokens`` from it;
# kvref takes those numbers as keyword arguments.


def get_num_blocks(num_layers: int, available_memory: int, page_size: int,
                   num_gpu_blocks_override: int | None = None) -> int:
    """Blocks a KV cache budget buys: ``available_memory // page_size //
    num_layers``, one page per block in each of ``num_layers`` tensors. With
    one KV cache group that is every layer; with several, vLLM passes the
    largest group's layer count, because layer i of every group shares one
    tensor (each group's own block table keeps their blocks apart).
    ``num_gpu_blocks_override`` (vLLM's ``--num-gpu-blocks-override``) replaces
    the answer. The null block is one of the blocks counted."""
    if num_layers <= 0 or page_size <= 0:
        raise ValueError(f"num_layers ({num_layers}) and page_size ({page_size}) "
                         "must be positive")
    if num_gpu_blocks_override is not None:
        return num_gpu_blocks_override
    return max(int(available_memory // page_size // num_layers), 0)


def get_uniform_page_size(kv_cache_specs: Iterable[KVCacheSpec]) -> int:
    """The one page size shared by these specs; ``ValueError`` if they differ
    (vLLM pads pages to one size before groups share a pool)."""
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    if len(page_sizes) != 1:
        raise ValueError(f"KV cache specs must share one page size, got "
                         f"{sorted(page_sizes)} bytes")
    return page_sizes.pop()


def max_memory_usage_bytes(kv_cache_specs: Iterable[KVCacheSpec], *, max_model_len: int,
                           max_num_batched_tokens: int | None = None,
                           max_num_encoder_input_tokens: int | None = None) -> int:
    """Bytes one request needs at its peak, summed over ``kv_cache_specs``
    (one spec per layer gives the whole model; one per group gives one layer
    of each group). Each spec answers ``spec.max_memory_usage_bytes``."""
    return sum(spec.max_memory_usage_bytes(
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens)
        for spec in kv_cache_specs)


def get_max_concurrency_for_kv_cache_config(kv_cache_config: KVCacheConfig, *,
                                            max_model_len: int,
                                            max_num_batched_tokens: int | None = None,
                                            max_num_encoder_input_tokens: int | None = None
                                            ) -> float:
    """How many requests of ``max_model_len`` tokens the pool holds at once
    (the "Maximum concurrency" vLLM logs at startup).

    Blocks per request = one layer's peak bytes summed over the groups,
    divided by one page (group 0's page size; vLLM gives every group the same);
    the answer is ``num_blocks`` over that, a float. Like vLLM it divides all
    of ``num_blocks``, the null block included, and assumes no prefix sharing
    (shared prefixes let more requests fit).

        full attention, block 16, max_model_len 8192  -> 512 blocks a request
        + sliding window 1024, batch 2048             -> +193 blocks
        4096 blocks / 705                              -> 5.81 requests
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("the KV cache config has no groups; nothing holds blocks")
    # Every group's tensor serves this many layers (vLLM's group size).
    num_layer_per_group = max(len(group.layer_names) for group in groups)
    max_memory_usage_per_request = num_layer_per_group * max_memory_usage_bytes(
        (group.kv_cache_spec for group in groups), max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens)
    memory_per_block = groups[0].kv_cache_spec.page_size_bytes * num_layer_per_group
    num_block_per_request = cdiv(max_memory_usage_per_request, memory_per_block)
    return kv_cache_config.num_blocks / num_block_per_request


def estimate_max_model_len(kv_cache_specs: Iterable[KVCacheSpec], available_memory: int, *,
                           max_model_len: int, max_num_batched_tokens: int | None = None,
                           max_num_encoder_input_tokens: int | None = None) -> int:
    """The longest sequence (at most ``max_model_len``) whose peak, summed over
    ``kv_cache_specs`` (one per layer), fits in ``available_memory`` bytes;
    0 if not even one token fits. A binary search, as in vLLM, which suggests
    this number when the configured ``max_model_len`` does not fit."""
    specs = list(kv_cache_specs)

    def fits(model_len: int) -> bool:
        return max_memory_usage_bytes(
            specs, max_model_len=model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens) <= available_memory

    if not fits(1):
        return 0
    low, high = 1, max_model_len      # fits(low) holds throughout
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


__all__ = [
    "NONE_HASH", "BlockHashListWithBlockSize", "FreeKVCacheBlockQueue", "KVCacheBlock",
    "estimate_max_model_len", "generate_block_hash_extra_keys", "get_block_hash",
    "get_group_id", "get_max_concurrency_for_kv_cache_config", "get_num_blocks",
    "get_request_block_hasher", "get_uniform_page_size", "hash_block_tokens",
    "init_none_hash", "make_block_hash_with_group_id", "max_memory_usage_bytes",
    "maybe_convert_block_hash", "need_extra_keys", "sha256", "sha256_cbor",
]
