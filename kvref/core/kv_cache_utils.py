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

import copy
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NewType

from kvref.hashing import sha256, sha256_cbor
from kvref.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    get_dtype_size,
)
from kvref.kv_cache_spec_registry import KVCacheSpecRegistry
from kvref.math_utils import cdiv
from kvref.request import Request

# A block hash is the 32 bytes a hash function returns. In the pool's index it
# is followed by 4 big-endian bytes of the KV cache group id, so that groups
# sharing one pool never hit each other's blocks. Two NewTypes, as in vLLM: both
# are bytes at run time, but a type checker tells the pool's key from a hash.
BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
# A hash as KV events carry it: the bytes, or their low 64 bits as an int.
ExternalBlockHash = bytes | int

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
    # Prefix length the hash covers: a block boundary for a full block, a
    # point inside the block for a partial entry (``BlockPool.cache_partial_block``).
    _block_hash_num_tokens: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    # The placeholder block 0: stands in for blocks a request no longer needs.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId,
                       num_tokens: int | None = None) -> None:
        if self._block_hash is not None:
            raise RuntimeError(f"block {self.block_id} is already cached; "
                               "reset its hash before caching it again")
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None

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
        self._insert_after(self.fake_free_list_tail.prev_free_block, [block], check=True)

    def append_n(self, blocks: Sequence[KVCacheBlock], check: bool = True) -> None:
        """Put blocks at the tail, keeping their order. O(len(blocks)).

        ``check``: ``RuntimeError``, queue unchanged, if a block is queued
        already. ``BlockPool.free_blocks`` passes False: the blocks it queues
        were held until that call, and a held block is never queued (INV-QUEUE-4).
        """
        self._insert_after(self.fake_free_list_tail.prev_free_block, blocks, check)

    def prepend_n(self, blocks: Sequence[KVCacheBlock], check: bool = True) -> None:
        """Put blocks at the head, keeping their order. O(len(blocks)).
        ``check`` as in ``append_n``."""
        self._insert_after(self.fake_free_list_head, blocks, check)

    def _insert_after(self, anchor: KVCacheBlock, blocks: Sequence[KVCacheBlock],
                      check: bool) -> None:
        if not blocks:
            return
        if check:
            # Every block before linking any: a failure leaves the queue intact.
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
    """Whether any block of this request hashes LoRA, multimodal or salt keys
    (vLLM's test; prompt embeddings are the fourth source: ``has_extra_keys``)."""
    return bool(request.mm_features) or request.lora_request is not None \
        or request.cache_salt is not None


def has_extra_keys(request: Request) -> bool:
    """Whether ``generate_block_hash_extra_keys`` can give anything but None for
    some block of this request (kvref only: the hasher and the events skip the
    per-block call for the rest, which is most requests)."""
    return need_extra_keys(request) or getattr(request, "prompt_embeds", None) is not None


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


# torch.uint8, taken from the first tensor hashed (see tensor_data).
_UINT8_DTYPE = None


def tensor_data(tensor: Any) -> memoryview:
    """The bytes of a tensor, flattened, on the CPU (for hashing), as vLLM
    reads them: the elements reinterpreted as uint8. The core never imports
    torch, so the uint8 dtype comes from the first tensor itself, once (asking
    every block's tensor cost two tensor allocations per block hash)."""
    global _UINT8_DTYPE
    flat = tensor.flatten().cpu().contiguous()
    if _UINT8_DTYPE is None:
        _UINT8_DTYPE = flat.new_empty(0).byte().dtype
    return flat.view(_UINT8_DTYPE).numpy().data


def _prompt_embeds_extra_keys(request, start: int, end: int) -> list[bytes]:
    """``[sha256 of the embeddings of block [start, end)]`` when the request has
    prompt embeddings (cached on the request per block), else ``[]``."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return []
    cache = getattr(request, "_prompt_embeds_per_block_hashes", None)
    if cache is None:
        cache = {}
    key = (start, end)
    if key not in cache:
        cache[key] = hashlib.sha256(tensor_data(embeds[start:end])).digest()
    return [cache[key]]


def generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int,
                                   start_mm_idx: int) -> tuple[tuple | None, int]:
    """Extra keys of the block ``[start_token_idx, end_token_idx)``, in vLLM's
    order: LoRA name, multimodal items, cache salt (first block only), the
    hash of the block's prompt embeddings (if the request has them).
    Returns ``(keys or None, next multimodal index)``."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx,
                                          start_mm_idx)
    keys: list = []
    if request.lora_request:
        keys.append(request.lora_request.lora_name)
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    keys.extend(_prompt_embeds_extra_keys(request, start_token_idx, end_token_idx))
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
        num_tokens = request.num_tokens
        if start + hash_block_size > num_tokens:
            return []  # no block completed since the last call: most decode steps
        # Blocks completed later by output tokens consider only the last item.
        mm_idx = 0 if start == 0 else -1
        # A request with none of the four sources of extra keys hashes None for
        # every block.
        plain = not has_extra_keys(request)
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            extra_keys = None
            if not plain:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(caching_hash_fn, parent, tokens[start:end], extra_keys)
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
# Each function has two forms. vLLM's takes its ``VllmConfig`` first and reads
# ``max_model_len`` (``model_config``), ``max_num_batched_tokens`` and
# ``max_num_encoder_input_tokens`` (``scheduler_config``),
# ``num_gpu_blocks_override`` and ``mamba_cache_mode`` (``cache_config``) from
# it; kvref's takes those numbers as keyword arguments. Any object with those
# attributes serves as a config (``capacity_config`` builds a small one).


