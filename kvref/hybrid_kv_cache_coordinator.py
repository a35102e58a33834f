"""The hybrid coordinator: one prefix hit that every attention type accepts.

Part of vLLM's ``vllm/v1/core/kv_cache_coordinator.py``
(``HybridKVCacheCoordinator``), in its own file for length;
``kvref.kv_cache_coordinator`` re-exports it.

Each attention type answers "how much of this prefix can I serve?" differently,
and a hit is only usable if *every* group can serve it. The answer is found as
a fixed point: start from the longest possible hit, let each type shrink it to
what it can serve, and repeat until nobody shrinks it any more. It ends because
the length only goes down and stops at 0.

Worked example (``tests/test_hybrid_fixed_point.py`` runs it). Block size 4;
groups: full attention, sliding window 8 (a hit must end in 2 cached blocks in
a row), Mamba (a hit must end on a cached state). The prompt has 33 tokens, so
the hit may cover at most 32 tokens = 8 blocks. What the cache holds::

    block            0  1  2  3  4  5  6  7
    full attention   x  x  x  x  x  x  x  x
    sliding window   x  .  x  x  x  .  .  .
    mamba state      x  .  x  .  .  .  .  .

Pass 1, starting at 32 tokens:
  full attention  all 8 blocks cached                         -> 32
  sliding window  right to left from block 7: 3-4 is a run of 2 -> 20
  mamba           rightmost state at or before block 4: block 2 -> 12
Pass 2, starting at 12:
  full attention  (looked up once already) trimmed to 12       -> 12
  sliding window  blocks 0-2: 2 is cached, 1 is not; no run of 2, so only
                  the run from block 0 counts: block 0         ->  4
  mamba           rightmost state at or before block 0: block 0 ->  4
Pass 3, starting at 4: every group accepts 4. Fixed point: the hit is 4 tokens,
``[[b0], [b0'], [b0'']]`` (one block per group).

Groups whose block sizes differ read the same ``request.block_hashes`` through
``BlockHashListWithBlockSize``; all hits are multiples of
``scheduler_block_size`` (the LCM of the block sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.kv_cache_coordinator import HitBlocks, KVCacheCoordinator, SpecGroup
from kvref.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from kvref.kv_cache_utils import BlockHashListWithBlockSize, KVCacheBlock


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups of different attention types sharing one pool."""

    def __init__(self, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        super().__init__(kv_cache_config, *args, **kwargs)
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            if group.kv_cache_spec.block_size % self.hash_block_size != 0:
                raise ValueError(f"kv_cache_groups[{i}] block_size "
                                 f"{group.kv_cache_spec.block_size} is not a multiple of "
                                 f"hash_block_size {self.hash_block_size}")
        self.attention_groups = self._split_by_spec(kv_cache_config)
        # Tokens of a prefix some group cached but the agreed hit does not
        # cover (read by vLLM's scheduler); set by find_longest_cache_hit.
        self.num_uncached_common_prefix_tokens = 0

    def _split_by_spec(self, kv_cache_config: KVCacheConfig) -> list[SpecGroup]:
        """One ``SpecGroup`` per distinct spec, full attention first: its cheap
        left-to-right scan gives the others a tight bound to start from."""
        by_spec: list[SpecGroup] = []
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            eagle = i in self.eagle_group_ids
            for j, known in enumerate(by_spec):
                if known.spec == group.kv_cache_spec:
                    known.group_ids.append(i)
                    by_spec[j] = known._replace(use_eagle=known.use_eagle or eagle)
                    break
            else:
                by_spec.append(SpecGroup(group.kv_cache_spec, [i],
                                         type(self.single_type_managers[i]), eagle))
        if len(by_spec) < 2:
            raise ValueError("the hybrid coordinator needs at least two distinct KV cache "
                             "specs; groups with one spec form one lookup group")
        by_spec.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))
        for spec_group in by_spec:
            for gid in spec_group.group_ids:
                self.single_type_managers[gid].use_eagle = spec_group.use_eagle
        return by_spec

    def _hashes_for(self, spec: KVCacheSpec, block_hashes: Sequence[bytes]) -> Sequence[bytes]:
        if spec.block_size == self.hash_block_size:
            return block_hashes
        return BlockHashListWithBlockSize(block_hashes, self.hash_block_size, spec.block_size)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Cache up to the last ``scheduler_block_size`` boundary only: hits
        never end elsewhere. EAGLE groups cache one block further, since they
        look one block past a boundary and then drop it."""
        aligned = num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
        for manager in self.single_type_managers:
            num_tokens = aligned
            if manager.use_eagle and aligned > 0:
                num_tokens = min(num_computed_tokens, aligned + manager.block_size)
            manager.cache_blocks(request, num_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int]:
        """The longest hit all groups accept (the fixed point in the module docstring).

        EAGLE: a group that drops its last block looks one block further, then
        drops it; it does so once per candidate length, and again whenever
        another group shrinks the length.
        """
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest_seen = 0
        # Full attention plus one other type settles in a single pass.
        one_pass = (len(self.attention_groups) == 2
                    and isinstance(self.attention_groups[0].spec, FullAttentionSpec))
        eagle_done: set[int] = set()
        while True:
            length = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle) in \
                    enumerate(self.attention_groups):
                if isinstance(spec, FullAttentionSpec) and hits[group_ids[0]] is not None:
                    # A full-attention hit is prefix-closed: trim, don't look again.
                    length = length // spec.block_size * spec.block_size
                    continue
                drop_eagle = use_eagle and idx not in eagle_done
                max_length = (min(length + spec.block_size, max_cache_hit_length)
                              if drop_eagle else length)
                found = manager_cls.find_longest_cache_hit(
                    self._hashes_for(spec, block_hashes), max_length, group_ids,
                    self.block_pool, spec, drop_eagle, self.scheduler_block_size)
                new_length = len(found[0]) * spec.block_size
                if drop_eagle:
                    eagle_done.add(idx)
                elif new_length < length:
                    eagle_done.clear()  # a shorter candidate needs new EAGLE checks
                length = new_length
                for gid, blocks in zip(group_ids, found):
                    hits[gid] = blocks
                longest_seen = max(longest_seen, length)
            if length >= hit_length:
                break
            hit_length = length
            if one_pass:
                break

        first = self.attention_groups[0]
        if isinstance(first.spec, FullAttentionSpec):
            for gid in first.group_ids:
                if hits[gid] is not None:
                    del hits[gid][hit_length // first.spec.block_size:]
        self.num_uncached_common_prefix_tokens = longest_seen - hit_length
        return tuple(blocks if blocks is not None else [] for blocks in hits), hit_length

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[bytes],
                                         max_cache_hit_length: int
                                         ) -> tuple[HitBlocks, tuple[int, ...]]:
        """Each spec group's own longest hit, without agreeing (vLLM's scheduler
        uses it to report per-group hit rates)."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        lengths = [0] * len(self.single_type_managers)
        for spec, group_ids, manager_cls, use_eagle in self.attention_groups:
            found = manager_cls.find_longest_cache_hit(
                self._hashes_for(spec, block_hashes), max_cache_hit_length, group_ids,
                self.block_pool, spec, use_eagle, self.scheduler_block_size)
            for gid, blocks in zip(group_ids, found):
                hits[gid] = blocks
                lengths[gid] = len(found[0]) * spec.block_size
        return tuple(hits), tuple(lengths)
