"""Disaggregated prefill: a prefill engine pushes each request's KV, block by block,
to a decode engine in another process, over ``torch.distributed`` point-to-point.

Modelled on vLLM's P2P NCCL connector (``kv_connector/v1/p2p/``, in releases
before v0.25.1) and on v0.25.1's NIXL connector in push mode
(``kv_connector/v1/nixl/push_scheduler.py``): the same two halves, the same
``kv_transfer_params`` keys. Here the transport is a two-rank gloo process
group (CPU; the same calls run over NCCL on GPUs). The producer is rank 0,
the consumer rank 1::

    prefill engine (kv_producer)              decode engine (kv_consumer)
    request, max_tokens=1,                    request, same prompt,
      {"do_remote_decode": True}                {"do_remote_prefill": True}
    prefill runs, 1 token sampled             get_num_new_matched_tokens
    request_finished -> hold the blocks           -> (prompt - local hit, async)
    send block 0, 1, 2 ... (tags below)  ==>  blocks allocated, uncached (delay_cache_blocks),
                                              request WAITING_FOR_REMOTE_KVS;
                                              receive block 0, 1, 2 ... into them
    get_finished: finished_sending            get_finished: finished_recving
    -> blocks freed                           -> blocks cached, num_computed = prompt - 1:
                                                 the decode engine computes one token

A message is one block of every layer, ``[num_layers, 2, block_size, H, D]``,
tagged ``1 + crc32(request id) % 2**20 * 1024 + block index`` so both sides
name it without talking (a request may span at most 1024 blocks). Gloo's
point-to-point is a rendezvous (a send completes only once the matching
receive is posted), so each side posts every message of a request at once
and a thread per request waits for them; waiting in a fixed order could
deadlock two engines that finished their requests in different orders.

When the producer dies mid-transfer the consumer's pending receives raise;
the blocks not received are reported by ``get_block_ids_with_load_errors``
and the request by ``get_finished`` (received, with errors): the scheduler
then recomputes from the first missing block or fails the request, by its
``kv_load_failure_policy``. A retried request does not ask the producer
again (``do_remote_prefill`` is cleared once its load is planned, as NIXL does).

Hybrid models: like vLLM's NIXL connector (``NixlBaseConnector`` subclasses
``SupportsHMA``, ``nixl/connector.py:79, 202-208``), ``P2pConnector``
implements ``SupportsHMA``, so the engine keeps the hybrid KV cache manager
and its groups. Message ``j`` then holds, for every layer, block ``j`` of that
layer's group; a window group's block already out of the window is the null
block on either side: the producer sends zeros for it, the consumer writes
nothing into it. NIXL instead sends only the last ``cdiv(window, block_size)
+ 1`` blocks of a window group (``nixl/base_scheduler.py:122-134, 219-244``);
the consumer's blocks still in its window are those or fewer. The consumer is
admitted with the whole prompt of P tokens computed, so its window group holds
no block before token P - W + 1, yet it recomputes token P - 1, whose window
starts at token P - W: when P - W + 1 is a multiple of the block size, that
token's block is the null block, in vLLM 0.25.1 as here (a defect kvref keeps;
``tests/engine/test_kv_connectors_hybrid.py`` names it). A failed load on
a hybrid model stops the engine with an error, as it does in vLLM 0.25.1,
whose load-failure handling supports one group (a TODO, ``scheduler.py:2545``).

Differences from vLLM, on purpose: the producer pushes every prompt block and
the consumer drops the ones its own prefix cache already holds (NIXL's
consumer pulls only the blocks it lacks, naming remote block ids it got from
the proxy); no proxy, no handshake beyond a layout check, one producer and
one consumer. ``stall_after_blocks`` (extra config) makes a producer stop
sending after that many blocks: a test uses it to kill the producer at a known
point mid-transfer.
"""

from __future__ import annotations

import datetime
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)
from kvref.math_utils import cdiv

__all__ = ["P2pConnector", "P2pConnectorMetadata", "block_tag"]

PRODUCER_RANK, CONSUMER_RANK = 0, 1
NULL_BLOCK_ID = 0      # the pool's first block is its null block (core/block_pool.py)
_LAYOUT_TAG = 0
_MAX_BLOCKS = 1024


def block_tag(request_id: str, block_index: int) -> int:
    """The message tag of one block of one request (the same in both processes)."""
    if not 0 <= block_index < _MAX_BLOCKS:
        raise ValueError(f"request {request_id!r}: block {block_index} is beyond the "
                         f"{_MAX_BLOCKS} blocks a transfer can tag")
    return 1 + (zlib.crc32(request_id.encode()) % (1 << 20)) * _MAX_BLOCKS + block_index


# Per KV cache group, block ids (None: the null block, nothing to read or write).
GroupBlockIds = tuple[list[int | None], ...]


@dataclass
class P2pConnectorMetadata(KVConnectorMetadata):
    """Producer: ``sends[req] = block ids per group``. Consumer: ``recvs[req] =
    (num blocks the producer sends, first block to keep, block ids per group for
    the kept ones)``."""

    sends: dict[str, GroupBlockIds] = field(default_factory=dict)
    recvs: dict[str, tuple[int, int, GroupBlockIds]] = field(default_factory=dict)