def _is_config(obj: object) -> bool:
    """Whether ``obj`` is a vLLM-style config (the first argument of vLLM's forms)."""
    return hasattr(obj, "model_config") and hasattr(obj, "scheduler_config")


def capacity_config(max_model_len: int, *, max_num_batched_tokens: int | None = None,
                    max_num_encoder_input_tokens: int | None = None,
                    num_gpu_blocks_override: int | None = None,
                    mamba_cache_mode: str = "none",
                    disable_hybrid_kv_cache_manager: bool = False) -> Any:
    """A config with the attributes of vLLM's ``VllmConfig`` that the KV cache
    config builder reads, for use without vLLM:

        >>> cfg = capacity_config(4096, max_num_batched_tokens=512)
        >>> cfg.model_config.max_model_len, cfg.scheduler_config.max_num_batched_tokens
        (4096, 512)
    """
    from types import SimpleNamespace as NS

    return NS(
        model_config=NS(max_model_len=max_model_len, original_max_model_len=max_model_len),
        scheduler_config=NS(
            max_num_batched_tokens=(max_model_len if max_num_batched_tokens is None
                                    else max_num_batched_tokens),
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager),
        cache_config=NS(num_gpu_blocks_override=num_gpu_blocks_override,
                        mamba_cache_mode=mamba_cache_mode),
        parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_transfer_config=None, speculative_config=None)


def may_override_num_blocks(vllm_config: Any, num_blocks: int) -> int:
    """``num_blocks``, or ``cache_config.num_gpu_blocks_override`` when set."""
    override = vllm_config.cache_config.num_gpu_blocks_override
    return num_blocks if override is None else override


def get_num_blocks(*args: Any, num_layers: int | None = None,
                   available_memory: int | None = None, page_size: int | None = None,
                   num_gpu_blocks_override: int | None = None) -> int:
    """Blocks a KV cache budget buys: ``available_memory // page_size //
    num_layers``, one page per block in each of ``num_layers`` tensors. With
    one KV cache group that is every layer; with several, vLLM passes the
    largest group's layer count, because layer i of every group shares one
    tensor (each group's own block table keeps their blocks apart).
    ``num_gpu_blocks_override`` (vLLM's ``--num-gpu-blocks-override``) replaces
    the answer. The null block is one of the blocks counted.

    ``get_num_blocks(num_layers, available_memory, page_size)`` (kvref) or
    ``get_num_blocks(vllm_config, num_layers, available_memory, page_size)``
    (vLLM, the override read from the config).
    """
    if args and _is_config(args[0]):
        vllm_config, *args = args
        num_gpu_blocks_override = vllm_config.cache_config.num_gpu_blocks_override
    given = dict(zip(("num_layers", "available_memory", "page_size"), args))
    num_layers = given.get("num_layers", num_layers)
    available_memory = given.get("available_memory", available_memory)
    page_size = given.get("page_size", page_size)
    if len(args) > 3 or None in (num_layers, available_memory, page_size):
        raise TypeError("get_num_blocks takes num_layers, available_memory and page_size "
                        "(after a vLLM config, in vLLM's form)")
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


def max_memory_usage_bytes(*args: Any, max_model_len: int | None = None,
                           max_num_batched_tokens: int | None = None,
                           max_num_encoder_input_tokens: int | None = None) -> int:
    """Bytes one request needs at its peak, summed over the specs (one spec per
    layer gives the whole model; one per group gives one layer of each group).
    Each spec answers ``spec.max_memory_usage_bytes``.

    ``max_memory_usage_bytes(specs, max_model_len=...)`` (kvref) or
    ``max_memory_usage_bytes(vllm_config, specs)`` (vLLM).
    """
    if args and _is_config(args[0]):
        vllm_config, specs = args
        return sum(spec.max_memory_usage_bytes(vllm_config) for spec in specs)
    (specs,) = args
    return sum(spec.max_memory_usage_bytes(
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens)
        for spec in specs)


