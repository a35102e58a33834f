"""The coordinator: one pool, one manager per KV cache group, one agreed prefix hit.

Mirrors ``vllm/v1/core/kv_cache_coordinator.py``. The manager facade talks to a
coordinator; the coordinator fans each call out to the groups' managers and,
for prefix caching, finds the longest hit *every* group can serve:

- ``KVCacheCoordinatorNoPrefixCache``: caching off; any number of groups.
- ``UnitaryKVCacheCoordinator``: one group; its manager's hit is the hit.
- ``HybridKVCacheCoordinator``: several groups (full attention + sliding
  window, + Mamba, ...); the hit is a fixed point, see its docstring.

``get_kv_cache_coordinator`` picks one.

Every coordinator also holds the *prefix-cache retention interval*
(``retention_interval``, vLLM's ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``) and
hands it to each manager's ``cache_blocks``. Unset (``None``, the default),
window and Mamba groups cache every block a hit could end on. Set, they cache
one such block (a window's tail, a Mamba state) per ``retention_interval``
tokens, or none for ``0``, plus the one at the prompt's replay boundary; full
attention ignores it. Fewer cached blocks, fewer hit lengths::

    block size 16, window 16, 256-token prompt     cached window blocks
    unset                                          0 .. 15
    retention_interval=64                          3, 7, 11, 14, 15
    retention_interval=0                           14
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal, NamedTuple

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import BlockHash, BlockHashListWithBlockSize, KVCacheBlock
from kvref.core.single_type_kv_cache_manager import (
    CrossAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from kvref.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.request import Request

HitBlocks = tuple[list[KVCacheBlock], ...]

RETENTION_INTERVAL_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


def retention_interval_from_env() -> int | None:
    """``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` as vLLM's ``envs`` reads it: an
    int, or ``None`` when the variable is unset. Read when a coordinator is
    built (vLLM's tests set it with ``monkeypatch.setenv`` before that)."""
    raw = os.environ.get(RETENTION_INTERVAL_ENV)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{RETENTION_INTERVAL_ENV} must be an integer number of "
                         f"tokens, got {raw!r}") from None


def _validate_prefix_cache_retention_interval(retention_interval: int | None,
                                              scheduler_block_size: int,
                                              kv_cache_config: KVCacheConfig,
                                              source: str = RETENTION_INTERVAL_ENV) -> None:
    """Reject an interval that would do nothing or not land on hit boundaries.

    ``source`` names the setting in the message (the variable, or the keyword).
    """
    if retention_interval is None:
        return
    if isinstance(retention_interval, bool) or not isinstance(retention_interval, int):
        raise ValueError(f"{source} must be an int or None, got {retention_interval!r}")
    if not any(isinstance(g.kv_cache_spec, (SlidingWindowSpec, MambaSpec))
               for g in kv_cache_config.kv_cache_groups):
        raise ValueError(f"{source} is set ({retention_interval}) but no KV cache group "
                         "is sliding-window or Mamba, the only kinds it thins out; "
                         "unset it")
    # Hits are multiples of scheduler_block_size; a tail between two of them
    # could never be hit. A negative multiple passes the modulo test, hence both.
    if retention_interval < 0 or retention_interval % scheduler_block_size != 0:
        raise ValueError(f"{source} ({retention_interval}) must be non-negative and a "
                         f"multiple of scheduler_block_size ({scheduler_block_size})")


class KVCacheCoordinator(ABC):
    """Holds the pool and the managers; the calls every coordinator shares.

    ``retention_interval`` (keyword, see the module docstring): ``"env"``, the
    default, reads ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` as vLLM does; an
    int or ``None`` sets it explicitly (``None``: unset, dense caching). Either
    way it is checked here: it needs a sliding-window or Mamba group and must
    be a non-negative multiple of ``scheduler_block_size``.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_num_batched_tokens: int, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, scheduler_block_size: int,
                 hash_block_size: int, *,
                 retention_interval: int | None | Literal["env"] = "env") -> None:
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size <= 0 or hash_block_size <= 0:
            raise ValueError(f"scheduler_block_size ({scheduler_block_size}) and "
                             f"hash_block_size ({hash_block_size}) must be positive")
        if scheduler_block_size % hash_block_size != 0:
            raise ValueError(f"scheduler_block_size {scheduler_block_size} is not a "
                             f"multiple of hash_block_size {hash_block_size}")
        for i, group in enumerate(groups):
            if scheduler_block_size % group.kv_cache_spec.block_size != 0:
                raise ValueError(f"kv_cache_groups[{i}] block_size "
                                 f"{group.kv_cache_spec.block_size} does not divide "
                                 f"scheduler_block_size {scheduler_block_size}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                                    hash_block_size, enable_kv_cache_events)
        # Groups whose hits drop the last block for EAGLE; all of them when
        # EAGLE is on but no group is marked.
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec, max_num_batched_tokens, max_model_len,
                block_pool=self.block_pool, enable_caching=enable_caching,
                kv_cache_group_id=i, scheduler_block_size=scheduler_block_size)
            for i, group in enumerate(groups))
        if retention_interval == "env":
            self.retention_interval = retention_interval_from_env()
            source = RETENTION_INTERVAL_ENV
        else:
            self.retention_interval = retention_interval
            source = "retention_interval"
        _validate_prefix_cache_retention_interval(self.retention_interval,
                                                  scheduler_block_size, kv_cache_config,
                                                  source)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_tokens_main_model: int,
                                   apply_admission_cap: bool = False) -> int:
        """Sum over groups of the free blocks the step would take.
        Cross-attention groups count one static allocation of the encoder tokens."""
        total = 0
        for manager, hit in zip(self.single_type_managers, new_computed_blocks):
            if isinstance(manager, CrossAttentionManager):
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, num_encoder_tokens,
                    apply_admission_cap)
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_tokens, hit, total_computed_tokens,
                    num_tokens_main_model, apply_admission_cap)
        return total

    def allocate_new_computed_blocks(self, request_id: str,
                                     new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                     num_local_computed_tokens: int,
                                     num_external_computed_tokens: int) -> None:
        """First allocation of a request: its hits, then blocks for external tokens.

        Every group touches its hits before any group allocates, so one group's
        fresh allocation cannot evict another group's hit.
        """
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            if any(new_computed_blocks):
                raise ValueError(f"request {request_id!r} is already running and "
                                 "cannot take new prefix-hit blocks")
            return
        for manager, hit in zip(self.single_type_managers, new_computed_blocks):
            manager.add_local_computed_blocks(request_id, hit, num_local_computed_tokens,
                                              num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for manager in self.single_type_managers:
                manager.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int, num_encoder_tokens: int = 0
                            ) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group's table; cross-attention groups to ``num_encoder_tokens``."""
        return tuple([
            m.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(m, CrossAttentionManager) else num_tokens,
                num_tokens_main_model)
            for m in self.single_type_managers])

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens,
                                 retention_interval=self.retention_interval)

    def free(self, request_id: str) -> None:
        """Free group by group, each group's blocks tail first."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """All groups' blocks concatenated, each in table order."""
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(running_request_id)
                for m in self.single_type_managers]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens,
                                          num_prompt_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        # .get, not [...]: looking must not create an entry.
        return tuple([m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers])

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int]:
        """``(hit blocks per group, hit length in tokens)``."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: never a hit, nothing cached, any number of groups."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_num_batched_tokens: int, use_eagle: bool, enable_kv_cache_events: bool,
                 scheduler_block_size: int, hash_block_size: int, *,
                 retention_interval: int | None | Literal["env"] = "env") -> None:
        super().__init__(kv_cache_config, max_model_len, max_num_batched_tokens, use_eagle,
                         False, enable_kv_cache_events, scheduler_block_size,
                         hash_block_size, retention_interval=retention_interval)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * len(self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group: its manager's hit search decides alone."""

    def __init__(self, kv_cache_config: KVCacheConfig, *args, **kwargs) -> None:
        super().__init__(kv_cache_config, *args, **kwargs)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("UnitaryKVCacheCoordinator needs exactly one KV cache group, "
                             f"got {len(kv_cache_config.kv_cache_groups)}")
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size
        if self.enable_caching and self.hash_block_size != self.block_size:
            raise ValueError(f"with one KV cache group, hash_block_size "
                             f"({self.hash_block_size}) must equal its block_size "
                             f"({self.block_size})")
        self.single_type_managers[0].use_eagle = 0 in self.eagle_group_ids

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int]:
        hit = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec,
            drop_eagle_block=0 in self.eagle_group_ids, alignment_tokens=self.block_size)
        return hit, len(hit[0]) * self.block_size


