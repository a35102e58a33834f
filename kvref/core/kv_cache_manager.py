"""The scheduler-facing KV cache manager.

Mirrors ``vllm/v1/core/kv_cache_manager.py``. The scheduler drives it like this::

    blocks, num_hit = manager.get_computed_blocks(req)      # prefix hit (new requests)
    new = manager.allocate_slots(req, num_new_tokens,
                                 num_hit, blocks)           # None: no room, try later
    ...                                                     # the model runs
    req.num_computed_tokens += num_new_tokens
    manager.free(req)                                       # finished or preempted

A tiny run:

    >>> from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request,
    ...                    get_request_block_hasher, init_none_hash, sha256)
    >>> init_none_hash(sha256)
    >>> config = KVCacheConfig(8, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    >>> m = KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
    ...                    hash_block_size=4)
    >>> a = Request("a", list(range(10)), block_hasher=get_request_block_hasher(4, sha256))
    >>> m.allocate_slots(a, 10).get_block_ids()            # 10 tokens -> 3 blocks
    ([1, 2, 3],)
    >>> b = Request("b", list(range(9)), block_hasher=get_request_block_hasher(4, sha256))
    >>> hit, n = m.get_computed_blocks(b)                  # a's first 2 blocks are cached
    >>> hit.get_block_ids(), n
    (([1, 2],), 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvref.core.kv_cache_coordinator import get_kv_cache_coordinator
from kvref.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from kvref.core.kv_cache_utils import KVCacheBlock
from kvref.kv_events import BlockStored
from kvref.math_utils import cdiv
from kvref.request import Request, RequestStatus
from kvref.stats import PrefixCacheStats


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler: ``blocks[i][j]`` is block ``j`` of group ``i``.

    Groups are the outer dimension because groups with different block sizes
    hold different numbers of blocks. Treat it as read-only: the manager shares
    one empty instance (``KVCacheManager.empty_kv_cache_blocks``).
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; ``None`` instead of all-empty when ``allow_none``."""
        if allow_none and not any(self.blocks):
            return None
        return tuple([[b.block_id for b in group] for group in self.blocks])

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a hash (single-group configs only)."""
        if len(self.blocks) != 1:
            raise ValueError("get_unhashed_block_ids supports one KV cache group; "
                             "use get_unhashed_block_ids_all_groups")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of the real (non-null) blocks without a hash."""
        return [[b.block_id for b in group if b.block_hash is None and not b.is_null]
                for group in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class KVCacheManager:
    """Allocates, caches and frees KV cache blocks for the scheduler's requests.

    Args:
        kv_cache_config: pool size and groups.
        max_model_len: longest sequence; allocation never goes past it.
        scheduler_block_size: hit and caching granularity (LCM of group block sizes).
        hash_block_size: tokens per entry of ``request.block_hashes``.
        max_num_batched_tokens: tokens per step; sizes the admission cap of
            sliding-window and chunked-local groups (``max_model_len`` if None).
        enable_caching: prefix caching on/off.
        use_eagle: EAGLE/MTP speculative decoding (hits drop their last block,
            whose hidden states the draft head needs and the cache does not keep).
        log_stats: keep ``PrefixCacheStats``.
        enable_kv_cache_events: queue cache events for ``take_events``.
        watermark: fraction of the pool kept free when admitting waiting or
            preempted requests, so new admissions do not force preemptions.
        retention_interval: kvref's own argument (vLLM's manager has none): the
            prefix-cache retention interval (``kvref.core.kv_cache_coordinator``).
            vLLM's coordinator reads it from ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``
            (``vllm/v1/core/kv_cache_coordinator.py:125``); the default ``"env"`` does
            the same, an int or ``None`` (unset) overrides it, for tests.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 scheduler_block_size: int, hash_block_size: int,
                 max_num_batched_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: object = None,
                 watermark: float = 0.0,
                 retention_interval: int | None | Literal["env"] = "env") -> None:
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise ValueError("kvref does not model context parallelism: dcp_world_size "
                             f"and pcp_world_size must be 1, got {dcp_world_size} and "
                             f"{pcp_world_size}")
        if metrics_collector is not None:
            raise ValueError("kvref does not model the KV cache metrics collector; "
                             "pass metrics_collector=None")
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be >= 0.0, got {watermark!r}")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config, max_model_len,
            max_model_len if max_num_batched_tokens is None else max_num_batched_tokens,
            use_eagle, enable_caching, enable_kv_cache_events,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            retention_interval=retention_interval)
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(g.kv_cache_spec).value,
             get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups)
        # The one "no blocks" answer. allocate_slots recognises it by identity,
        # as vLLM's scheduler relies on.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (then restarted); None without log_stats."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a new request: ``(blocks, num_tokens)``.

        At most ``request.num_tokens - 1`` tokens: the model must run on at
        least the last token, because sampling needs its logits. Hits are whole
        blocks, so when the prompt is an exact multiple of the block size the
        cap costs a whole block, not one token: 16 tokens of block size 4, all
        cached, hit 12 and recompute tokens 12..15. (vLLM keeps hits
        block-aligned because ``allocate_slots`` expects
        ``num_computed_tokens`` on a block boundary.) A prompt that ends in a
        partial block loses nothing to the cap: 13 tokens hit at most 12
        anyway, since the partial block has no hash.

        Empty when caching is off or the request skips reading the cache
        (vLLM sets that for prompt logprobs and all-token pooling, which need
        every prompt token computed).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        if self.log_stats:
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hit,
                                           preempted=request.num_preemptions > 0)
        return self.create_kv_cache_blocks(blocks), num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens; return the new blocks,
        or None (and allocate nothing) when the pool cannot hold them.

        The request's tokens, left to right (the same brackets as vLLM's
        drawing)::

            | comp | new_comp | ext_comp |  new  | lookahead |
                                         |<- computed now -->|
                              |<-------- allocated --------->|
                              |<---- cached ---->|  full blocks, verified tokens only
            |<--------- prefix --------->|  blocks outside a window may be freed
            |<-- in kvref --->|  ext_comp: a KV connector holds it
            | held | touched  |  ref_cnt: comp's held already, new_comp's taken here

        comp = ``request.num_computed_tokens``, blocks already in the table;
        new_comp = ``num_new_computed_tokens``, this step's prefix hit
        (``new_computed_blocks``: cached blocks that exist already, so they are
        touched, not allocated); ext_comp = ``num_external_computed_tokens``,
        tokens a KV connector will load into fresh blocks; new =
        ``num_new_tokens``, including unverified draft tokens; lookahead =
        ``num_lookahead_tokens``, slots where the EAGLE/draft model writes the
        keys and values of the draft tokens it proposes this step (they are
        allocated but never cached: nobody has verified them).

        Steps, in vLLM's order:

        1. ``ValueError`` if there is nothing to compute and nothing to load.
        2. ``full_sequence_must_fit``: None unless the whole request fits
           (nothing freed yet). Sliding-window and chunked-local groups count
           only their admission cap here (the most blocks a request holds at
           once, since blocks left of the window are freed before each chunk):
           the startup pool sizer uses the same cap, and counting every block
           instead would refuse, forever, a long request the pool can in fact
           serve, and the waiting queue behind it with it (a deadlock vLLM
           fixed by making both use ``max_admission_blocks_per_request``).
        3. Free blocks left of the attention window (kept freed even if the
           call then returns None).
        4. None unless the blocks needed fit in the free blocks minus
           ``reserved_blocks`` minus the watermark. The watermark is headroom
           for requests already running, so their next decode blocks do not
           force a preemption; it therefore applies only to WAITING/PREEMPTED
           requests (a running request asking for room is what the headroom is
           for), and only when others are scheduled (a lone request has nobody
           to protect, and refusing it could leave the engine idle forever).
           ``reserved_blocks``: blocks promised to in-flight async KV loads.
        5. Take the hit blocks, allocate for external and new tokens, and cache
           the blocks that are now full (only up to ``request.num_tokens``: draft
           tokens may be rejected), unless ``delay_cache_blocks``.
        """
        # 1. Something to compute or to load.
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "external computed tokens")
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError(f"token counts must be >= 0: num_new_tokens={num_new_tokens}, "
                             f"num_lookahead_tokens={num_lookahead_tokens}, "
                             f"num_external_computed_tokens={num_external_computed_tokens}")
        hit_blocks = (self.empty_kv_cache_blocks if new_computed_blocks is None
                      else new_computed_blocks).blocks

        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens,
                             self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING,
                                                     RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        num_free_blocks = self.block_pool.get_num_free_blocks()

        # 2. The full-sequence gate (nothing freed yet).
        if full_sequence_must_fit:
            full_len = min(request.num_tokens, self.max_model_len)
            needed = self.coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id, num_tokens=full_len,
                new_computed_blocks=hit_blocks, num_encoder_tokens=num_encoder_tokens,
                total_computed_tokens=total_computed, num_tokens_main_model=full_len,
                apply_admission_cap=True)
            if needed + watermark_blocks > num_free_blocks:
                return None

        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens,
                                   self.max_model_len)

        # 3. Free the blocks left of the attention window first: fewer cached
        #    blocks get evicted below.
        self.coordinator.remove_skipped_blocks(request.request_id, total_computed,
                                               num_prompt_tokens=request.num_prompt_tokens)

        # 4. The capacity gate: the blocks needed, the watermark, the reserved blocks.
        needed = self.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id, num_tokens=num_tokens_need_slot,
            new_computed_blocks=hit_blocks, num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=num_local_computed + num_external_computed_tokens,
            num_tokens_main_model=num_tokens_main_model)
        available = self.block_pool.get_num_free_blocks() - reserved_blocks
        if needed + watermark_blocks > available:
            return None

        # 5. Take the hit (identity, not equality: the shared empty answer means
        #    "no hit"), allocate, cache what is now full.
        if hit_blocks is not self.empty_kv_cache_blocks.blocks \
                or num_external_computed_tokens > 0:
            self.coordinator.allocate_new_computed_blocks(
                request_id=request.request_id, new_computed_blocks=hit_blocks,
                num_local_computed_tokens=num_local_computed,
                num_external_computed_tokens=num_external_computed_tokens)

        new_blocks = self.coordinator.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, num_tokens_main_model,
            num_encoder_tokens)

        if self.enable_caching and not delay_cache_blocks:
            self.coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, group by group, tail first."""
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free blocks no future token attends to (they become null blocks)."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens,
                                               num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request and return its blocks (all groups, table order)
        without freeing them; the caller later calls
        ``block_pool.free_blocks(reversed(blocks))``."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks from the prefix cache (they stay allocated if in use)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (and nothing changes) while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks held by *every* request that holds blocks
        (for cascade attention). Requests holding blocks but not scheduled this
        step count too, so this can be 0 when the scheduled ones share a prefix."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list:
        """Drain the event queue; ``BlockStored`` events get their group's spec kind."""
        events = self.block_pool.take_events()
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None \
                    and 0 <= event.group_idx < len(self.kv_cache_event_metadata):
                (event.kv_cache_spec_kind,
                 event.kv_cache_spec_sliding_window) = self.kv_cache_event_metadata[event.group_idx]
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """Block ids that hold the first ``num_computed_tokens`` tokens, per group
        (Mamba and cross-attention tables are returned whole)."""
        clipped = []
        for group, ids in zip(self.kv_cache_config.kv_cache_groups,
                              self.get_block_ids(request_id)):
            spec = group.kv_cache_spec
            if isinstance(spec, AttentionSpec) and not isinstance(spec, CrossAttentionSpec):
                ids = ids[:cdiv(num_computed_tokens, spec.block_size)]
            clipped.append(ids)
        return tuple(clipped)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens`` (if caching)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group blocks; all-empty gives the shared empty instance."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list[int]:
        """Full-attention blocks allocated since the last call (to be zeroed)."""
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            ids.extend(manager.take_new_block_ids())   # one extend per group, not a loop per id
        return ids

    def new_step_starts(self) -> None:
        """The scheduler starts a step (Mamba: this step's cached states become hittable)."""
        self.coordinator.new_step_starts()