def get_max_concurrency_for_kv_cache_config(*args: Any, max_model_len: int | None = None,
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

    ``get_max_concurrency_for_kv_cache_config(config, max_model_len=...)``
    (kvref) or ``get_max_concurrency_for_kv_cache_config(vllm_config, config)``
    (vLLM).
    """
    if args and _is_config(args[0]):
        vllm_config, kv_cache_config = args

        def peak(specs):
            return max_memory_usage_bytes(vllm_config, specs)
    else:
        (kv_cache_config,) = args

        def peak(specs):
            return max_memory_usage_bytes(
                specs, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_encoder_input_tokens=max_num_encoder_input_tokens)
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("the KV cache config has no groups; nothing holds blocks")
    # Every group's tensor serves this many layers (vLLM's group size).
    num_layer_per_group = max(len(group.layer_names) for group in groups)
    max_memory_usage_per_request = num_layer_per_group * peak(
        [group.kv_cache_spec for group in groups])
    memory_per_block = groups[0].kv_cache_spec.page_size_bytes * num_layer_per_group
    num_block_per_request = cdiv(max_memory_usage_per_request, memory_per_block)
    return kv_cache_config.num_blocks / num_block_per_request


def get_kv_cache_capacity(vllm_config: Any, kv_cache_config: KVCacheConfig
                          ) -> tuple[int, float]:
    """``(tokens, concurrency)``: the "GPU KV cache size" vLLM logs (the
    concurrency times ``max_model_len``) and the concurrency itself."""
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    return int(concurrency * vllm_config.model_config.max_model_len), concurrency


def _binary_search_max_len(fits: Callable[[int], bool], max_model_len: int) -> int:
    """The largest length in ``1..max_model_len`` that ``fits``; 0 if none."""
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


class _MaxModelLenSetTo:
    """Set ``vllm_config.model_config.max_model_len`` for a while (vLLM's
    searches try lengths by setting it); the old value comes back after."""

    def __init__(self, vllm_config: Any) -> None:
        self.model_config = vllm_config.model_config
        self.original = self.model_config.max_model_len

    def fits_with(self, needed: Callable[[], int], available: int) -> Callable[[int], bool]:
        def fits(model_len: int) -> bool:
            self.model_config.max_model_len = model_len
            return needed() <= available
        return fits

    def __enter__(self) -> _MaxModelLenSetTo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.model_config.max_model_len = self.original


def estimate_max_model_len(*args: Any, max_model_len: int | None = None,
                           max_num_batched_tokens: int | None = None,
                           max_num_encoder_input_tokens: int | None = None) -> int:
    """The longest sequence (at most ``max_model_len``) whose peak, summed over
    the specs (one per layer), fits in ``available_memory`` bytes; 0 if not
    even one token fits. A binary search, as in vLLM, which suggests this
    number when the configured ``max_model_len`` does not fit.

    ``estimate_max_model_len(specs, available_memory, max_model_len=...)``
    (kvref) or ``estimate_max_model_len(vllm_config, {layer: spec},
    available_memory)`` (vLLM; the config's ``max_model_len`` is the upper end
    and is left as it was).
    """
    if args and _is_config(args[0]):
        vllm_config, kv_cache_spec, available_memory = args
        specs = list(kv_cache_spec.values())
        with _MaxModelLenSetTo(vllm_config) as trial:
            return _binary_search_max_len(
                trial.fits_with(lambda: max_memory_usage_bytes(vllm_config, specs),
                                available_memory), trial.original)
    kv_cache_specs, available_memory = args
    specs = list(kv_cache_specs)

    def fits(model_len: int) -> bool:
        return max_memory_usage_bytes(
            specs, max_model_len=model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens) <= available_memory

    return _binary_search_max_len(fits, max_model_len)


def _format_gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f}"


def _check_enough_kv_cache_memory(available_memory: int, get_needed_memory: Callable[[], int],
                                  max_model_len: int,
                                  estimate: Callable[[int], int]) -> None:
    """``ValueError`` unless ``available_memory`` holds one request of
    ``max_model_len`` tokens; the message suggests the length that fits."""
    if available_memory <= 0:
        raise ValueError("No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine.")
    needed = get_needed_memory()
    if needed <= available_memory:
        return
    fitting = estimate(available_memory)
    hint = (f"Based on the available memory, the estimated maximum model length is "
            f"{fitting}. " if fitting > 0 else "")
    raise ValueError(f"To serve at least one request with the model's max seq len "
                     f"({max_model_len}), ({_format_gib(needed)} GiB KV cache is needed, "
                     f"which is larger than the available KV cache memory "
                     f"({_format_gib(available_memory)} GiB). {hint}Try increasing "
                     "`gpu_memory_utilization` or decreasing `max_model_len` when "
                     "initializing the engine.")


def check_enough_kv_cache_memory(vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec],
                                 available_memory: int) -> None:
    """``ValueError`` unless one request of ``max_model_len`` fits, summing
    every layer's peak (no check for a model without KV cache)."""
    if not kv_cache_spec:
        return
    _check_enough_kv_cache_memory(
        available_memory,
        lambda: max_memory_usage_bytes(vllm_config, kv_cache_spec.values()),
        vllm_config.model_config.max_model_len,
        lambda memory: estimate_max_model_len(vllm_config, kv_cache_spec, memory))


# --------------------------------------------------------------------------
# From per-layer specs to the KV cache config: groups, then tensors
#
# The model runner reports one spec per attention layer, ``{layer name: spec}``.
# ``get_kv_cache_configs`` turns that into the ``KVCacheConfig`` every lesson
# starts from, in two steps:
#
# 1. Groups (``get_kv_cache_groups``). Layers share a block table when they
#    need the same blocks. All specs equal: one group of every layer. One
#    attention type with different page sizes (MLA heads of two sizes): one
#    group of ``UniformTypeKVCacheSpecs``. Several types (full attention and a
#    window): pages are first made one size (``unify_kv_cache_spec_page_size``),
#    then each type's layers are cut into groups of one common size, so that
#    layer i of every group can share one tensor::
#
#        10 full + 20 window layers, group size 10:
#        (full.0 .. full.9)  (sw.0, sw.2, .. sw.18)  (sw.1, sw.3, .. sw.19)
#
# 2. Tensors (``get_kv_cache_config_from_groups``). With ``group_size`` layers
#    per group there are ``group_size`` tensors, tensor i shared by layer i of
#    every group; the budget buys ``available // page // group_size`` blocks.
#    The groups' own block tables keep their blocks apart in the shared tensor.


def create_kv_cache_group_specs(kv_cache_spec: dict[str, KVCacheSpec],
                                grouped_layer_names: list[list[str]]) -> list[KVCacheGroupSpec]:
    """One group per list of layer names, its spec the merge of its layers'."""
    groups = []
    for layer_names in grouped_layer_names:
        specs = [kv_cache_spec[name] for name in layer_names]
        groups.append(KVCacheGroupSpec(layer_names, specs[0].merge(specs)))
    return groups


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether every layer's spec merges into one (full attention with and
    without a remembered window counts as one type). No layers: uniform."""
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except AssertionError:
        return False
    return True


def is_kv_cache_page_size_uniform(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """Whether every layer's page has the same size."""
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def is_kv_cache_type_attention_free(kv_cache_spec: dict[str, KVCacheSpec]) -> bool:
    """A model without attention layers reports no specs at all."""
    return not kv_cache_spec