class _Transfer:
    """One request's messages in flight; a thread waits for them one by one."""

    def __init__(self, works: list, buffers: list[torch.Tensor], results: queue.Queue,
                 req_id: str) -> None:
        self.buffers = buffers                     # kept alive until the works end
        self.thread = threading.Thread(target=self._wait, args=(works, results, req_id),
                                       daemon=True, name=f"kvref-p2p-{req_id}")
        self.thread.start()

    @staticmethod
    def _wait(works: list, results: queue.Queue, req_id: str) -> None:
        for index, work in enumerate(works):
            try:
                work.wait()
                results.put((req_id, index, None))
            except RuntimeError as error:         # the peer is gone, or timed out
                results.put((req_id, index, str(error)))


class P2pConnector(KVConnectorBase_V1, SupportsHMA):
    """Push a finished prefill's blocks to the decode engine.

    ``kv_connector_extra_config``: ``p2p_host`` (default ``127.0.0.1``),
    ``p2p_port`` (the rendezvous port, required), ``timeout_s`` (connect and
    per-message limit, default 120), ``stall_after_blocks`` (producer only,
    for tests). ``kv_role``: ``kv_producer`` or ``kv_consumer``.
    """

    def __init__(self, kv_transfer_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        if kv_transfer_config.kv_role == "kv_both":
            raise ValueError("P2pConnector is either the kv_producer (prefill engine) or "
                             "the kv_consumer (decode engine), not kv_both")
        self.is_producer = kv_transfer_config.is_kv_producer
        extra = kv_transfer_config.get_from_extra_config
        self.timeout = datetime.timedelta(seconds=float(extra("timeout_s", 120)))
        self.stall_after_blocks = extra("stall_after_blocks", None)
        # Scheduler side.
        self._sends: dict[str, GroupBlockIds] = {}
        self._recvs: dict[str, tuple[int, int, GroupBlockIds]] = {}
        # Worker side.
        self._group = None
        self._results: queue.Queue = queue.Queue()
        self._transfers: dict[str, _Transfer] = {}
        self._pending: dict[str, list] = {}       # req -> [outcomes], None until known
        self._recv_targets: dict[str, tuple[int, GroupBlockIds]] = {}
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        self._layer_groups: list[int] = []        # per registered layer, its group
        self._group_of_layer = group_of
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self.num_blocks_sent = 0
        self.num_blocks_received = 0
        if role == KVConnectorRole.WORKER:
            port = extra("p2p_port", None)
            if port is None:
                raise ValueError("P2pConnector needs kv_connector_extra_config['p2p_port']")
            self._host, self._port = str(extra("p2p_host", "127.0.0.1")), int(port)

    # -- scheduler side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = getattr(request, "kv_transfer_params", None)
        if self.is_producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.is_producer or num_external_tokens == 0:
            return
        bs = self._block_size
        num_blocks = cdiv(request.num_prompt_tokens, bs)
        first = (request.num_prompt_tokens - num_external_tokens) // bs
        targets = tuple([None if b.is_null else b.block_id for b in group[first:num_blocks]]
                        for group in blocks.blocks)
        self._recvs[request.request_id] = (num_blocks, first, targets)
        # Ask the producer once: a retry after a failed load computes instead.
        request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output) -> P2pConnectorMetadata:
        meta = P2pConnectorMetadata(sends=self._sends, recvs=self._recvs)
        self._sends, self._recvs = {}, {}
        return meta

    def request_finished(self, request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """One group's blocks (the scheduler calls ``request_finished_all_groups``
        on a connector with ``SupportsHMA``; this is the same for one group)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None)
        if not self.is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        num_blocks = cdiv(request.num_prompt_tokens, self._block_size)
        if any(len(ids) < num_blocks for ids in block_ids):
            return False, None                    # aborted before its prefill ended
        self._sends[request.request_id] = tuple(
            [None if b == NULL_BLOCK_ID else b for b in ids[:num_blocks]] for ids in block_ids)
        return True, {"do_remote_prefill": True, "remote_request_id": request.request_id}

    # -- worker side -------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        missing = [name for name in kv_caches if name not in self._group_of_layer]
        if missing:
            raise ValueError(f"P2pConnector: layers {missing} are in no KV cache group")
        self._layer_groups = [self._group_of_layer[name] for name in kv_caches]
        self._connect()

    def _connect(self) -> None:
        rank = PRODUCER_RANK if self.is_producer else CONSUMER_RANK
        store = dist.TCPStore(self._host, self._port, 2, is_master=not self.is_producer,
                              timeout=self.timeout)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("kvref-p2p", store), rank, 2,
                                            self.timeout)
        self._store = store
        first = next(iter(self.kv_caches.values()))
        layout = torch.tensor([len(self.kv_caches), *first.shape[1:],
                               first.element_size()], dtype=torch.int64)
        if self.is_producer:
            self._group.send([layout], CONSUMER_RANK, _LAYOUT_TAG).wait()
        else:
            theirs = torch.zeros_like(layout)
            self._group.recv([theirs], PRODUCER_RANK, _LAYOUT_TAG).wait()
            if not torch.equal(theirs, layout):
                raise ValueError(
                    "P2pConnector: the producer's KV layout [layers, 2, block_size, heads, "
                    f"head_size, bytes] is {theirs.tolist()}, this engine's is "
                    f"{layout.tolist()}: both engines need the same model and block size")

    def _block_buffer(self) -> torch.Tensor:
        first = next(iter(self.kv_caches.values()))
        return torch.empty((len(self.kv_caches), *first.shape[1:]), dtype=first.dtype)

    def _gather(self, block_ids: GroupBlockIds) -> torch.Tensor:
        """``[num_blocks, num_layers, 2, block_size, H, D]``: block ``j`` of every
        layer, read from the block its group holds (zeros for a null block)."""
        caches = list(self.kv_caches.values())
        num_blocks = len(block_ids[0])
        out = torch.zeros((num_blocks, len(caches), *caches[0].shape[1:]),
                          dtype=caches[0].dtype)
        for layer, (cache, g) in enumerate(zip(caches, self._layer_groups)):
            rows = [j for j, b in enumerate(block_ids[g]) if b is not None]
            if rows:
                index = torch.tensor([block_ids[g][j] for j in rows], dtype=torch.long,
                                     device=cache.device)
                out[rows, layer] = cache.index_select(0, index).cpu()
        return out

    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, block_ids in meta.sends.items():
            blocks = self._gather(block_ids)                  # held: stable until sent
            limit = len(block_ids[0])
            if self.stall_after_blocks is not None:
                limit = max(0, min(limit, int(self.stall_after_blocks) - self.num_blocks_sent))
            buffers = [blocks[j].contiguous() for j in range(limit)]
            works = [self._group.send([buf], CONSUMER_RANK, block_tag(req_id, j))
                     for j, buf in enumerate(buffers)]
            self.num_blocks_sent += limit
            self._start(req_id, works, buffers, len(block_ids[0]), unposted=None)
        for req_id, (num_blocks, first, block_ids) in meta.recvs.items():
            buffers = [self._block_buffer() for _ in range(num_blocks)]
            works = []
            for j, buf in enumerate(buffers):
                try:
                    works.append(self._group.recv([buf], PRODUCER_RANK, block_tag(req_id, j)))
                except RuntimeError:                # the connection is already closed
                    break
            self._recv_targets[req_id] = (first, block_ids)
            self._start(req_id, works, buffers, num_blocks, unposted="connection closed")

    def _start(self, req_id: str, works: list, buffers: list, num_messages: int,
               unposted: str | None) -> None:
        """Track ``num_messages`` outcomes; those without a work are ``unposted``
        (None: never known, so a stalled producer keeps holding its blocks)."""
        outcomes: list = [None] * len(works) + [unposted] * (num_messages - len(works))
        self._pending[req_id] = outcomes
        self._transfers[req_id] = _Transfer(works, buffers, self._results, req_id)
        if all(o is not None for o in outcomes):
            self._conclude(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                                    # transfers fill blocks of waiting requests

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return                                    # the producer sends whole requests at the end

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        while True:
            try:
                req_id, index, error = self._results.get_nowait()
            except queue.Empty:
                break
            outcomes = self._pending.get(req_id)
            if outcomes is None:
                continue
            outcomes[index] = error or "ok"
            if error is None and not self.is_producer:
                self._land_block(req_id, index)
            if all(o is not None for o in outcomes):
                self._conclude(req_id)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def _land_block(self, req_id: str, index: int) -> None:
        first, block_ids = self._recv_targets[req_id]
        self.num_blocks_received += 1
        if index < first:
            return                                # already in this engine's prefix cache
        block = self._transfers[req_id].buffers[index]
        for layer, (cache, g) in enumerate(zip(self.kv_caches.values(), self._layer_groups)):
            target = block_ids[g][index - first]
            if target is not None:                # a window block out of the window: none
                cache[target].copy_(block[layer].to(cache.device, cache.dtype))
        self.stats.num_loaded_blocks += 1
        self.stats.bytes_loaded += block.numel() * block.element_size()

    def _conclude(self, req_id: str) -> None:
        outcomes = self._pending.pop(req_id)
        self._transfers.pop(req_id)
        if self.is_producer:
            self.stats.num_saved_blocks += outcomes.count("ok")
            self._finished_sending.add(req_id)
            return
        first, block_ids = self._recv_targets.pop(req_id)
        failed = [ids[j - first] for j, o in enumerate(outcomes) if o != "ok" and j >= first
                  for ids in block_ids if ids[j - first] is not None]
        self._load_errors.update(failed)
        self.stats.num_failed_blocks += len(failed)
        self._finished_recving.add(req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def num_transfers_in_flight(self) -> int:
        return len(self._pending)

    def shutdown(self) -> None:
        self._group = None
