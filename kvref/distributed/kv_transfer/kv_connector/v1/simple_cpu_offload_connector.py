"""A CPU offload tier: a second, larger KV pool in host memory, timed as vLLM's.

Mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py``
with ``vllm/v1/simple_kv_offload/manager.py`` (the scheduler half) and
``worker.py`` (the worker half), v0.25.1. The host pool is a second
``BlockPool`` with its own coordinator, over the same KV cache groups as the
device pool (``manager.py:182-218``); its free queue is its LRU. A block is
*hittable* on the host once its hash is in that pool's cache map.

Eager mode (the default) stores every block a request has **confirmed**:
``num_computed_tokens - num_output_placeholders``, whole blocks
(``manager.py:539-547, 594-599``), so the blocks a step computes are stored by
the next step's plan, and a request that finishes in the step that fills its
last block does not store it itself ("may be missed", ``manager.py:544-547``): a
later request whose prefix hits that still-cached device block stores it. A
14-token prompt, block size 4::

    step 0  computes tokens 0-13; plan: nothing (0 tokens confirmed)
    step 1  plan: blocks 0-2 (12 of 14 confirmed) -> 3 new host blocks; the
            device blocks get a ref, the host blocks their hashes but no entry
            in the cache map; the worker launches the copy after the forward
    step 2  the worker finds it done (kv_connector_worker_meta); every worker
            reported it -> update_connector_output puts the host blocks in the
            cache map (hittable) and drops both holds (manager.py:683-760)

A hit (``get_num_new_matched_tokens``) is always asynchronous: the request
waits in ``WAITING_FOR_REMOTE_KVS``; its load is launched in that step's
``get_finished`` and reported in ``finished_recving`` when the worker finds it
done at a poll (``worker.py:224-267``); a copy thread records the event after
the launch has returned (``copy_backend.py:82-130``), so that is usually a
later step's poll.
``save_kv_layer``, ``start_load_kv`` and the waits do nothing
(``simple_cpu_offload_connector.py:143-159``).

Lazy mode (``lazy_offload: True``) stores nothing when computed; each step
walks the device pool's free queue from a cursor and offloads the cached
blocks nearest eviction, up to a target of free-or-offloaded blocks
(``manager.py:220-238, 471-537``).

``kv_connector_extra_config`` (vLLM's keys): ``cpu_bytes_to_use`` (default
8 GiB, over all ranks), ``cpu_bytes_to_use_per_rank`` (overrides it),
``lazy_offload`` (default False). Host blocks:
``max(1, num_gpu_blocks * bytes // gpu_bytes)`` (``manager.py:201-202``). The
8 GiB default is vLLM's; with kvref's small models it is millions of host
blocks, so give a size.

Where kvref differs from vLLM's:

* The copies are plain tensor copies done when launched (in ``get_finished``);
  the worker reports an event done at its next poll (vLLM's, a real copy, at
  whichever poll finds it done: rarely the launching one, maybe a later one).
  Tests that need other timings override ``_copy_latency``.
* kvref's connectors are built without the engine's config: the lazy target
  needs ``max_num_batched_tokens`` (vLLM reads ``scheduler_config``,
  ``manager.py:158-162``), so in lazy mode it is a kvref-only key of
  ``kv_connector_extra_config``, required; ``world_size`` (workers whose
  reports a store needs, ``manager.py:179``) is a kvref-only key, default 1.
  Prefix caching is always on in kvref, so the tier is never disabled
  (``simple_cpu_offload_connector.py:82-87``).
* vLLM's worker sizes its host tensors itself (``worker.py:141-146``);
  kvref's worker half uses the scheduler half's count (the same for one
  tensor per layer).
* ``reset_cache`` (``manager.py:883-921``), the host pool's KV cache events,
  the connector's metrics and the preemption flush (``need_flush`` is planned,
  ``worker.py:279-297`` is not run: kvref's copies are never in flight on a
  device) are not modelled. vLLM's tier never reports a failed load; kvref's
  reports none either (a test connector may).

Checked against vLLM: ``tools/record_vllm_offload.py`` drives vLLM's own
scheduler and worker halves over seeded workloads (eager and lazy, one group
and hybrid, synchronous and asynchronous scheduling);
``tests/distributed/test_offload_vs_vllm.py`` requires kvref's plans to equal
them step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kvref.core.kv_cache_coordinator import get_kv_cache_coordinator
from kvref.core.kv_cache_utils import resolve_kv_cache_block_sizes
from kvref.distributed.kv_transfer.kv_connector.utils import yield_req_data
from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole,
    KVConnectorWorkerMetadata, SupportsHMA)
from kvref.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, MambaSpec,
                                      SlidingWindowSpec)
from kvref.math_utils import cdiv

# The scheduler half needs no torch (vLLM keeps it in simple_kv_offload/manager.py,
# which imports none); the worker half imports it where it touches tensors.
if TYPE_CHECKING:
    import torch

__all__ = ["SimpleCPUOffloadConnector", "SimpleCPUOffloadMetadata",
           "SimpleCPUOffloadWorkerMetadata"]

DEFAULT_CPU_CAPACITY_BYTES = 8 * (1 << 30)      # vLLM's default, 8 GiB
NO_EVENT = -1


@dataclass
class SimpleCPUOffloadMetadata(KVConnectorMetadata):
    """One step's plan: at most one load event and one store event, flat block lists
    (``vllm/v1/simple_kv_offload/metadata.py``); ``load_event_to_reqs``: every load
    event still in flight, so the worker can name the requests it finds done."""

    load_event: int = NO_EVENT
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_cpu_blocks: list[int] = field(default_factory=list)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    store_event: int = NO_EVENT
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    need_flush: bool = False


@dataclass
class SimpleCPUOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Store events a worker found done: ``{event: number of workers}``."""

    completed_store_events: dict[int, int]

    def aggregate(self, other: SimpleCPUOffloadWorkerMetadata
                  ) -> SimpleCPUOffloadWorkerMetadata:
        merged = dict(self.completed_store_events)
        for event, count in other.completed_store_events.items():
            merged[event] = merged.get(event, 0) + count
        return SimpleCPUOffloadWorkerMetadata(merged)