def unify_kv_cache_spec_page_size(kv_cache_spec: dict[str, KVCacheSpec]
                                  ) -> dict[str, KVCacheSpec]:
    """Give every layer the largest page size, so one pool serves all groups.

    A smaller page that divides the largest grows by a larger ``block_size``
    (more tokens per block, same bytes per token). One that does not divide
    it is padded (``page_size_padded``), which only layers whose backend reads
    pages by a stride allow (``indexes_kv_by_block_stride``); any other layer
    raises ``NotImplementedError``. Returns the input itself when the sizes
    already agree.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec
    largest = max(page_sizes)
    unified = {}
    for name, spec in kv_cache_spec.items():
        page = spec.page_size_bytes
        if page == largest:
            new_spec = spec
        elif largest % page == 0:
            new_spec = replace(spec, block_size=spec.block_size * (largest // page))
        elif isinstance(spec, AttentionSpec) and spec.indexes_kv_by_block_stride:
            new_spec = replace(spec, page_size_padded=largest)
        else:
            raise NotImplementedError(
                f"Layer {name}: page size {page} does not divide the largest page "
                f"size {largest} and cannot be padded (only attention layers whose "
                "backend indexes pages by the block stride, "
                "indexes_kv_by_block_stride=True, can be padded)")
        if new_spec.page_size_bytes != largest:
            raise NotImplementedError(f"Layer {name}: cannot give its page "
                                      f"{largest} bytes")
        unified[name] = new_spec
    return unified


def _get_kv_cache_groups_uniform_spec(kv_cache_specs: dict[str, KVCacheSpec]
                                      ) -> list[KVCacheGroupSpec]:
    """Every layer has the same spec: one group of all of them."""
    return create_kv_cache_group_specs(kv_cache_specs, [list(kv_cache_specs)])


def _get_kv_cache_groups_uniform_type(spec: UniformTypeKVCacheSpecs) -> list[KVCacheGroupSpec]:
    """One attention type, different page sizes: one group, one spec per layer."""
    return [KVCacheGroupSpec(list(spec.kv_cache_specs), spec)]


def _get_kv_cache_groups_uniform_page_size(kv_cache_spec: dict[str, KVCacheSpec]
                                           ) -> list[KVCacheGroupSpec]:
    """Groups for several attention types whose pages are one size.

    Layers are first collected by equal spec. The group size is the smallest
    type's layer count (models repeat an n:1 pattern, e.g. 5 window layers per
    full layer), or the largest count when the counts are within 1.5x of each
    other (12 window + 13 full layers: two groups of 13, not one of 12 and two
    of 12 for 24 full layers). A type's layers are dealt round-robin into
    ``cdiv(count, group_size)`` groups, ``layers[i::n]``, so that pipeline
    stages holding consecutive layers get balanced groups; a short last group
    is padded (its tensor slot is allocated but unused; vLLM logs the waste).
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        by_spec.setdefault(spec, []).append(name)
    counts = [len(names) for names in by_spec.values()]
    group_size = min(counts)
    if max(counts) < min(counts) * 1.5:
        group_size = max(counts)
    grouped: list[list[str]] = []
    for names in by_spec.values():
        num_groups = cdiv(len(names), group_size)
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(kv_cache_spec, grouped)


def unify_hybrid_kv_cache_specs(kv_cache_spec: dict[str, KVCacheSpec]) -> None:
    """With the hybrid allocator off (``disable_hybrid_kv_cache_manager``), make
    one group possible: window and chunked-local layers become full attention
    that remembers its window (blocks are kept for every token; the kernels
    still compute only the window). Changes ``kv_cache_spec`` in place;
    ``ValueError`` if the specs still do not form one type (Mamba, say).
    """
    if is_kv_cache_spec_uniform(kv_cache_spec) or \
            UniformTypeKVCacheSpecs.is_uniform_type(kv_cache_spec):
        return
    specs = list(kv_cache_spec.values())
    has_full = any(isinstance(s, FullAttentionSpec) for s in specs)
    has_local = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec))
                    for s in specs)
    # DeepSeek-V4 mixes block sizes across its groups: its window-MLA layers
    # take the full MLA layers' block size when they become full attention.
    full_block_size = None
    if any(isinstance(s, SlidingWindowMLASpec) for s in specs):
        if not has_full:
            raise ValueError("window-MLA layers without full-attention layers cannot "
                             "be unified")
        full_block_size = next(s for s in specs if isinstance(s, FullAttentionSpec)).block_size
    if has_full and has_local:
        for name, spec in kv_cache_spec.items():
            if isinstance(spec, SlidingWindowMLASpec):
                kv_cache_spec[name] = MLAAttentionSpec(
                    block_size=full_block_size or spec.block_size,
                    num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                    dtype=spec.dtype, page_size_padded=spec.page_size_padded,
                    cache_dtype_str=spec.cache_dtype_str, alignment=spec.alignment,
                    compress_ratio=spec.compress_ratio, model_version=spec.model_version)
            elif isinstance(spec, SlidingWindowSpec):
                kv_cache_spec[name] = FullAttentionSpec(
                    block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, head_size_v=spec.head_size_v,
                    dtype=spec.dtype, sliding_window=spec.sliding_window,
                    page_size_padded=spec.page_size_padded)
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                kv_cache_spec[name] = FullAttentionSpec(
                    block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                    head_size=spec.head_size, dtype=spec.dtype,
                    attention_chunk_size=spec.attention_chunk_size,
                    page_size_padded=spec.page_size_padded)
    if not (is_kv_cache_spec_uniform(kv_cache_spec)
            or UniformTypeKVCacheSpecs.is_uniform_type(kv_cache_spec)):
        raise ValueError("Hybrid KV cache manager is disabled but failed to convert "
                         "the KV cache specs to one unified type.")


