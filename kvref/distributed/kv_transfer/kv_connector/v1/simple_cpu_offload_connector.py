"""A CPU offload tier: a second, larger KV pool in host memory, in LRU order.

Mirrors ``vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py``
with ``vllm/v1/simple_kv_offload/`` (``SimpleCPUOffloadConnector``, v0.25.1,
its default eager mode): every full block the engine computes is copied to a
host slot keyed by its block hash; a later prompt whose blocks the device pool
has evicted finds them there and loads them back, asynchronously::

    device pool (small)          host pool (LRU, larger)
    [h0 h1 h2]  evicted later -> {h0: slot 3, h1: slot 0, h2: slot 7, ...}
    new prompt h0 h1 h2 h9:
      local hit 0 blocks, get_num_new_matched_tokens -> (3 blocks, async)
      step t   : blocks allocated (uncached: delay_cache_blocks), host -> device copy,
                 request WAITING_FOR_REMOTE_KVS; get_finished reports it received
      step t+1 : blocks cached, request computes only h9's tokens

Host slots are pinned while a load reads them; a store takes the least
recently used unpinned slot. The worker half's ``stats`` count the blocks and
bytes moved each way; the scheduler's ``connector_prefix_cache_stats`` the hit
rate (tokens the tier supplied over tokens asked beyond the local hit).

Where it differs from vLLM's: vLLM's host pool is a second ``BlockPool`` with
its own coordinator and copies run on a CUDA stream, reported by event ids;
kvref's is the small ``HostLRUPool`` below and the copies are plain
``index_copy_`` calls, done by the time the step ends (a store becomes
hittable when the step's output comes back). vLLM pins a hit from
``get_num_new_matched_tokens`` to ``update_state_after_alloc``; kvref needs
not, because only stores (in ``build_connector_meta``, after every
allocation of the step) evict host slots. A block whose load failed is
dropped from the host pool (kvref's choice: a retry then computes it rather
than failing on it again). Lazy mode (offloading only blocks about to be
evicted) is not modelled.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvref.distributed.kv_transfer.kv_connector.utils import (
    RequestBlockTracker, scatter_blocks, yield_req_data)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole)

__all__ = ["HostLRUPool", "SimpleCPUOffloadConnector", "SimpleCPUOffloadMetadata"]


class HostLRUPool:
    """Host slots keyed by block hash: ready (hittable) or being stored; LRU eviction.

        >>> pool = HostLRUPool(2)
        >>> a, b = pool.allocate(b"a"), pool.allocate(b"b")
        >>> pool.mark_ready([b"a", b"b"]); pool.lookup(b"a")    # a is now most recent
        0
        >>> pool.allocate(b"c"), b"b" in pool                    # b was least recent
        (1, False)
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = deque(range(num_slots))
        self._slot: dict[bytes, int] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()   # ready and unpinned, oldest first
        self._pins: dict[bytes, int] = {}
        self._storing: set[bytes] = set()
        self._doomed: set[bytes] = set()      # bad copies, removed once no load reads them
        self.num_evictions = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of a ready block (now the most recently used), else None."""
        if block_hash not in self._slot or block_hash in self._storing \
                or block_hash in self._doomed:
            return None
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
        return self._slot[block_hash]

    def allocate(self, block_hash: bytes) -> int | None:
        """A slot for a block about to be stored; evicts the LRU block if full,
        None when every slot is pinned or being stored."""
        if not self._free:
            if not self._lru:
                return None
            victim, _ = self._lru.popitem(last=False)
            self._free.append(self._slot.pop(victim))
            self.num_evictions += 1
        slot = self._free.popleft()
        self._slot[block_hash] = slot
        self._storing.add(block_hash)
        return slot

    def mark_ready(self, block_hashes) -> None:
        for block_hash in block_hashes:
            self._storing.discard(block_hash)
            if block_hash in self._slot and not self._pins.get(block_hash):
                self._lru[block_hash] = None

    def discard(self, block_hash: bytes) -> None:
        """Forget a block (its copy is bad); a pinned one goes when its last load ends."""
        if block_hash not in self._slot:
            return
        if self._pins.get(block_hash):
            self._doomed.add(block_hash)
            return
        self._lru.pop(block_hash, None)
        self._storing.discard(block_hash)
        self._free.append(self._slot.pop(block_hash))

    def pin(self, block_hash: bytes) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1
        self._lru.pop(block_hash, None)

    def unpin(self, block_hash: bytes) -> None:
        self._pins[block_hash] -= 1
        if not self._pins[block_hash]:
            del self._pins[block_hash]
            if block_hash in self._doomed:
                self._doomed.discard(block_hash)
                self.discard(block_hash)
            else:
                self._lru[block_hash] = None


@dataclass
class SimpleCPUOffloadMetadata(KVConnectorMetadata):
    """This step's copies: loads per request (host slots -> device blocks), stores."""

    loads: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    store_block_ids: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)