class SpecGroup(NamedTuple):
    """Groups with equal specs, looked up together (one hash probe per block).

    ``use_eagle`` if any member is an EAGLE group: members share their hits,
    so the EAGLE drop applies to all of them.
    """

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV cache groups of different attention types sharing one pool.

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

    def _hashes_for(self, spec: KVCacheSpec,
                    block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        if spec.block_size == self.hash_block_size:
            return block_hashes
        return BlockHashListWithBlockSize(block_hashes, self.hash_block_size, spec.block_size)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache up to the last ``scheduler_block_size`` boundary only: hits
        never end elsewhere. EAGLE groups cache one block further, since they
        look one block past a boundary and then drop it. The retention interval
        goes along unchanged: a manager needs both it and the fine alignment."""
        aligned = num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
        for manager in self.single_type_managers:
            num_tokens = aligned
            if manager.use_eagle and aligned > 0:
                num_tokens = min(num_computed_tokens, aligned + manager.block_size)
            manager.cache_blocks(request, num_tokens,
                                 retention_interval=self.retention_interval)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[HitBlocks, int]:
        """The longest hit all groups accept (the fixed point in the module docstring).

        EAGLE: a group that drops its last block looks one block further, then
        drops it; it does so once per candidate length, and again whenever
        another group shrinks the length.
        """
        # vLLM's names: hit_length is the candidate every group accepted so far,
        # curr_hit_length what this pass has shrunk it to.
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = \
            [None] * len(self.single_type_managers)
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        # Full attention plus one other type settles in a single pass.
        is_simple_hybrid = (len(self.attention_groups) == 2
                            and isinstance(self.attention_groups[0].spec, FullAttentionSpec))
        # Attention groups whose EAGLE drop holds at the current candidate length.
        eagle_verified: set[int] = set()
        while True:
            curr_hit_length = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle) in \
                    enumerate(self.attention_groups):
                if isinstance(spec, FullAttentionSpec) and \
                        hit_blocks_by_group[group_ids[0]] is not None:
                    # A full-attention hit is prefix-closed: trim, don't look again.
                    curr_hit_length = curr_hit_length // spec.block_size * spec.block_size
                    continue
                drop_eagle_block = use_eagle and idx not in eagle_verified
                max_length = (min(curr_hit_length + spec.block_size, max_cache_hit_length)
                              if drop_eagle_block else curr_hit_length)
                hit_blocks = manager_cls.find_longest_cache_hit(
                    self._hashes_for(spec, block_hashes), max_length, group_ids,
                    self.block_pool, spec, drop_eagle_block, self.scheduler_block_size)
                new_hit_length = len(hit_blocks[0]) * spec.block_size
                if drop_eagle_block:
                    eagle_verified.add(idx)
                elif new_hit_length < curr_hit_length:
                    eagle_verified.clear()  # a shorter candidate needs new EAGLE checks
                curr_hit_length = new_hit_length
                for gid, blocks in zip(group_ids, hit_blocks):
                    hit_blocks_by_group[gid] = blocks
                longest_hit_length = max(longest_hit_length, curr_hit_length)
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if is_simple_hybrid:
                break

        first = self.attention_groups[0]
        if isinstance(first.spec, FullAttentionSpec):
            for gid in first.group_ids:
                if hit_blocks_by_group[gid] is not None:
                    del hit_blocks_by_group[gid][hit_length // first.spec.block_size:]
        self.num_uncached_common_prefix_tokens = longest_hit_length - hit_length
        return (tuple(blocks if blocks is not None else [] for blocks in hit_blocks_by_group),
                hit_length)

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[BlockHash],
                                         max_cache_hit_length: int
                                         ) -> tuple[HitBlocks, tuple[int, ...]]:
        """Each spec group's own longest hit, without agreeing. vLLM's scheduler
        uses it for a Mamba hybrid with a KV connector: the connector is asked
        from the longest of these hits (``scheduler.py:689-722``)."""
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



def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int,
                             max_num_batched_tokens: int, use_eagle: bool,
                             enable_caching: bool, enable_kv_cache_events: bool,
                             scheduler_block_size: int, hash_block_size: int, *,
                             retention_interval: int | None | Literal["env"] = "env"
                             ) -> KVCacheCoordinator:
    """No caching -> no-prefix-cache coordinator; one group -> unitary; else hybrid.
    ``retention_interval``: as ``KVCacheCoordinator`` takes it (``"env"``: read
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``)."""
    common = dict(kv_cache_config=kv_cache_config, max_model_len=max_model_len,
                  max_num_batched_tokens=max_num_batched_tokens, use_eagle=use_eagle,
                  enable_kv_cache_events=enable_kv_cache_events,
                  scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
                  retention_interval=retention_interval)
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(**common)
    if any(isinstance(g.kv_cache_spec, CrossAttentionSpec)
           for g in kv_cache_config.kv_cache_groups):
        raise ValueError("cross-attention groups cannot be prefix-cached; "
                         "use enable_caching=False (as vLLM does for encoder-decoder models)")
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(**common, enable_caching=True)
    return HybridKVCacheCoordinator(**common, enable_caching=True)


__all__ = [
    "HybridKVCacheCoordinator", "KVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache",
    "RETENTION_INTERVAL_ENV", "SpecGroup", "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator", "retention_interval_from_env",
]