# -- DeepSeek-V4: full MLA layers plus window-MLA layers of several kinds ----------


def group_and_unify_kv_cache_specs(kv_cache_spec: dict[str, KVCacheSpec]
                                   ) -> list[UniformTypeKVCacheSpecs] | None:
    """For models with window-MLA layers (DeepSeek-V4): the full MLA layers as
    one ``UniformTypeKVCacheSpecs``, then one per ``(block_size, window)`` of
    the window-MLA layers. None for any other model."""
    if not any(isinstance(s, SlidingWindowMLASpec) for s in kv_cache_spec.values()):
        return None
    full_mla: dict[str, KVCacheSpec] = {}
    windows: dict[tuple[int, int], dict[str, KVCacheSpec]] = {}
    for name, spec in kv_cache_spec.items():
        if isinstance(spec, SlidingWindowMLASpec):
            windows.setdefault((spec.block_size, spec.sliding_window), {})[name] = spec
        elif isinstance(spec, MLAAttentionSpec):
            full_mla[name] = spec
    if not full_mla:
        raise ValueError("window-MLA layers need full MLA layers beside them")
    uniform = [UniformTypeKVCacheSpecs.from_specs(full_mla)]
    uniform += [UniformTypeKVCacheSpecs.from_specs(specs) for specs in windows.values()]
    if any(u is None for u in uniform):
        raise ValueError("MLA layers of one kind must form one uniform group")
    return uniform


def _approximate_gcd(values: Sequence[int], *, lower_bound: int | None = None) -> int:
    """The divisor ``d >= lower_bound`` that pads ``values`` up to multiples of
    ``d`` the least (ties: the larger ``d``); tried one by one up to
    ``max(values)``."""
    if not values:
        raise ValueError("values must be non-empty")
    if any(v <= 0 for v in values):
        raise ValueError(f"values must be positive, got: {list(values)!r}")
    low = max(1, lower_bound or 1)
    if low > max(values):
        return low
    best, best_padding = low, None
    for d in range(low, max(values) + 1):
        padding = sum(-v % d for v in values)
        if best_padding is None or padding <= best_padding:
            best, best_padding = d, padding
    return best


def _get_kv_cache_groups_uniform_groups(grouped_specs: list[UniformTypeKVCacheSpecs]
                                        ) -> list[KVCacheGroupSpec]:
    """Groups for DeepSeek-V4 from ``group_and_unify_kv_cache_specs``.

    A *layer tuple* is one layer of each page size. The full MLA group keeps
    all its tuples; each window kind is cut into groups of about as many
    tuples (``_approximate_gcd`` picks the count that pads least), its pages
    padded up to the nearest full-MLA page size so that slots line up.
    """
    full, *window_kinds = grouped_specs
    if not all(isinstance(s, MLAAttentionSpec) for s in full.kv_cache_specs.values()):
        raise ValueError("the first uniform group must hold only MLA layers")
    groups = [KVCacheGroupSpec(list(full.kv_cache_specs), full)]
    tuple_counts = [spec.get_num_layer_tuples() for spec in grouped_specs]
    num_tuples = _approximate_gcd(tuple_counts, lower_bound=tuple_counts[0])
    full_pages = full.get_page_sizes()
    for kind in window_kinds:
        if max(kind.get_page_sizes()) > max(full_pages):
            raise ValueError("a window-MLA page is larger than every full MLA page")
        by_page: dict[int, list[str]] = {}
        for name, spec in kind.kv_cache_specs.items():
            page = spec.page_size_bytes
            target = min(p for p in full_pages if p >= page)
            if page < target:
                # The spec objects are shared with the caller's dict, as in vLLM.
                object.__setattr__(spec, "page_size_padded", target)
            by_page.setdefault(target, []).append(name)
        if len({len(names) for names in by_page.values()}) != 1:
            raise ValueError("each page size of a window-MLA kind needs as many layers")
        layer_tuples = list(zip(*by_page.values()))
        num_groups = cdiv(len(layer_tuples), num_tuples)
        for i in range(num_groups):
            names = [name for layer_tuple in layer_tuples[i::num_groups]
                     for name in layer_tuple]
            sub = UniformTypeKVCacheSpecs.from_specs(
                {name: kind.kv_cache_specs[name] for name in names})
            groups.append(KVCacheGroupSpec(names, sub))
    return groups