class SimpleCPUOffloadConnector(KVConnectorBase_V1):
    """Keep every computed block in a host LRU pool; serve prompts from it.

    ``kv_connector_extra_config``: ``num_cpu_blocks`` (host slots), or
    ``cpu_bytes_to_use`` (vLLM's key: the slots that many bytes hold).
    """

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        group = kv_cache_config.kv_cache_groups[0]
        self._block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        num = kv_transfer_config.get_from_extra_config("num_cpu_blocks", None)
        if num is None:
            num = int(kv_transfer_config.get_from_extra_config("cpu_bytes_to_use", 1 << 30)
                      ) // self._block_bytes
        self.num_cpu_blocks = int(num)
        # Scheduler side.
        self.host_pool = HostLRUPool(self.num_cpu_blocks)
        self._requests: dict[str, Any] = {}
        self._blocks = RequestBlockTracker()
        self._hit_start: dict[str, int] = {}
        self._loads_to_send: dict[str, tuple[list[int], list[int]]] = {}
        # req -> (device block, host block's hash) of its load, pinned until it ends
        self._loads_in_flight: dict[str, list[tuple[int, bytes]]] = {}
        self._stores_per_step: deque[list[bytes]] = deque()    # one entry per built meta
        # Worker side.
        self.cpu_kv: torch.Tensor | None = None
        self._finished_recving: set[str] = set()

    # -- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        bs = self._block_size
        first = num_computed_tokens // bs
        last = (request.num_tokens - 1) // bs     # the last token is always computed
        num_blocks = 0
        while first + num_blocks < last and \
                self.host_pool.lookup(request.block_hashes[first + num_blocks]) is not None:
            num_blocks += 1
        if not num_blocks:
            return 0, False
        self._hit_start[request.request_id] = first
        return num_blocks * bs, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        first = self._hit_start.pop(request.request_id, None)
        if num_external_tokens == 0 or first is None:
            return
        num_blocks = num_external_tokens // self._block_size
        hashes = request.block_hashes[first:first + num_blocks]
        slots = [self.host_pool.lookup(h) for h in hashes]
        for h in hashes:
            self.host_pool.pin(h)
        block_ids = blocks.get_block_ids()[0][first:first + num_blocks]
        self._loads_to_send[request.request_id] = (slots, block_ids)
        self._loads_in_flight[request.request_id] = list(zip(block_ids, hashes))

    def build_connector_meta(self, scheduler_output) -> SimpleCPUOffloadMetadata:
        meta = SimpleCPUOffloadMetadata(loads=self._loads_to_send)
        self._loads_to_send = {}
        bs = self._block_size
        stored: list[bytes] = []
        for req_id, new_ids, replace, num_computed in yield_req_data(scheduler_output):
            block_ids = self._blocks.update(req_id, new_ids, replace)
            request = self._requests[req_id]
            end = min(num_computed + scheduler_output.num_scheduled_tokens[req_id],
                      request.num_tokens)
            for i in range(num_computed // bs, end // bs):
                block_hash = request.block_hashes[i]
                if block_hash in self.host_pool:
                    continue
                slot = self.host_pool.allocate(block_hash)
                if slot is None:
                    break                         # every slot is pinned or being stored
                meta.store_block_ids.append(block_ids[i])
                meta.store_slots.append(slot)
                stored.append(block_hash)
        self._stores_per_step.append(stored)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Stores finish inside the step they were planned in: hittable from now on.
        if self._stores_per_step:
            self.host_pool.mark_ready(self._stores_per_step.popleft())
        # A block that failed to load is not served again: the retry computes it.
        invalid = connector_output.invalid_block_ids
        if invalid:
            for load in self._loads_in_flight.values():
                for block_id, block_hash in load:
                    if block_id in invalid:
                        self.host_pool.discard(block_hash)
        for req_id in connector_output.finished_recving or ():
            self._release_load(req_id)

    def _release_load(self, req_id: str) -> None:
        """The load of ``req_id`` ended: its host slots may be evicted again."""
        for _, block_hash in self._loads_in_flight.pop(req_id, ()):
            self.host_pool.unpin(block_hash)

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._requests, self._hit_start):
            table.pop(request.request_id, None)
        self._blocks.forget(request.request_id)
        return False, None

    # -- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        first = next(iter(kv_caches.values()))
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.cpu_kv = torch.zeros((self.num_cpu_blocks, len(kv_caches), *first.shape[1:]),
                                  dtype=first.dtype, device="cpu",
                                  pin_memory=first.is_cuda)

    def start_load_kv(self, **kwargs: Any) -> None:
        caches = list(self.kv_caches.values())
        for req_id, (slots, block_ids) in self._get_connector_metadata().loads.items():
            blocks = self.cpu_kv.index_select(0, torch.tensor(slots, dtype=torch.long))
            scatter_blocks(caches, block_ids, blocks)
            self.stats.num_loaded_blocks += len(block_ids)
            self.stats.bytes_loaded += blocks.numel() * blocks.element_size()
            self._finished_recving.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                                    # loads are for requests not in this forward

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not meta.store_block_ids:
            return
        layer = self._layer_index[layer_name]
        src = kv_layer.index_select(
            0, torch.tensor(meta.store_block_ids, dtype=torch.long, device=kv_layer.device))
        self.cpu_kv[torch.tensor(meta.store_slots, dtype=torch.long), layer] = src.cpu()

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self.stats.num_saved_blocks += len(meta.store_block_ids)
        self.stats.bytes_saved += len(meta.store_block_ids) * self._block_bytes

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        done, self._finished_recving = self._finished_recving, set()
        return None, done or None

