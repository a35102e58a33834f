"""One manager per KV cache group: which blocks each request holds, per attention type.

Mirrors ``vllm/v1/core/single_type_kv_cache_manager.py``. A manager keeps
``req_to_blocks[request_id]``, the request's block table for its group, and
knows two things about its attention type:

- ``find_longest_cache_hit``: which cached blocks a new request can reuse.
  Full attention needs every block of the prefix; a sliding window only the
  last few; a Mamba layer only the one state at the end.
- ``get_num_skipped_tokens``: which leading tokens no longer matter, so that
  ``remove_skipped_blocks`` can free their blocks and put the null block in
  their place (the table keeps its length; positions stay meaningful).

Example, block size 4, sliding window 8, 20 tokens computed::

    full attention  [ 3,  4,  5,  6,  7]      every block is still read
    sliding window  [ 0,  0,  0, 11, 12]      only tokens 13..20 are read;
                      ^^^^^^^^^^ null block   blocks before them were freed

The managers here: ``FullAttentionManager`` (and its two variants
``RSWAManager``, ``SinkFullAttentionManager``), ``SlidingWindowManager``,
``ChunkedLocalAttentionManager``, ``MambaManager``, ``CrossAttentionManager``.
``register_all_kvcache_specs`` tells the spec registry
(``kvref.kv_cache_spec_registry``) which manager serves which spec class;
``get_manager_for_kv_cache_spec`` asks it for a spec's manager.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import BlockHash, BlockHashWithGroupId, KVCacheBlock
from kvref.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
)
from kvref.kv_cache_spec_registry import KVCacheSpecRegistry, add_builtin_registration
from kvref.math_utils import cdiv
from kvref.request import Request


class SingleTypeKVCacheManager:
    """The block tables of one KV cache group (one attention type).

    Args:
        kv_cache_spec: the group's spec.
        block_pool: the pool shared by all groups.
        enable_caching: whether full blocks are hashed for prefix caching.
        kv_cache_group_id: this group's index in the config.
        scheduler_block_size: the hit granularity of the whole model (the LCM
            of all groups' block sizes); a multiple of this group's block size.
        max_admission_blocks_per_request: the most blocks one request can hold
            at once, for types that recycle blocks (sliding window, chunked
            local); ``None`` means no cap. The full-sequence admission check
            counts at most this many: the pool was sized with the same number,
            so a long request the pool can serve is never refused for good.
        dcp_world_size, pcp_world_size: decode / prefill context-parallel
            ranks. Each rank stores every ``ranks``-th token, so one block
            table entry covers ``block_size * ranks`` tokens.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                 enable_caching: bool, kv_cache_group_id: int, scheduler_block_size: int,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 max_admission_blocks_per_request: int | None = None) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        self._null_block = block_pool.null_block
        # A defaultdict, as in vLLM: reading an unknown request creates an empty
        # entry, and the entry count is what common-prefix detection compares to.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Leading blocks of each *running* request that are already cached.
        # Membership also marks "already allocated once" (no more prefix hits).
        self.num_cached_block: dict[str, int] = {}
        # Blocks allocated since the last take_new_block_ids (full attention only).
        self.new_block_ids: list[int] = []
        # Whether hits of this group drop the last block for EAGLE (set by the coordinator).
        self.use_eagle = False

    # -- how many blocks a step needs ---------------------------------------

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """Free blocks this step would take for the request to hold ``num_tokens``.

        Counts the new blocks, plus prefix-hit blocks that are now free but
        cached: touching them pulls them out of the free queue, so they use up
        free capacity as well.
        """
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self._max_admission_blocks_per_request is not None:
            num_required = min(num_required, self._max_admission_blocks_per_request)
        num_held = len(self.req_to_blocks.get(request_id, ()))

        if request_id in self.num_cached_block:
            # A running request gets no new hits; rejected drafts can leave it
            # holding more than it needs now.
            if new_computed_blocks:
                raise ValueError(f"request {request_id!r} is already running and "
                                 "cannot take new prefix-hit blocks")
            return max(num_required - num_held, 0)

        # A new request: the leading blocks outside the attention window need
        # no block at all (they become null blocks).
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local = len(new_computed_blocks) + num_held
        num_new = max(num_required - max(num_skipped, num_local), 0)
        if not new_computed_blocks:
            return num_new  # no hit: no free hit blocks to add
        # Hit blocks inside the skipped range are never touched.
        first_kept_hit = max(0, num_skipped - num_held)
        num_evictable = sum(1 for b in new_computed_blocks[first_kept_hit:]
                            if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    # -- the three allocation stages ----------------------------------------

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """Give a new request its prefix-hit blocks: touch the ones it will read,
        put null blocks where the window has already moved past."""
        blocks = self.req_to_blocks[request_id]
        if blocks:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix "
                             "hits are only taken on its first allocation")
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(total) // self.block_size
        kept = new_computed_blocks[num_skipped:]
        if self.enable_caching:
            self.block_pool.touch(kept)
        elif any(kept):
            raise ValueError("prefix-hit blocks given while prefix caching is off")
        blocks.extend([self._null_block] * num_skipped)
        blocks.extend(kept)
        # Hit blocks are cached already; cache_blocks starts after them.
        self.num_cached_block[request_id] = len(blocks)

    def allocate_external_computed_blocks(self, request_id: str,
                                          num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Blocks for tokens a KV connector will load (after every group's hits
        are touched, so this cannot evict another group's hit)."""
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(total)
        if num_skipped_tokens > 0:
            # External tokens left of the window need no block either.
            num_external_computed_tokens = min(total - num_skipped_tokens,
                                               num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        new_blocks = self.block_pool.get_new_blocks(cdiv(total, self.block_size) - len(blocks))
        blocks.extend(new_blocks)
        self._remember_new_blocks(new_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the request's table to hold ``num_tokens``; return the new blocks."""
        blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        self._remember_new_blocks(new_blocks)
        return new_blocks

    def _remember_new_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # vLLM reports fresh blocks for zeroing only for plain full attention.
        if type(self.kv_cache_spec) is FullAttentionSpec:
            self.new_block_ids.extend([b.block_id for b in blocks])

    def take_new_block_ids(self) -> list[int]:
        """Block ids allocated since the last call (then forgotten)."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    # -- caching --------------------------------------------------------------

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None) -> None:
        """Cache the request's blocks that ``num_tokens`` tokens fill completely.

        ``retention_interval`` is the coordinator's prefix-cache retention
        interval (``None``: unset); only window and Mamba groups act on it, by
        caching fewer blocks (``reachable_block_mask``).
        """
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        mask = self.reachable_block_mask(
            start_block=num_cached, end_block=num_full,
            alignment_tokens=self.scheduler_block_size, kv_cache_spec=self.kv_cache_spec,
            use_eagle=self.use_eagle, retention_interval=retention_interval,
            num_prompt_tokens=request.num_prompt_tokens)
        self.block_pool.cache_full_blocks(
            request=request, blocks=self.req_to_blocks[request.request_id],
            num_cached_blocks=num_cached, num_full_blocks=num_full,
            block_size=self.block_size, kv_cache_group_id=self.kv_cache_group_id,
            block_mask=mask)
        self.num_cached_block[request.request_id] = num_full

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             num_prompt_tokens: int | None = None) -> list[bool] | None:
        """Which of ``blocks[start_block:end_block]`` to cache: the ones a future
        hit could use (and, with a retention interval, is meant to keep).
        ``None`` means all of them, the answer for every type that reads the
        whole prefix."""
        return None

    # -- release ---------------------------------------------------------------

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks in table order, still referenced."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (the tail is evicted first)."""
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks no future token will attend to; null blocks take their place."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        # NOTE: reading the table gives a request without one an empty table, as
        # in vLLM; it then counts in get_num_common_prefix_blocks' request total.
        blocks = self.req_to_blocks[request_id]
        self._remove_blocks_in_range(request_id, 0,
                                     min(num_skipped_tokens // self.block_size, len(blocks)))

    def _remove_blocks_in_range(self, request_id: str, first_block: int,
                                last_block: int) -> None:
        """Null out ``blocks[first_block:last_block]`` from right to left,
        stopping at the first null block (everything before it was nulled by an
        earlier call). The range may run past the allocated blocks (skipped
        tokens can include external ones): it is cut at the table's end. A
        request without a table has nothing to free and is given none (R-SWA's
        gap call on a request whose allocation failed leaves no trace, as in vLLM)."""
        if first_block >= last_block or request_id not in self.req_to_blocks:
            return  # an empty range: most window steps free nothing
        blocks = self.req_to_blocks[request_id]
        freed = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no later token attends to. Default: none."""
        return 0

    def new_step_starts(self) -> None:
        """The scheduler starts a new step (Mamba forgets this step's caching)."""

    # -- per-type behaviour ------------------------------------------------------

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks shared by every request holding blocks, which cascade
        attention computes once for all of them.

        Only full attention can answer (``FullAttentionManager`` counts leading
        blocks whose ``ref_cnt`` equals the number of requests). Every other
        type keeps this base answer, 0, which is always safe (no cascade):
        sliding-window and chunked-local tables start with null blocks, whose
        ``ref_cnt`` means nothing, so counting would be wrong; Mamba blocks are
        states, not per-token keys and values; cross-attention blocks are
        private to their request. (vLLM's base raises instead; each of its
        other managers returns 0 for these reasons.)
        """
        return 0

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The cached blocks a request with these hashes can reuse, per group.

        The hit covers at most ``max_length`` tokens and a multiple of
        ``alignment_tokens``; blocks the type does not need are the null block.
        ``drop_eagle_block`` removes the last hit block so that it is computed
        again: EAGLE's draft head reads the target model's hidden states of the
        tokens before the one it drafts from, and the cache keeps only keys and
        values, not hidden states.
        """
        raise TypeError(f"{cls.__name__} does not serve prefix-cache hits")


def _pop_until_aligned(computed: tuple[list[KVCacheBlock], ...], block_size: int,
                       alignment_tokens: int) -> None:
    """Shorten every group's hit until it covers a multiple of ``alignment_tokens``."""
    while len(computed[0]) * block_size % alignment_tokens != 0:
        for blocks in computed:
            blocks.pop()


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token reads every earlier token: a hit is the longest cached prefix."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Scan left to right and stop at the first miss: hashes chain, so no
        block after a miss can be cached for this prefix."""
        computed = tuple([] for _ in kv_cache_group_ids)
        block_size = kv_cache_spec.block_size
        for block_hash in block_hashes[:max_length // block_size]:
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        if drop_eagle_block and computed[0]:
            for blocks in computed:
                blocks.pop()
        _pop_until_aligned(computed, block_size, alignment_tokens)
        return computed

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks whose ``ref_cnt`` equals the number of requests with blocks."""
        blocks = self.req_to_blocks[running_request_id]
        num_requests = len(self.req_to_blocks)
        count = 0
        for block in blocks:
            if block.ref_cnt != num_requests:
                break
            count += 1
        return count


class RSWAManager(FullAttentionManager):
    """Reference sliding-window attention (``RSWASpec``): the prompt stays
    visible, generated tokens only within the last ``rswa_window``.

    Hits and allocation are full attention's. ``remove_skipped_blocks`` with
    the prompt length frees the *gap*: the whole blocks after the prompt's
    last block and before the window (vLLM calls it with
    ``request.num_prompt_tokens`` from ``allocate_slots``). Without it, nothing
    is freed. With block size 4, a 16-token prompt, window 8 and 28 tokens
    computed, the window starts at token 20, so block 4 (tokens 16..19) goes.
    """

    def __init__(self, kv_cache_spec: RSWASpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rswa_window = kv_cache_spec.rswa_window

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return  # full attention frees nothing early
        first_gap_block = cdiv(num_prompt_tokens, self.block_size)
        window_start = max(num_prompt_tokens, total_computed_tokens - self.rswa_window)
        self._remove_blocks_in_range(request_id, first_gap_block,
                                     window_start // self.block_size)


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention with sink tokens (``SinkFullAttentionSpec``): the
    manager takes ``sink_len // block_size`` blocks from the front of the free
    queue when it is built and keeps them in ``sink_blocks`` for the sink
    tokens every request attends to; requests' own blocks are full attention's.

    The blocks are taken off the queue without a reference count, as vLLM does:
    the pool simply has fewer free blocks from then on.
    """

    def __init__(self, kv_cache_spec: SinkFullAttentionSpec, block_pool: BlockPool,
                 enable_caching: bool, kv_cache_group_id: int,
                 scheduler_block_size: int | None = None, **kwargs) -> None:
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id,
                         kv_cache_spec.block_size if scheduler_block_size is None
                         else scheduler_block_size, **kwargs)
        sink_len = kv_cache_spec.sink_len
        if sink_len is None or sink_len <= 0 or sink_len % self.block_size:
            raise ValueError(f"SinkFullAttentionSpec.sink_len must be a positive "
                             f"multiple of the block size {self.block_size}, got "
                             f"{sink_len!r}")
        self.sink_blocks = block_pool.free_block_queue.popleft_n(sink_len // self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token reads the last ``sliding_window`` tokens, itself included.

    ``get_num_skipped_tokens``: window 4, 7 tokens computed -> the next token
    (index 7) reads tokens 4..7, so tokens 0..3 are skipped (4 skipped).
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @staticmethod
    def num_contiguous_blocks_for_hit(sliding_window: int, block_size: int,
                                   use_eagle: bool) -> int:
        """Cached blocks in a row that make a hit (vLLM's
        ``sliding_window_contiguous_blocks``): enough to hold the ``window - 1``
        earlier tokens the next token reads, one more for EAGLE (which drops it
        again). ``kvref explain`` and the walkthroughs quote it from here."""
        return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Scan right to left for ``need`` cached blocks in a row; everything left
        of them is outside the window and becomes the null block.

        Block size 4, window 8 (need 2), blocks 2 and 3 cached, 1 missing::

            hashes   h0    h1    h2  h3
            cached   yes   no    7   8
            hit      [NULL, NULL, 7, 8]      16 tokens, 2 real blocks

        Without such a run, only a run starting at block 0 counts (a prefix
        shorter than the window needs no nulls).
        """
        block_size = kv_cache_spec.block_size
        need = cls.num_contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size,
                                              drop_eagle_block)
        num_blocks = max_length // block_size
        computed = tuple([block_pool.null_block] * num_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and block_size != alignment_tokens:
                # The run's right end must fall on an aligned boundary (after
                # the EAGLE drop, if any).
                end = i if drop_eagle_block else i + 1
                if end * block_size % alignment_tokens != 0:
                    continue
            for blocks, block in zip(computed, cached):
                blocks[i] = block
            run += 1
            if run >= need:
                for blocks in computed:
                    del blocks[i + run:]
                found = True
                break
        if not found:
            for blocks in computed:
                del blocks[run:]
            _pop_until_aligned(computed, block_size, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for blocks in computed:
                blocks.pop()
            _pop_until_aligned(computed, block_size, alignment_tokens)
        return computed

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             num_prompt_tokens: int | None = None) -> list[bool] | None:
        """Cache only the blocks a hit can end on ("tails").

        A hit reads just the ``need`` blocks before its end, and ends on a
        boundary of the *segment*: every ``alignment_tokens`` by default. With
        alignment 32, block size 8 and need 2, a hit ends every 4 blocks, so
        blocks 2, 3, 6, 7, ... are tails and 0, 1, 4, 5, ... would only clutter
        the index. With EAGLE every run is one block further right.

        A retention interval keeps fewer tails: the segment becomes
        ``retention_interval`` tokens (0: no segment tails at all), plus the
        *replay tail*, the one ending at the last aligned boundary before the
        prompt's last token. A request repeating the prompt hits exactly
        there, since a hit stops short of the last token to compute its
        logits. Block size 16, need 1, interval 64, a 256-token prompt::

            segment tails   3, 7, 11, 15     (every 64 tokens)
            replay tail     14               (ends at 240 = 255 // 16 * 16)
            interval 0      14 only;   unset: all 16 (need 1 = per segment)
        """
        block_size = kv_cache_spec.block_size
        need = cls.num_contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size,
                                              use_eagle)
        shift = 1 if use_eagle else 0
        segment = alignment_tokens if retention_interval is None else retention_interval
        mask = [False] * (end_block - start_block)
        if segment > 0:
            per_segment = segment // block_size
            if need >= per_segment:
                return None  # every block is some boundary's tail
            mask = [i >= shift and (i - shift) % per_segment >= per_segment - need
                    for i in range(start_block, end_block)]
        if retention_interval is not None and num_prompt_tokens is not None:
            replay_end = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
            tail_end = replay_end // block_size + shift
            for i in range(max(start_block, tail_end - need), min(end_block, tail_end)):
                mask[i - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Tokens read only inside their own chunk of ``attention_chunk_size``.

    ``get_num_skipped_tokens``: chunk 8, 13 computed -> the next token (13)
    is in chunk 8..15, so 8 tokens are skipped; 8 computed -> 8; 7 -> 0.
    """

    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Blocks before the chunk of token ``max_length`` count as computed (null);
        inside that chunk, the longest cached run from the chunk start.

        Chunk 8, block size 4, max_length 15: token 15 is in chunk 8..15, so
        blocks 0-1 are null and block 2 is looked up -> ``[NULL, NULL, 7]`` or
        ``[NULL, NULL]``. With max_length 16 all four blocks are null: even a
        request with nothing cached "hits" them.
        """
        if drop_eagle_block:
            raise ValueError("EAGLE is not supported with chunked local attention")
        block_size = kv_cache_spec.block_size
        if block_size != alignment_tokens:
            raise ValueError("chunked local attention needs every group to have the "
                             f"same block size ({block_size} != {alignment_tokens})")
        chunk = kv_cache_spec.attention_chunk_size
        first_block = max(max_length, 0) // chunk * chunk // block_size
        computed = tuple([block_pool.null_block] * first_block for _ in kv_cache_group_ids)
        for i in range(first_block, max_length // block_size):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Blocks for the encoder's output (Whisper): allocated once from
    ``num_encoder_tokens`` on the first step, private to the request, never cached."""

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        if new_computed_blocks:
            raise ValueError("cross-attention blocks are never prefix hits")

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        return  # encoder states are not loaded from a connector

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None) -> None:
        raise ValueError("cross-attention blocks are never cached; "
                         "this needs enable_caching=False")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        raise ValueError("cross-attention does not support prefix caching; "
                         "this needs enable_caching=False")


class MambaManager(SingleTypeKVCacheManager):
    """Block tables of one Mamba (linear attention / SSM) group.

    A Mamba layer has no per-token keys and values: one block holds the whole
    recurrent state after some token. So a prefix hit needs exactly one cached
    block, the state at the end of the prefix, and every older state is garbage
    (``get_num_skipped_tokens(n) == n - 1``). Three modes (``MambaSpec.mamba_cache_mode``):

    - ``"none"``/``"all"``: the table has a block per ``block_size`` tokens; the
      states left of the last one are replaced by the null block as computation
      moves on. In ``"all"`` mode each full block's state is cached.
    - ``"align"``: only the running state and the state at the last block boundary
      are kept; blocks in between are null from the start::

          tokens computed: 40, block size 16, no speculative blocks
          table            [NULL, 8, 9]        8: state at token 32 (cacheable)
                                               9: running state

      Each step the kernel reads the state from the previous step's block and
      writes the updated state into this step's block (a copy, so the old one
      survives); once the newer one exists the older is freed
      (``remove_skipped_blocks``). For the state left in a block to be the
      state *at a block boundary*, the one a hashed prefix can hit, vLLM's
      scheduler ends every prefill chunk on a block boundary: a chunk is cut
      back to the last boundary it crosses (a budget under one block waits
      for the next step), and only the prompt's final partial block runs
      past a boundary, its state left uncached. That is also why lookahead
      tokens get no slots here: ``x * block_size + num_lookahead`` tokens
      would put the state off a boundary, and draft models have no Mamba
      layers anyway.

    ``num_speculative_blocks`` extra blocks hold states for draft tokens.

    One rule is unique to Mamba: a state cached *in this step* by another request
    may not be written yet, so a hit on it makes ``get_num_blocks_to_allocate``
    return more blocks than the pool has, and the scheduler retries next step.
    """

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Hashes cached since new_step_starts(): not hittable until next step.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # "align" mode: the table index of the state written in the previous
        # step (freed once the next one exists), and the requests that have
        # allocated at least once.
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """The rightmost cached state on an aligned boundary, nulls before it.

        Block size 4, states cached after blocks 0 and 2, max_length 15:
        ``[NULL, NULL, 9]`` (12 tokens). Only one block is real.
        """
        block_size = kv_cache_spec.block_size
        computed = tuple([] for _ in kv_cache_group_ids)
        for i in range(max_length // block_size - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None or (i + 1) * block_size % alignment_tokens != 0:
                continue
            for blocks, block in zip(computed, cached):
                blocks.extend([block_pool.null_block] * i)
                blocks.append(block)
            break
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        if new_computed_blocks and \
                new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # More than the pool holds: "cannot allocate now, try next step".
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks, total_computed_tokens, num_tokens_main_model,
                apply_admission_cap)
        # Align mode ignores lookahead tokens (draft models have no Mamba layers)
        # and needs at most one running block (+ speculative ones the first time).
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        if num_new > 0:
            num_new = 1 if request_id in self._allocated_block_reqs \
                else 1 + self.num_speculative_blocks
        if not new_computed_blocks:
            return num_new  # no hit: no free hit blocks to add, as in the base class
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        if not self._align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model)
        return self._allocate_aligned(request_id, num_tokens_main_model)

    def _allocate_aligned(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the table to ``cdiv(num_tokens) + spec`` entries, where only the
        last ``1 + spec`` are real: nulls fill the gap, the previous step's
        speculative blocks move to the end, and at most one fresh block (``1 +
        spec`` the first time) is taken. Returns the table's new tail."""
        spec = self.num_speculative_blocks
        blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens, self.block_size) + spec
        if num_required <= len(blocks):
            return []
        prev_len = len(blocks)
        allocated_before = request_id in self._allocated_block_reqs
        # The running state is the last real block before the speculative ones;
        # after a fresh prefix hit, it is the hit block.
        if allocated_before:
            self.last_state_block_idx[request_id] = prev_len - 1 - spec
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1
        num_state_slots_before = num_required - spec - 1
        blocks.extend([self._null_block] * max(0, num_state_slots_before - prev_len))
        if allocated_before:
            # Reuse last step's speculative blocks: move them to the tail.
            for i in range(prev_len - spec, prev_len):
                if i >= num_state_slots_before:
                    break
                blocks.append(blocks[i])
                blocks[i] = self._null_block
        num_new = num_required - len(blocks)
        limit = 1 if allocated_before else 1 + spec
        if not 0 <= num_new <= limit:
            raise RuntimeError(f"align-mode Mamba would take {num_new} blocks for "
                               f"request {request_id!r} (at most {limit})")
        blocks.extend(self.block_pool.get_new_blocks(num_new))
        self._allocated_block_reqs.add(request_id)
        return blocks[prev_len:]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        # With async scheduling the count may include drafts that get rejected;
        # stay conservative (vLLM subtracts the number of speculative *blocks*).
        num_computed = max(0, total_computed_tokens - self.num_speculative_blocks)
        super().remove_skipped_blocks(request_id, num_computed, num_prompt_tokens)
        if not self._align:
            return
        # The state written two steps ago is no longer needed once a newer one exists.
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < cdiv(num_computed, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if blocks[last] is not self._null_block:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self._null_block

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             num_prompt_tokens: int | None = None) -> list[bool] | None:
        """Which state snapshots to cache: all (``None``) unless a retention
        interval is set. Then one state per ``retention_interval`` tokens (none
        for 0), plus the state at the replay boundary (the last aligned
        boundary before the prompt's last token, where a repeat of the prompt
        hits). Block ``i`` holds the state after token ``(i + 1) * block_size``.

        Block size 16, interval 64, a 256-token prompt: states 3, 7, 11, 15
        (tokens 64, 128, 192, 256) and 14 (token 240, the replay boundary);
        interval 0: state 14 only; an interval of one block: all of them.
        """
        if retention_interval is None:
            return None
        block_size = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval > 0:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None  # every block ends a segment
            mask = [(i + 1) % per_segment == 0 for i in range(start_block, end_block)]
        if num_prompt_tokens is not None:
            replay_end = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
            state = replay_end // block_size - 1
            if start_block <= state < end_block:
                mask[state - start_block] = True
        return mask

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        if num_tokens // self.block_size <= before:
            return  # no state completed since the last call: most decode steps
        super().cache_blocks(request, num_tokens, retention_interval=retention_interval)
        after = self.num_cached_block.get(request.request_id, 0)
        # Skipped states (null, or left out by the retention mask) carry no hash.
        for block in self.req_to_blocks[request.request_id][before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_blocks_this_step.add(block.block_hash)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


# spec class -> (its manager, the spec class it groups with). The full
# attention family (TurboQuant, MLA, hidden states, R-SWA, sinks) groups with
# full attention; a window over MLA latents groups only with its own kind.
_BUILTIN_SPECS = [
    (FullAttentionSpec, FullAttentionManager, FullAttentionSpec),
    (SlidingWindowSpec, SlidingWindowManager, SlidingWindowSpec),
    (SlidingWindowMLASpec, SlidingWindowManager, SlidingWindowMLASpec),
    (MambaSpec, MambaManager, MambaSpec),
    (ChunkedLocalAttentionSpec, ChunkedLocalAttentionManager, ChunkedLocalAttentionSpec),
    (CrossAttentionSpec, CrossAttentionManager, CrossAttentionSpec),
    (TQFullAttentionSpec, FullAttentionManager, FullAttentionSpec),
    (MLAAttentionSpec, FullAttentionManager, FullAttentionSpec),
    (RSWASpec, RSWAManager, FullAttentionSpec),
    (HiddenStateCacheSpec, FullAttentionManager, FullAttentionSpec),
    (SinkFullAttentionSpec, SinkFullAttentionManager, FullAttentionSpec),
]


def register_all_kvcache_specs(vllm_config=None) -> None:
    """Register kvref's spec classes with their managers and grouping bases.

    ``vllm_config`` is accepted for vLLM's signature; vLLM also lets its
    platform register extra specs there, which kvref has none of.
    ``EncoderOnlyAttentionSpec`` is not registered (as in vLLM): encoder-only
    layers keep no KV cache and never form a group.
    """
    del vllm_config
    for spec_cls, manager_cls, base in _BUILTIN_SPECS:
        KVCacheSpecRegistry.register(spec_cls, manager_cls, uniform_type_base_spec=base)


register_all_kvcache_specs()
add_builtin_registration(register_all_kvcache_specs)


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, max_num_batched_tokens: int,
                                  max_model_len: int, **kwargs) -> SingleTypeKVCacheManager:
    """The manager the registry names for the spec (its nearest registered
    class); block-recycling types get their admission cap."""
    manager_cls = KVCacheSpecRegistry.get_manager_class(kv_cache_spec)
    if manager_cls is None:
        raise ValueError(f"no KV cache manager for spec type {type(kv_cache_spec).__name__}"
                         " (register it with kvref.kv_cache_spec_registry)")
    if isinstance(kv_cache_spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        kwargs["max_admission_blocks_per_request"] = \
            kv_cache_spec.max_admission_blocks_per_request(max_num_batched_tokens,
                                                           max_model_len)
    return manager_cls(kv_cache_spec, **kwargs)


__all__ = [
    "ChunkedLocalAttentionManager", "CrossAttentionManager", "FullAttentionManager",
    "MambaManager", "RSWAManager", "SingleTypeKVCacheManager", "SinkFullAttentionManager",
    "SlidingWindowManager", "get_manager_for_kv_cache_spec", "register_all_kvcache_specs",
]