def _annotate_eagle_groups_deepseek_v4(vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec],
                                       kv_cache_groups: list[KVCacheGroupSpec]) -> None:
    """With EAGLE/MTP on a DeepSeek-V4 model, flag the group holding the last
    layer (its MTP layer) as the EAGLE group."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None or not spec_config.use_eagle():
        return
    if not any(getattr(s, "model_version", None) == "deepseek_v4"
               for s in kv_cache_spec.values()):
        return
    last_layer = list(kv_cache_spec)[-1]
    for group in kv_cache_groups:
        if last_layer in group.layer_names:
            group.is_eagle_group = True
            return


def get_kv_cache_groups(vllm_config: Any, kv_cache_spec: dict[str, KVCacheSpec]
                        ) -> list[KVCacheGroupSpec]:
    """Cut the model's layers into KV cache groups (step 1 above).

    In order: the hybrid allocator off makes one type first
    (``unify_hybrid_kv_cache_specs``, in place); no layers, no groups; equal
    specs, one group; one type of several page sizes, one uniform group;
    DeepSeek-V4's MLA kinds; otherwise pages are unified and layers grouped by
    spec. Hidden-state layers sit out of that last step and come back as one
    group each, their block size chosen to fill the common page.
    """
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if is_kv_cache_type_attention_free(kv_cache_spec):
        return []
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return _get_kv_cache_groups_uniform_spec(kv_cache_spec)
    uniform = UniformTypeKVCacheSpecs.from_specs(kv_cache_spec)
    if uniform is not None:
        return _get_kv_cache_groups_uniform_type(uniform)
    grouped = group_and_unify_kv_cache_specs(kv_cache_spec)
    if grouped:
        groups = _get_kv_cache_groups_uniform_groups(grouped)
        _annotate_eagle_groups_deepseek_v4(vllm_config, kv_cache_spec, groups)
        return groups
    hidden = {n: s for n, s in kv_cache_spec.items() if isinstance(s, HiddenStateCacheSpec)}
    others = {n: s for n, s in kv_cache_spec.items() if n not in hidden}
    groups = _get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(others))
    if hidden:
        common_page = get_uniform_page_size(g.kv_cache_spec for g in groups)
        for name, spec in hidden.items():
            bytes_per_token = spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype)
            fitted = replace(spec, block_size=max(common_page // bytes_per_token, 1),
                             page_size_padded=common_page)
            groups.append(KVCacheGroupSpec([name], fitted))
    return groups


# -- step 2: tensors and the number of blocks ---------------------------------------


def _bucket_layers_by_page_size(kv_cache_groups: list[KVCacheGroupSpec]
                                ) -> dict[int, list[list[str]]]:
    """``{page size: [slot 0 layers, slot 1 layers, ...]}``: the i-th layer of
    each page size in every group lands in slot i of that size, and the layers
    of one slot share a tensor."""
    buckets: dict[int, list[list[str]]] = {}
    for group in kv_cache_groups:
        spec = group.kv_cache_spec
        seen: dict[int, int] = {}
        for name in group.layer_names:
            page = (spec.kv_cache_specs[name].page_size_bytes
                    if isinstance(spec, UniformTypeKVCacheSpecs) else spec.page_size_bytes)
            slot = seen.get(page, 0)
            seen[page] = slot + 1
            slots = buckets.setdefault(page, [])
            if slot == len(slots):
                slots.append([])
            slots[slot].append(name)
    return buckets


def _use_packed_kv_cache_config(vllm_config: Any, kv_cache_groups: list[KVCacheGroupSpec]
                                ) -> bool:
    """Packed layout: every group a ``UniformTypeKVCacheSpecs`` (DeepSeek-V4),
    or several groups with the connector option ``enable_cross_layers_blocks``."""
    if all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in kv_cache_groups):
        return True
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = transfer.kv_connector_extra_config if transfer is not None else {}
    cross_layers = str(extra.get("enable_cross_layers_blocks", "False")).lower() == "true"
    return cross_layers and len(kv_cache_groups) > 1


def _get_kv_cache_config_packed(vllm_config: Any, kv_cache_groups: list[KVCacheGroupSpec],
                                available_memory: int) -> tuple[int, list[KVCacheTensor]]:
    """``(num_blocks, tensors)`` for the packed layout: one block holds a page
    of every slot side by side, ``block_stride`` bytes in all; each slot's
    tensor is a view of the one allocation starting ``offset`` bytes in::

        block 0: [slot a | slot b | slot c][block 1: slot a | ...] ...
                  ^offset 0 ^offset |a|      stride = |a| + |b| + |c|
    """
    buckets = _bucket_layers_by_page_size(kv_cache_groups)
    stride = sum(page * len(slots) for page, slots in buckets.items())
    num_blocks = may_override_num_blocks(vllm_config, available_memory // stride)
    tensors, offset = [], 0
    for page, slots in buckets.items():
        for layers in slots:
            tensors.append(KVCacheTensor(size=stride * num_blocks, shared_by=layers,
                                         offset=offset, block_stride=stride))
            offset += page
    return num_blocks, tensors


def _pool_bytes_per_block(vllm_config: Any, kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs across all tensors (the divisor
    ``get_kv_cache_config_from_groups`` turns a budget into blocks with)."""
    if len(kv_cache_groups) == 1 and isinstance(kv_cache_groups[0].kv_cache_spec,
                                                UniformTypeKVCacheSpecs):
        return kv_cache_groups[0].kv_cache_spec.page_size_bytes
    if _use_packed_kv_cache_config(vllm_config, kv_cache_groups):
        buckets = _bucket_layers_by_page_size(kv_cache_groups)
        return sum(page * len(slots) for page, slots in buckets.items())
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    return get_uniform_page_size(g.kv_cache_spec for g in kv_cache_groups) * group_size


