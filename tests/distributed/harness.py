"""A model-free engine for connector unit tests: real blocks, real KV tensors, no model.

``MiniEngine`` owns a ``KVCacheManager``, a KV cache tensor per layer and both
halves of one connector. Its "forward" writes, for every computed token, a KV
value that is a function of the tokens up to it (``token_kv``), so a block
whose KV came through a connector can be checked against what computing it
would have written. Each request is prefilled in one step (no chunking): enough
to drive every connector call in vLLM's order.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, RequestStatus, get_request_block_hasher, init_none_hash, sha256)
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1 import KVConnectorOutput, KVConnectorRole

BLOCK_SIZE = 4
LAYERS = 2
HEADS, HEAD_SIZE = 2, 3


def token_kv(tokens: list[int]) -> torch.Tensor:
    """``[2, HEADS, HEAD_SIZE]``: the KV a token gets, from the tokens up to it."""
    seed = int.from_bytes(hashlib.sha256(repr(tokens).encode()).digest()[:4], "big")
    return torch.rand((2, HEADS, HEAD_SIZE), generator=torch.Generator().manual_seed(seed))


class MiniEngine:
    def __init__(self, config: KVTransferConfig, num_blocks: int = 16,
                 connect: bool = True) -> None:
        init_none_hash(sha256)
        self.kv_cache_config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
            FullAttentionSpec(BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                              dtype="float32"))])
        self.manager = KVCacheManager(self.kv_cache_config, max_model_len=256,
                                      scheduler_block_size=BLOCK_SIZE,
                                      hash_block_size=BLOCK_SIZE)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.kv_caches = {name: torch.zeros(num_blocks, 2, BLOCK_SIZE, HEADS, HEAD_SIZE)
                          for name in self.kv_cache_config.kv_cache_groups[0].layer_names}
        self.scheduler_side = KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.worker_side = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.scheduler_side.bind_gpu_block_pool(self.manager.block_pool)
        if connect:
            self.worker_side.register_kv_caches(self.kv_caches)
        self.computed_tokens: dict[str, int] = {}     # tokens the forward computed, per request
        self.waiting_for_load: dict[str, Request] = {}
        self.finished_ids: set[str] = set()
        self.last_output = KVConnectorOutput()

    def request(self, req_id: str, tokens: list[int], **params) -> Request:
        req = Request(req_id, tokens, block_hasher=self.hasher)
        req.kv_transfer_params = dict(params) or None
        return req

    def admit(self, req: Request) -> tuple[int, int, bool]:
        """Allocate as the scheduler does; returns (local hit, external, async)."""
        blocks, num_local = self.manager.get_computed_blocks(req)
        num_external, load_async = self.scheduler_side.get_num_new_matched_tokens(req, num_local)
        num_new = 0 if load_async else req.num_tokens - num_local - num_external
        new = self.manager.allocate_slots(req, num_new, num_new_computed_tokens=num_local,
                                          new_computed_blocks=blocks,
                                          num_external_computed_tokens=num_external,
                                          delay_cache_blocks=load_async)
        assert new is not None, "the test pool is too small"
        self.scheduler_side.update_state_after_alloc(
            req, self.manager.get_blocks(req.request_id), num_external)
        req.num_computed_tokens = num_local + num_external
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_load[req.request_id] = req
        return num_local, num_external, load_async

    def resume_after_load(self, req: Request) -> None:
        """The load landed: cache its blocks, allocate for the rest (the scheduler's
        ``_update_waiting_for_remote_kv`` and its second ``allocate_slots``)."""
        assert req.status == RequestStatus.WAITING, "the load has not landed"
        self.manager.cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens -= 1
        assert self.manager.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
        self.scheduler_side.update_state_after_alloc(
            req, self.manager.get_blocks(req.request_id), 0)

    def step(self, scheduled: list[Request]) -> KVConnectorOutput:
        """One step: each scheduled request computes the rest of its prompt."""
        new_reqs = [SimpleNamespace(req_id=r.request_id,
                                    block_ids=self.manager.get_block_ids(r.request_id),
                                    num_computed_tokens=r.num_computed_tokens)
                    for r in scheduled]
        output = SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  new_block_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={r.request_id: r.num_tokens - r.num_computed_tokens
                                  for r in scheduled},
            finished_req_ids=self.finished_ids)
        self.finished_ids = set()
        meta = self.last_meta = self.scheduler_side.build_connector_meta(output)
        worker = self.worker_side
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        for name, cache in self.kv_caches.items():
            worker.wait_for_layer_load(name)
            for req in scheduled:
                self._forward_layer(req, cache)
            worker.save_kv_layer(name, cache, None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        self.scheduler_side.update_connector_output(out)
        for req in scheduled:
            self.computed_tokens[req.request_id] = req.num_tokens - req.num_computed_tokens
            req.num_computed_tokens = req.num_tokens
            self.manager.cache_blocks(req, req.num_tokens)
        for req_id in recving or ():
            req = self.waiting_for_load.pop(req_id, None)
            if req is not None:
                req.status = RequestStatus.WAITING
        self.last_output = out
        return out

    def _forward_layer(self, req: Request, cache: torch.Tensor) -> None:
        block_ids = self.manager.get_block_ids(req.request_id)[0]
        tokens = list(req.all_token_ids)
        for pos in range(req.num_computed_tokens, req.num_tokens):
            cache[block_ids[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE] = token_kv(tokens[:pos + 1])

    def finish(self, req: Request) -> bool:
        """The request ends; returns whether the connector holds its blocks."""
        req.status = RequestStatus.FINISHED_STOPPED
        ids = self.manager.get_block_ids_for_computed_tokens(req.request_id,
                                                             req.num_computed_tokens)[0]
        hold, _ = self.scheduler_side.request_finished(req, ids)
        self.finished_ids.add(req.request_id)
        if not hold:
            self.manager.free(req)
        return hold

    def assert_kv_is_computed(self, req: Request, num_tokens: int | None = None) -> None:
        """Every token's KV in the request's blocks is what computing it writes."""
        block_ids = self.manager.get_block_ids(req.request_id)[0]
        tokens = list(req.all_token_ids)
        for pos in range(num_tokens if num_tokens is not None else req.num_tokens):
            for name, cache in self.kv_caches.items():
                got = cache[block_ids[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE]
                assert torch.equal(got, token_kv(tokens[:pos + 1])), \
                    f"{req.request_id}: {name} token {pos} holds the wrong KV"