@dataclass
class _Load:
    request: Any
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    event: int | None = None                 # None until a plan sends it


@dataclass
class _Stores:
    """Eager mode: a request's block ids (per group) and how many of each group
    are stored or skipped; the store events still carrying its blocks."""

    request: Any
    block_ids: tuple[list[int], ...]
    num_done: list[int]
    events: set[int] = field(default_factory=set)
    finished: bool = False


def host_kv_cache_config(gpu_config: KVCacheConfig, cpu_bytes: int) -> KVCacheConfig:
    """The host pool: the device pool's groups, as many blocks as ``cpu_bytes`` holds
    (``manager.py:182-218``). Without ``kv_cache_tensors`` (a bare config), a block's
    bytes are every layer's page."""
    if gpu_config.kv_cache_tensors:
        gpu_bytes = sum(t.size for t in gpu_config.kv_cache_tensors)
    else:
        gpu_bytes = gpu_config.num_blocks * sum(
            g.kv_cache_spec.page_size_bytes * len(g.layer_names)
            for g in gpu_config.kv_cache_groups)
    num_cpu_blocks = max(1, gpu_config.num_blocks * cpu_bytes // gpu_bytes)
    return KVCacheConfig(num_cpu_blocks, gpu_config.kv_cache_groups)


class SimpleCPUOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offload blocks to a host ``BlockPool``; serve later prompts from it, asynchronously."""

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        extra = kv_transfer_config.kv_connector_extra_config or {}
        self.world_size = int(extra.get("world_size", 1))
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        cpu_bytes = int(extra.get("cpu_bytes_to_use", DEFAULT_CPU_CAPACITY_BYTES)
                        ) // self.world_size
        if "cpu_bytes_to_use_per_rank" in extra:
            cpu_bytes = int(extra["cpu_bytes_to_use_per_rank"])
        if cpu_bytes <= 0:
            raise ValueError(f"the CPU offload tier needs a positive size, got {cpu_bytes} "
                             "bytes per rank (cpu_bytes_to_use / cpu_bytes_to_use_per_rank)")
        self.lazy_offload = bool(extra.get("lazy_offload", False))
        groups = kv_cache_config.kv_cache_groups
        self._block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                                for g in groups)
        self.cpu_kv_cache_config = host_kv_cache_config(kv_cache_config, cpu_bytes)
        self.num_cpu_blocks = self.cpu_kv_cache_config.num_blocks
        # Each half builds only its own state, as vLLM's (``:98-116``).
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler_side(extra)
        else:
            self._init_worker_side()

    # -- scheduler side ----------------------------------------------------------

    def _init_scheduler_side(self, extra: dict) -> None:
        config = self.cpu_kv_cache_config
        limits = SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=config.kv_cache_groups[0].kv_cache_spec.block_size,
                enable_prefix_caching=True, hash_block_size=None),
            parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                            prefill_context_parallel_size=1),
            kv_transfer_config=self._kv_transfer_config)
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(config, limits)
        # The first full-attention group finds where a request's external tokens start.
        self.fa_gidx = next((i for i, g in enumerate(config.kv_cache_groups)
                             if isinstance(g.kv_cache_spec, FullAttentionSpec)), None)
        if self.fa_gidx is None:
            raise ValueError("the CPU offload tier needs a full-attention KV cache group "
                             "(vLLM asserts one, manager.py:97-103); got "
                             f"{[type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]}")
        self.fa_block_size = config.kv_cache_groups[self.fa_gidx].kv_cache_spec.block_size
        max_batched = extra.get("max_num_batched_tokens")
        if self.lazy_offload and max_batched is None:
            raise ValueError("lazy_offload needs max_num_batched_tokens in "
                             "kv_connector_extra_config (vLLM reads it from the scheduler "
                             "config; kvref's connectors are built without it)")
        self.cpu_coordinator = get_kv_cache_coordinator(
            config, max_model_len=1 << 30,
            max_num_batched_tokens=int(max_batched or 1 << 30), use_eagle=False,
            enable_caching=True, enable_kv_cache_events=False,
            scheduler_block_size=self.block_size, hash_block_size=self.hash_block_size)
        self.cpu_block_pool = self.cpu_coordinator.block_pool
        self._gpu_block_pool = None
        self._target_free = self.lazy_target(config, int(max_batched)) \
            if self.lazy_offload else 0
        self._cursor = None                      # lazy: the last free-queue block looked at
        self._pending_hits: dict[str, tuple] = {}   # req -> (host hit blocks, hit length)
        self._reqs_to_load: dict[str, _Load] = {}
        self._load_event_to_reqs: dict[int, list[str]] = {}
        self._reqs_to_store: dict[str, _Stores] = {}
        self._store_event_to_blocks: dict[int, tuple[list[int], list[int]]] = {}
        self._store_event_to_reqs: dict[int, list[str]] = {}
        self._store_event_reports: dict[int, int] = {}    # workers that reported so far
        self._in_flight_store_gpu_blocks: set[int] = set()
        self._next_load_event = 0
        self._next_store_event = 0

    @staticmethod
    def lazy_target(config: KVCacheConfig, max_num_batched_tokens: int) -> int:
        """Device blocks lazy mode keeps free or offloaded (``manager.py:220-238``):
        per group a step's worth of blocks (a window's, two for Mamba), doubled."""
        target = 0
        for group in config.kv_cache_groups:
            spec = group.kv_cache_spec
            if isinstance(spec, MambaSpec):
                target += 2
            elif isinstance(spec, SlidingWindowSpec):
                target += cdiv(spec.sliding_window, spec.block_size) + 1
            else:
                target += cdiv(max_num_batched_tokens, spec.block_size)
        return 2 * target

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        """The device pool: stores and loads hold refs on its blocks, lazy mode
        walks its free queue. Without it the tier stores nothing (``manager.py:557``)."""
        self._gpu_block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """The host's hit after the device's, always asynchronous. The hit blocks
        are pinned until ``update_state_after_alloc`` (a retry drops the old pin)."""
        stale = self._pending_hits.pop(request.request_id, None)
        if stale is not None:
            self._unpin_hit(stale)
        hashes = request.block_hashes[num_computed_tokens // self.hash_block_size:]
        max_hit = request.num_tokens - 1 - num_computed_tokens   # the last token computes
        if not hashes or max_hit <= 0:
            return 0, False
        hit_blocks, hit_length = self.cpu_coordinator.find_longest_cache_hit(hashes, max_hit)
        if hit_length <= 0:
            return 0, False
        self.cpu_block_pool.touch([b for group in hit_blocks for b in group if not b.is_null])
        self._pending_hits[request.request_id] = (hit_blocks, hit_length)
        return hit_length, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        block_ids = blocks.get_block_ids()
        if not self.lazy_offload and req_id not in self._reqs_to_store:
            self._reqs_to_store[req_id] = _Stores(request, tuple([] for _ in block_ids),
                                                  [0] * len(block_ids))
        pending = self._pending_hits.pop(req_id, None)
        if num_external_tokens == 0 or pending is None:
            if pending is not None:
                self._unpin_hit(pending)
            return
        # The external blocks end where the device hit plus the load end, per group.
        num_local_fa = sum(b.block_hash is not None for b in blocks.blocks[self.fa_gidx])
        end_tokens = num_local_fa * self.fa_block_size + num_external_tokens
        gpu_ids, cpu_blocks = [], []
        for g, group in enumerate(self.cpu_kv_cache_config.kv_cache_groups):
            g_size = group.kv_cache_spec.block_size
            assert num_external_tokens % g_size == 0, (num_external_tokens, g_size)
            host = pending[0][g][:num_external_tokens // g_size]
            start = cdiv(end_tokens, g_size) - len(host)
            for i, cpu_block in enumerate(host):
                if not cpu_block.is_null:
                    gpu_ids.append(block_ids[g][start + i])
                    cpu_blocks.append(cpu_block)
        self.cpu_block_pool.touch(cpu_blocks)     # held for the load ...
        self._unpin_hit(pending)                  # ... the lookup's pin dropped
        gpu_pool = self._gpu_block_pool
        gpu_pool.touch([gpu_pool.blocks[i] for i in gpu_ids])
        assert req_id not in self._reqs_to_load, req_id
        self._reqs_to_load[req_id] = _Load(request, gpu_ids,
                                           [b.block_id for b in cpu_blocks])

    def build_connector_meta(self, scheduler_output) -> SimpleCPUOffloadMetadata:
        """This step's store (one event) and the loads not sent yet (one event)."""
        meta = SimpleCPUOffloadMetadata(need_flush=bool(
            getattr(scheduler_output, "preempted_req_ids", None)))
        store_gpu, store_cpu, store_reqs = (self._plan_lazy_stores() if self.lazy_offload
                                            else self._plan_eager_stores(scheduler_output))
        if store_gpu:
            meta.store_event = self._next_store_event
            self._next_store_event += 1
            meta.store_gpu_blocks, meta.store_cpu_blocks = store_gpu, store_cpu
            self._store_event_to_blocks[meta.store_event] = (store_gpu, store_cpu)
            if store_reqs:
                self._store_event_to_reqs[meta.store_event] = store_reqs
                for req_id in store_reqs:
                    self._reqs_to_store[req_id].events.add(meta.store_event)
        to_send = [r for r, load in self._reqs_to_load.items() if load.event is None]
        if to_send:
            meta.load_event = self._next_load_event
            self._next_load_event += 1
            for req_id in to_send:
                load = self._reqs_to_load[req_id]
                load.event = meta.load_event
                meta.load_gpu_blocks += load.gpu_block_ids
                meta.load_cpu_blocks += load.cpu_block_ids
            self._load_event_to_reqs[meta.load_event] = to_send
        meta.load_event_to_reqs = {e: list(r) for e, r in self._load_event_to_reqs.items()}
        return meta

    def _plan_eager_stores(self, scheduler_output) -> tuple[list[int], list[int], list[str]]:
        """Each scheduled request's confirmed, unstored blocks, until the host is full."""
        gpu_pool = self._gpu_block_pool
        if gpu_pool is None:
            return [], [], []
        groups = self.cpu_kv_cache_config.kv_cache_groups
        num_free = self.cpu_block_pool.get_num_free_blocks()
        all_gpu, all_cpu, req_ids = [], [], []
        for req_id, new_ids, preempted, _ in yield_req_data(scheduler_output):
            state = self._reqs_to_store.get(req_id)
            if state is None or state.finished:
                continue
            if preempted:           # resumed after preemption: its whole table again
                state.block_ids = tuple([] for _ in groups)
                state.num_done = [0] * len(groups)
            for g, ids in enumerate(new_ids or ()):
                if g < len(groups) and ids is not None:
                    state.block_ids[g].extend(ids)
            if not scheduler_output.num_scheduled_tokens.get(req_id, 0):
                continue
            request = state.request
            confirmed = request.num_computed_tokens - getattr(request, "num_output_placeholders", 0)
            aligned = confirmed // self.block_size * self.block_size
            gpu_ids, hashes, advanced = [], [], [0] * len(groups)
            full = False
            for g, group in enumerate(groups):
                ready = aligned // group.kv_cache_spec.block_size
                for block_id in state.block_ids[g][state.num_done[g]:ready]:
                    block = gpu_pool.blocks[block_id]
                    if not (block.is_null or block.block_hash is None
                            or block_id in self._in_flight_store_gpu_blocks
                            or self.cpu_block_pool.cached_block_hash_to_block.get_one_block(
                                block.block_hash) is not None):
                        if num_free <= 0:
                            full = True
                            break
                        num_free -= 1
                        gpu_ids.append(block_id)
                        hashes.append(block.block_hash)
                    advanced[g] += 1
                if full:
                    break
            if gpu_ids:
                cpu_ids = self._new_host_blocks(hashes)
                req_ids.append(req_id)
                all_gpu += gpu_ids
                all_cpu += cpu_ids
                self._in_flight_store_gpu_blocks.update(gpu_ids)
                gpu_pool.touch([gpu_pool.blocks[i] for i in gpu_ids])
            for g in range(len(groups)):
                state.num_done[g] += advanced[g]
        return all_gpu, all_cpu, req_ids

    def _plan_lazy_stores(self) -> tuple[list[int], list[int], list[str]]:
        """Walk the device free queue from the cursor: cached blocks not on the host
        are offloaded until ``_target_free`` blocks are covered or the host is full."""
        gpu_pool = self._gpu_block_pool
        if gpu_pool is None or self._target_free <= 0:
            return [], [], []
        queue = gpu_pool.free_block_queue
        num_cpu_free = self.cpu_block_pool.get_num_free_blocks()
        if self._cursor is not None and self._cursor.ref_cnt > 0:
            self._cursor = None                   # it left the free queue
        node = (queue.fake_free_list_head if self._cursor is None
                else self._cursor).next_free_block
        gpu_ids, hashes, covered, last = [], [], 0, self._cursor
        while node is not None and node is not queue.fake_free_list_tail \
                and covered < self._target_free and len(gpu_ids) < num_cpu_free:
            last = node
            if node.block_hash is not None and not node.is_null and \
                    self.cpu_block_pool.cached_block_hash_to_block.get_one_block(
                        node.block_hash) is None:
                gpu_ids.append(node.block_id)
                hashes.append(node.block_hash)
            covered += 1
            node = node.next_free_block
        self._cursor = last
        if not gpu_ids:
            return [], [], []
        cpu_ids = self._new_host_blocks(hashes)
        gpu_pool.touch([gpu_pool.blocks[i] for i in gpu_ids])
        return gpu_ids, cpu_ids, []

    def _new_host_blocks(self, hashes: list) -> list[int]:
        """Host blocks for a store, stamped with their hashes but not yet in the cache
        map (not hittable until the store is reported done)."""
        blocks = self.cpu_block_pool.get_new_blocks(len(hashes))
        for block, block_hash in zip(blocks, hashes):
            block._block_hash = block_hash
        return [b.block_id for b in blocks]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads the worker found done end; a store every worker reported becomes hittable."""
        for req_id in list(connector_output.finished_recving or ()):
            self._end_load(req_id)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, SimpleCPUOffloadWorkerMetadata):
            return
        for event, count in meta.completed_store_events.items():
            total = self._store_event_reports.pop(event, 0) + count
            if total < self.world_size:
                self._store_event_reports[event] = total
            else:
                self._store_done(event)

    def _store_done(self, event: int) -> None:
        gpu_ids, cpu_ids = self._store_event_to_blocks.pop(event)
        self._in_flight_store_gpu_blocks.difference_update(gpu_ids)
        cpu_blocks = [self.cpu_block_pool.blocks[i] for i in cpu_ids]
        for block in cpu_blocks:
            self.cpu_block_pool.cached_block_hash_to_block.insert(block.block_hash, block)
        self.cpu_block_pool.free_blocks(cpu_blocks)        # cached, evictable
        self._gpu_block_pool.free_blocks(self._gpu_block_pool.blocks[i] for i in gpu_ids)
        for req_id in self._store_event_to_reqs.pop(event, []):
            state = self._reqs_to_store.get(req_id)
            if state is not None:
                state.events.discard(event)
                if state.finished and not state.events:
                    self._forget_stores(req_id)

    def reset_cache(self) -> bool | None:
        """Not modelled: vLLM's tier abandons its transfers and resets the host pool
        when it is safe (``manager.py:883-921``); kvref's says so instead of
        answering as if it had."""
        raise NotImplementedError("kvref's SimpleCPUOffloadConnector does not model "
                                  "reset_cache (vLLM's simple_kv_offload/manager.py:883-921)")

    def has_pending_stores(self) -> bool:
        return bool(self._store_event_to_blocks)

    def gpu_blocks_held(self) -> list[list]:
        """The device blocks the tier holds a reference on (kvref's, for invariant
        checks): one list per store in flight and per load."""
        blocks = self._gpu_block_pool.blocks if self._gpu_block_pool else []
        return [[blocks[i] for i in ids] for ids, _ in self._store_event_to_blocks.values()] \
            + [[blocks[i] for i in load.gpu_block_ids] for load in self._reqs_to_load.values()]

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Never holds the blocks: stores and loads in flight hold refs of their own."""
        req_id = request.request_id
        pending = self._pending_hits.pop(req_id, None)
        if pending is not None:
            self._unpin_hit(pending)
        load = self._reqs_to_load.get(req_id)
        if load is not None and load.event is None:
            self._end_load(req_id)                # never sent: nothing in flight
        state = self._reqs_to_store.get(req_id)
        if state is not None:
            if state.events:
                state.finished = True             # forgotten when its stores end
            else:
                self._forget_stores(req_id)
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def _unpin_hit(self, pending: tuple) -> None:
        blocks = [b for group in pending[0] for b in group if not b.is_null]
        if blocks:
            self.cpu_block_pool.free_blocks(blocks)

    def _end_load(self, req_id: str) -> None:
        load = self._reqs_to_load.pop(req_id, None)
        if load is None:
            return
        if load.event is not None:
            reqs = self._load_event_to_reqs.get(load.event, [])
            if req_id in reqs:
                reqs.remove(req_id)
            if not reqs:
                self._load_event_to_reqs.pop(load.event, None)
        self.cpu_block_pool.free_blocks(self.cpu_block_pool.blocks[i]
                                        for i in load.cpu_block_ids)
        self._gpu_block_pool.free_blocks(self._gpu_block_pool.blocks[i]
                                         for i in load.gpu_block_ids)

    def _forget_stores(self, req_id: str) -> None:
        state = self._reqs_to_store.pop(req_id, None)
        if state is None:
            return
        for event in state.events:
            reqs = self._store_event_to_reqs.get(event)
            if reqs is not None and req_id in reqs:
                reqs.remove(req_id)
                if not reqs:
                    del self._store_event_to_reqs[event]
        state.events.clear()

    # -- worker side -------------------------------------------------------------

    def _init_worker_side(self) -> None:
        self.cpu_kv: dict[str, torch.Tensor] = {}
        self._pending_load_events: set[int] = set()
        self._pending_store_events: set[int] = set()
        # Launched copies, oldest first: [event, polls until found done]; a stream's
        # events are found in order (a poll stops at the first one not done).
        self._launched = {"load": [], "store": []}
        self._done_up_to = {"load": NO_EVENT, "store": NO_EVENT}
        self._completed_store_events: dict[int, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if not kv_caches:            # the simulator's worker: no tensors, so no torch
            return
        import torch

        self.cpu_kv = {name: torch.zeros((self.num_cpu_blocks, *t.shape[1:]), dtype=t.dtype,
                                         device="cpu", pin_memory=t.is_cuda)
                       for name, t in kv_caches.items()}

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if connector_metadata.load_event >= 0:
            self._pending_load_events.add(connector_metadata.load_event)
        if connector_metadata.store_event >= 0:
            self._pending_store_events.add(connector_metadata.store_event)

    def start_load_kv(self, **kwargs: Any) -> None:
        return                                    # launched in get_finished, after the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return                                    # stores copy confirmed blocks, later

    def wait_for_save(self) -> None:
        return

    def _copy_latency(self, kind: str, event: int) -> int:
        """Polls after the launch at which a copy is found done (>= 1: not the
        launching poll). kvref's copies are done at once; vLLM finds them no earlier."""
        return 1

    def _copy(self, kind: str, src: list[int], dst: list[int]) -> None:
        if self.kv_caches:           # the simulator registers none: nothing to copy, no torch
            self._copy_tensors(kind, src, dst)
        if kind == "store":
            self.stats.num_saved_blocks += len(src)
            self.stats.bytes_saved += len(src) * self._block_bytes
        else:
            self.stats.num_loaded_blocks += len(src)
            self.stats.bytes_loaded += len(src) * self._block_bytes

    def _copy_tensors(self, kind: str, src: list[int], dst: list[int]) -> None:
        import torch

        index = torch.tensor
        for name, gpu in self.kv_caches.items():
            cpu = self.cpu_kv[name]
            if kind == "store":
                cpu[index(dst, dtype=torch.long)] = gpu.index_select(
                    0, index(src, dtype=torch.long, device=gpu.device)).cpu()
            else:
                gpu[index(dst, dtype=torch.long, device=gpu.device)] = cpu.index_select(
                    0, index(src, dtype=torch.long)).to(gpu.device)

    def _poll(self, kind: str) -> int:
        launched = self._launched[kind]
        for entry in launched:
            entry[1] -= 1
        while launched and launched[0][1] <= 0:
            self._done_up_to[kind] = launched.pop(0)[0]
        return self._done_up_to[kind]

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Launch this step's copies, then report the loads and stores found done."""
        meta = self._connector_metadata
        if meta is not None:
            if meta.load_cpu_blocks:
                self._copy("load", meta.load_cpu_blocks, meta.load_gpu_blocks)
                self._launched["load"].append(
                    [meta.load_event, self._copy_latency("load", meta.load_event) + 1])
            if meta.store_gpu_blocks:
                self._copy("store", meta.store_gpu_blocks, meta.store_cpu_blocks)
                self._launched["store"].append(
                    [meta.store_event, self._copy_latency("store", meta.store_event) + 1])
        finished_recving: set[str] = set()
        if self._pending_load_events:
            done = self._poll("load")
            for event in [e for e in self._pending_load_events if e <= done]:
                self._pending_load_events.discard(event)
                if meta is not None:
                    finished_recving.update(meta.load_event_to_reqs.get(event, ()))
        if self._pending_store_events:
            done = self._poll("store")
            for event in [e for e in self._pending_store_events if e <= done]:
                self._pending_store_events.discard(event)
                self._completed_store_events[event] = 1
        return None, finished_recving or None

    def build_connector_worker_meta(self) -> SimpleCPUOffloadWorkerMetadata | None:
        if not self._completed_store_events:
            return None
        meta = SimpleCPUOffloadWorkerMetadata(self._completed_store_events)
        self._completed_store_events = {}
        return meta