def get_kv_cache_config_from_groups(vllm_config: Any, kv_cache_groups: list[KVCacheGroupSpec],
                                    available_memory: int) -> KVCacheConfig:
    """The config for these groups and ``available_memory`` bytes (step 2).

    - No groups (no attention): one block, the pool's null block.
    - One uniform-type group: a tensor per layer of its own page size; the
      budget over the sum of the pages gives the blocks.
    - Packed layout: ``_get_kv_cache_config_packed``.
    - Otherwise ``group_size`` tensors, tensor i shared by layer i of each
      group, ``num_blocks = available // page // group_size``.

        >>> from kvref import FullAttentionSpec, SlidingWindowSpec
        >>> full, sw = FullAttentionSpec(16), SlidingWindowSpec(16, 64)
        >>> groups = [KVCacheGroupSpec(["f0", "f1"], full), KVCacheGroupSpec(["s0", "s1"], sw)]
        >>> cfg = get_kv_cache_config_from_groups(capacity_config(1024), groups,
        ...                                       2 * 100 * full.page_size_bytes)
        >>> cfg.num_blocks, [t.shared_by for t in cfg.kv_cache_tensors]
        (100, [['f0', 's0'], ['f1', 's1']])
    """
    if not kv_cache_groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    first = kv_cache_groups[0].kv_cache_spec
    if len(kv_cache_groups) == 1 and isinstance(first, UniformTypeKVCacheSpecs):
        num_blocks = may_override_num_blocks(vllm_config,
                                             available_memory // first.page_size_bytes)
        tensors = [KVCacheTensor(size=first.kv_cache_specs[name].page_size_bytes * num_blocks,
                                 shared_by=[name])
                   for name in kv_cache_groups[0].layer_names]
    elif _use_packed_kv_cache_config(vllm_config, kv_cache_groups):
        num_blocks, tensors = _get_kv_cache_config_packed(vllm_config, kv_cache_groups,
                                                          available_memory)
    else:
        group_size = max(len(g.layer_names) for g in kv_cache_groups)
        page_size = get_uniform_page_size(g.kv_cache_spec for g in kv_cache_groups)
        num_blocks = get_num_blocks(vllm_config, group_size, available_memory, page_size)
        tensors = [KVCacheTensor(size=page_size * num_blocks,
                                 shared_by=[g.layer_names[i] for g in kv_cache_groups
                                            if i < len(g.layer_names)])
                   for i in range(group_size)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=kv_cache_groups)


def _max_memory_usage_bytes_from_groups(vllm_config: Any,
                                        kv_cache_groups: list[KVCacheGroupSpec]) -> int:
    """Bytes one request of ``max_model_len`` needs once grouped, padding
    included (8 full + 9 window layers are laid out as 9 + 9)."""
    if not kv_cache_groups:
        return 0
    specs = [g.kv_cache_spec for g in kv_cache_groups]
    if len(specs) == 1 and isinstance(specs[0], UniformTypeKVCacheSpecs):
        return sum(s.max_memory_usage_bytes(vllm_config)
                   for s in specs[0].kv_cache_specs.values())
    if all(isinstance(s, UniformTypeKVCacheSpecs) for s in specs):
        # DeepSeek-V4: every group reserves the largest tuple count of slots.
        tuple_bytes = sum(specs[0].get_page_sizes())
        num_tuples = max(s.get_num_layer_tuples() for s in specs)
        return sum(num_tuples * s.max_memory_usage_pages(vllm_config) * tuple_bytes
                   for s in specs)
    group_size = max(len(g.layer_names) for g in kv_cache_groups)
    page_size = get_uniform_page_size(specs)
    blocks = sum(cdiv(s.max_memory_usage_bytes(vllm_config), page_size) for s in specs)
    return group_size * page_size * blocks


def _estimate_max_model_len_from_groups(vllm_config: Any,
                                        kv_cache_groups: list[KVCacheGroupSpec],
                                        available_memory: int) -> int:
    """The longest ``max_model_len`` (up to the config's) whose grouped peak
    fits in ``available_memory``; 0 if not even one token fits."""
    with _MaxModelLenSetTo(vllm_config) as trial:
        return _binary_search_max_len(
            trial.fits_with(lambda: _max_memory_usage_bytes_from_groups(
                vllm_config, kv_cache_groups), available_memory), trial.original)


def _auto_fit_max_model_len(vllm_config: Any,
                            projected_groups_per_worker: list[list[KVCacheGroupSpec]],
                            available_memory: list[int]) -> None:
    """``max_model_len=-1``: lower the config's ``max_model_len`` to the
    longest every worker can hold (left alone when the model's own fits)."""
    model_config = vllm_config.model_config
    if all(not groups for groups in projected_groups_per_worker):
        return
    fitting = model_config.max_model_len
    for groups, memory in zip(projected_groups_per_worker, available_memory):
        if groups:
            fitting = min(fitting, _estimate_max_model_len_from_groups(
                vllm_config, groups, memory))
    if fitting <= 0:
        raise ValueError("Cannot auto-fit max_model_len: not enough GPU memory "
                         "available to serve even a single token. Try increasing "
                         "`gpu_memory_utilization`.")
    model_config.max_model_len = fitting


def _project_kv_cache_groups_to_worker(global_kv_cache_groups: list[KVCacheGroupSpec],
                                       worker_spec: dict[str, KVCacheSpec]
                                       ) -> list[KVCacheGroupSpec]:
    """The global groups cut down to one worker's layers (pipeline stages
    hold a share of the layers); a uniform-type spec keeps only those layers.
    Every group stays, empty if the worker has none of its layers."""
    projected = []
    for group in global_kv_cache_groups:
        names = [name for name in group.layer_names if name in worker_spec]
        spec = group.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            spec = UniformTypeKVCacheSpecs(block_size=spec.block_size, kv_cache_specs={
                name: spec.kv_cache_specs[name] for name in names})
        projected.append(KVCacheGroupSpec(names, spec,
                                          is_eagle_group=group.is_eagle_group and bool(names)))
    return projected


def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: list[dict[str, KVCacheSpec]],
                         available_memory: list[int]) -> list[KVCacheConfig]:
    """One ``KVCacheConfig`` per worker, from each worker's ``{layer: spec}``
    and free bytes. One scheduler drives every worker, so the configs agree:

    1. The workers' specs are merged into the whole model's (a layer on two
       workers must have one spec); every spec class must be registered.
    2. Groups come from the whole model (``get_kv_cache_groups``) and are
       projected onto each worker's layers.
    3. ``num_gpu_blocks_override`` replaces each worker's budget by that many
       blocks; ``max_model_len=-1`` is fitted to memory; each worker must hold
       one request of ``max_model_len`` (``ValueError`` otherwise).
    4. Each worker's config is built from its groups; all then take the
       smallest worker's ``num_blocks``, their tensors shrunk to match.
    """
    merged: dict[str, KVCacheSpec] = {}
    for worker_spec in kv_cache_specs:
        for name, spec in worker_spec.items():
            if name in merged and merged[name] != spec:
                raise AssertionError(f"The KV cache specs for layer {name} are different "
                                     "across workers. This is not supported yet.")
            merged.setdefault(name, spec)
    KVCacheSpecRegistry.check_kv_cache_spec_registry(merged)
    global_groups = get_kv_cache_groups(vllm_config, merged)
    projected = [_project_kv_cache_groups_to_worker(global_groups, worker_spec)
                 for worker_spec in kv_cache_specs]

    override = vllm_config.cache_config.num_gpu_blocks_override
    if override is not None:
        available_memory = [memory if not groups
                            else override * _pool_bytes_per_block(vllm_config, groups)
                            for groups, memory in zip(projected, available_memory)]
    if vllm_config.model_config.original_max_model_len == -1:
        _auto_fit_max_model_len(vllm_config, projected, available_memory)
    for groups, memory in zip(projected, available_memory):
        if groups:
            _check_enough_kv_cache_memory(
                memory, lambda g=groups: _max_memory_usage_bytes_from_groups(vllm_config, g),
                vllm_config.model_config.max_model_len,
                lambda m, g=groups: _estimate_max_model_len_from_groups(vllm_config, g, m))

    configs = []
    for groups, worker_spec, memory in zip(projected, kv_cache_specs, available_memory):
        if sum(len(g.layer_names) for g in groups) != len(worker_spec):
            raise AssertionError("Some layers are not assigned to any group.")
        configs.append(get_kv_cache_config_from_groups(vllm_config, groups, memory))
    min_blocks = min(config.num_blocks for config in configs)
    for config in configs:
        for tensor in config.kv_cache_tensors:
            if tensor.size % config.num_blocks:
                raise AssertionError("a KV cache tensor is not whole blocks")
            tensor.size = tensor.size // config.num_blocks * min_blocks
        config.num_blocks = min_blocks
    return configs


def generate_scheduler_kv_cache_config(kv_cache_configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The config the scheduler gets: any worker's (they differ only in layer
    names), a uniform-type group's spec replaced by one of its layers' specs
    (the manager needs one attention type, not the per-layer pages)."""
    if any(c.num_blocks != kv_cache_configs[0].num_blocks for c in kv_cache_configs):
        raise AssertionError("the workers' KV cache configs have different num_blocks")
    config = copy.deepcopy(kv_cache_configs[0])
    for group in config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            group.kv_cache_spec = next(iter(group.kv_cache_spec.kv_cache_specs.values()))
    return config


def resolve_kv_cache_block_sizes(kv_cache_config: KVCacheConfig, vllm_config: Any
                                 ) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for a config.

    One group: the cache block size times the context-parallel ranks, twice.
    Several: the LCM of the groups' block sizes schedules; hashes are taken
    every ``cache_config.hash_block_size`` tokens, or the GCD of the block
    sizes, which every block size must be a multiple of. Hashing falls back to
    the scheduler block size when nothing reads hashes (no prefix caching, no
    connector) or a Mamba group has its own block size (modes other than
    ``"align"``).
    """
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    dcp, pcp = parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        size = cache_config.block_size * dcp * pcp
        return size, size
    if dcp != 1 or pcp != 1:
        raise ValueError("Hybrid KV cache groups with multiple block sizes do not "
                         "support context parallelism (dcp_world_size/pcp_world_size > 1).")
    sizes = [g.kv_cache_spec.block_size for g in groups]
    scheduler_block_size = math.lcm(*sizes)
    if not (cache_config.enable_prefix_caching
            or getattr(vllm_config, "kv_transfer_config", None) is not None):
        return scheduler_block_size, scheduler_block_size
    if any(isinstance(g.kv_cache_spec, MambaSpec)
           and g.kv_cache_spec.block_size != cache_config.block_size for g in groups):
        return scheduler_block_size, scheduler_block_size
    requested = getattr(cache_config, "hash_block_size", None)
    hash_block_size = math.gcd(*sizes) if requested is None else requested
    if any(size % hash_block_size for size in sizes):
        raise ValueError(f"Invalid hash_block_size={hash_block_size}; all KV cache group "
                         f"block sizes must be divisible by hash_block_size. Got group "
                         f"block sizes={sizes}.")
    return scheduler_block_size, hash_block_size


__all__ = [
    "NONE_HASH", "BlockHashListWithBlockSize", "ExternalBlockHash", "FreeKVCacheBlockQueue",
    "KVCacheBlock", "capacity_config", "check_enough_kv_cache_memory",
    "create_kv_cache_group_specs", "estimate_max_model_len", "generate_block_hash_extra_keys",
    "generate_scheduler_kv_cache_config", "get_block_hash", "get_group_id",
    "get_kv_cache_capacity", "get_kv_cache_config_from_groups", "get_kv_cache_configs",
    "get_kv_cache_groups", "get_max_concurrency_for_kv_cache_config", "get_num_blocks",
    "get_request_block_hasher", "get_uniform_page_size", "group_and_unify_kv_cache_specs",
    "has_extra_keys", "hash_block_tokens", "init_none_hash", "is_kv_cache_page_size_uniform",
    "is_kv_cache_spec_uniform", "is_kv_cache_type_attention_free",
    "make_block_hash_with_group_id", "max_memory_usage_bytes", "may_override_num_blocks",
    "maybe_convert_block_hash", "need_extra_keys", "resolve_kv_cache_block_sizes", "sha256",
    "sha256_cbor", "tensor_data", "unify_hybrid_kv_cache_specs", "unify_kv_cache_spec_page_size",
]
