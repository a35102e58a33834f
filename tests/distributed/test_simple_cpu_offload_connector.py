"""The CPU offload tier, timed as vLLM's: stored once confirmed, hittable once reported."""

from __future__ import annotations

import pytest

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, SlidingWindowSpec, get_request_block_hasher, init_none_hash,
                   sha256)
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from kvref.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    DEFAULT_CPU_CAPACITY_BYTES, SimpleCPUOffloadConnector)
from kvref.kv_cache_interface import KVCacheTensor

from .harness import BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS, MiniEngine

PAGE = 2 * BLOCK_SIZE * HEADS * HEAD_SIZE * 4          # one layer's block, float32
BLOCK_BYTES = LAYERS * PAGE


def offload(num_cpu_blocks: int, **extra) -> KVTransferConfig:
    """A tier of ``num_cpu_blocks`` host blocks (one of them the pool's null block)."""
    return KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config={
                                "cpu_bytes_to_use": num_cpu_blocks * BLOCK_BYTES, **extra})


def hittable(engine: MiniEngine) -> int:
    """Host blocks a lookup can find."""
    return len(engine.scheduler_side.cpu_block_pool.cached_block_hash_to_block)


def decode(engine: MiniEngine, req: Request) -> None:
    """One more step of ``req``: it samples a token and computes it."""
    req.append_output_token_ids(7)
    assert engine.manager.allocate_slots(req, 1) is not None
    engine.step([req])


def prefill(engine: MiniEngine, req_id: str, tokens: list[int]) -> Request:
    req = engine.request(req_id, tokens)
    assert engine.admit(req)[2] is False
    engine.step([req])
    return req


def test_a_block_is_stored_the_step_after_it_is_computed_and_hittable_when_reported():
    engine = MiniEngine(offload(8), num_blocks=12)
    a = prefill(engine, "a", list(range(14)))          # computes 3 full blocks
    assert engine.last_meta.store_gpu_blocks == []     # not confirmed when planned
    decode(engine, a)                                  # now they are: stored, copied
    store = engine.last_meta.store_gpu_blocks
    assert store == engine.manager.get_block_ids("a")[0][:3]
    assert engine.worker_side.stats.num_saved_blocks == 3
    assert hittable(engine) == 0                       # launched, not reported yet
    pool = engine.manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in store] == [2, 2, 2]   # the store holds them
    decode(engine, a)
    assert engine.last_output.kv_connector_worker_meta.completed_store_events == {0: 1}
    assert hittable(engine) == 3
    assert [pool.blocks[i].ref_cnt for i in store] == [1, 1, 1]


def test_a_request_that_finishes_in_the_step_filling_its_blocks_stores_none():
    engine = MiniEngine(offload(8), num_blocks=12)
    a = prefill(engine, "a", list(range(14)))
    engine.finish(a)
    for _ in range(3):
        engine.step([])
    assert engine.worker_side.stats.num_saved_blocks == 0 and hittable(engine) == 0


def test_an_evicted_prefix_loads_back_and_lands_a_step_later():
    engine = MiniEngine(offload(8), num_blocks=12)
    a = prefill(engine, "a", list(range(14)))
    decode(engine, a)
    engine.finish(a)
    engine.step([])                                    # the store is reported
    assert hittable(engine) == 3
    assert engine.manager.reset_prefix_cache()         # the device forgets everything
    b = engine.request("b", list(range(14)))
    assert engine.admit(b) == (0, 12, True)            # 3 host blocks, asynchronously
    assert engine.step([]).finished_recving is None    # launched after this step's forward
    assert engine.step([]).finished_recving == {"b"}   # found done at the next poll
    engine.resume_after_load(b)
    engine.step([b])
    assert engine.computed_tokens["b"] == 2
    engine.assert_kv_is_computed(b)                    # the host's copy is the right KV
    stats = engine.worker_side.stats
    assert stats.num_loaded_blocks == 3 and stats.bytes_loaded == 3 * BLOCK_BYTES


def test_a_hit_is_pinned_on_the_host_until_its_load_ends():
    engine = MiniEngine(offload(8), num_blocks=12)
    a = prefill(engine, "a", list(range(9)))
    decode(engine, a)
    engine.finish(a)
    engine.step([])
    engine.manager.reset_prefix_cache()
    host = engine.scheduler_side.cpu_block_pool
    b = engine.request("b", list(range(9)))
    assert engine.admit(b) == (0, 8, True)
    pinned = engine.scheduler_side._reqs_to_load["b"].cpu_block_ids
    assert [host.blocks[i].ref_cnt for i in pinned] == [1, 1]
    c = engine.request("c", list(range(9)))            # device blocks of b's load: uncached
    assert engine.manager.get_computed_blocks(c)[1] == 0
    engine.step([])
    engine.step([])
    assert [host.blocks[i].ref_cnt for i in pinned] == [0, 0]
    engine.resume_after_load(b)
    assert engine.manager.get_computed_blocks(c)[1] == 8


def test_a_full_host_pool_stores_what_fits_and_skips_the_rest():
    engine = MiniEngine(offload(3), num_blocks=12)     # 2 usable host blocks
    a = prefill(engine, "a", list(range(13)))
    decode(engine, a)
    assert len(engine.last_meta.store_gpu_blocks) == 2
    decode(engine, a)
    assert hittable(engine) == 2


def test_lazy_mode_offloads_the_cached_blocks_nearest_eviction():
    engine = MiniEngine(offload(8, lazy_offload=True, max_num_batched_tokens=4),
                        num_blocks=5)
    a = prefill(engine, "a", list(range(14)))          # 4 blocks: 3 full, 1 partial
    decode(engine, a)
    assert engine.last_meta.store_gpu_blocks == []     # lazy: nothing when computed
    ids = engine.manager.get_block_ids("a")[0]
    engine.finish(a)
    # The free queue, first evicted first: the partial block (unhashed), then a's
    # full blocks last to first. Each step covers the target (2 * one step's
    # blocks = 2) from the cursor; a block being stored leaves the queue (the
    # store holds it), so the next walk starts again from the head.
    plans = []
    for _ in range(4):
        engine.step([])
        plans.append(engine.last_meta.store_gpu_blocks)
    assert plans == [[ids[2]], [ids[1]], [ids[0]], []]
    assert hittable(engine) == 3


def test_bad_settings_fail_with_one_clear_line():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        MiniEngine(offload(8, lazy_offload=True))
    with pytest.raises(ValueError, match="positive size, got 0 bytes"):
        MiniEngine(offload(0))
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        MiniEngine(offload(8, world_size=0))


def test_the_host_pool_size_follows_vllms_keys():
    engine = MiniEngine(offload(8), num_blocks=12)
    assert engine.scheduler_side.num_cpu_blocks == 8
    per_rank = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 100 * BLOCK_BYTES,
                                   "cpu_bytes_to_use_per_rank": 5 * BLOCK_BYTES})
    assert MiniEngine(per_rank).scheduler_side.num_cpu_blocks == 5
    split = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 8 * BLOCK_BYTES, "world_size": 2})
    assert MiniEngine(split).scheduler_side.num_cpu_blocks == 4
    assert DEFAULT_CPU_CAPACITY_BYTES == 8 << 30
    assert SimpleCPUOffloadConnector(offload(8), KVConnectorRole.SCHEDULER,
                                     engine.kv_cache_config).lazy_offload is False


def test_a_store_needs_every_workers_report():
    config = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": 16 * BLOCK_BYTES, "world_size": 2})
    engine = MiniEngine(config, num_blocks=12)
    a = prefill(engine, "a", list(range(9)))
    decode(engine, a)
    decode(engine, a)                                  # one worker (of two) reported it
    assert hittable(engine) == 0
    meta = engine.last_output.kv_connector_worker_meta
    engine.scheduler_side.update_connector_output(
        type(engine.last_output)(kv_connector_worker_meta=meta))   # the second worker
    assert hittable(engine) == 2


# -- several KV cache groups (SupportsHMA) --------------------------------------------


def hybrid_tier(num_gpu_blocks: int = 24, num_cpu_blocks: int = 16):
    """A full-attention group and a sliding-window one (window 8), one layer each."""
    init_none_hash(sha256)
    attn = dict(num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype="float32")
    specs = [FullAttentionSpec(BLOCK_SIZE, **attn),
             SlidingWindowSpec(BLOCK_SIZE, **attn, sliding_window=8)]
    config = KVCacheConfig(num_gpu_blocks,
                           [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
                           [KVCacheTensor(num_gpu_blocks * specs[0].page_size_bytes,
                                          ["layer.0", "layer.1"])])
    manager = KVCacheManager(config, max_model_len=256, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE)
    transfer = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use":
                                   num_cpu_blocks * specs[0].page_size_bytes})
    tier = SimpleCPUOffloadConnector(transfer, KVConnectorRole.SCHEDULER, config)
    tier.bind_gpu_block_pool(manager.block_pool)
    return manager, tier


def scheduled_again(req, num_tokens, new_block_ids):
    """A later step's output for a request already running: only its new blocks."""
    from types import SimpleNamespace
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[req.request_id], resumed_req_ids=set(),
                                              new_block_ids=[new_block_ids],
                                              num_computed_tokens=[req.num_computed_tokens]),
        num_scheduled_tokens={req.request_id: num_tokens}, finished_req_ids=set())


def scheduled(req, num_tokens, block_ids):
    from types import SimpleNamespace
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=block_ids,
                                            num_computed_tokens=req.num_computed_tokens)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: num_tokens}, finished_req_ids=set())


def prefill_then_decode(manager, tier, request) -> tuple:
    """Two scheduler steps of ``request`` with the tier: its whole prompt, then one
    decode token that needs no new block. Returns its tables as they were allocated
    and the second step's plan (which stores the prompt's confirmed blocks)."""
    n = request.num_tokens
    manager.allocate_slots(request, n)
    tier.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
    allocated = manager.get_block_ids(request.request_id)
    tier.build_connector_meta(scheduled(request, n, allocated))
    request.num_computed_tokens = n
    request.append_output_token_ids(7)
    new_blocks = manager.allocate_slots(request, 1)
    assert not any(new_blocks.get_block_ids())           # the next token fits in the last block
    return allocated, tier.build_connector_meta(scheduled_again(request, 1, None))


def test_the_tier_supports_hybrid_models_group_by_group():
    manager, tier = hybrid_tier()
    assert isinstance(tier, SupportsHMA)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    a = Request("a", list(range(14)), block_hasher=hasher)
    assert tier.get_num_new_matched_tokens(a, 0) == (0, False)
    allocated, meta = prefill_then_decode(manager, tier, a)
    ids = manager.get_block_ids("a")
    full, window = ids
    assert window[0] == 0 != allocated[1][0]   # tokens 0-3 left the window: null in the table
    # Both groups' confirmed blocks, group by group, from the ids recorded when they
    # were allocated (vLLM's manager.py:567-644): the window block that has left the
    # window is still cached on the device, so it is stored too.
    assert manager.block_pool.blocks[allocated[1][0]].block_hash is not None
    assert meta.store_gpu_blocks == full[:3] + allocated[1][:3]
    from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadWorkerMetadata)
    from kvref.distributed.kv_transfer.kv_connector.v1 import KVConnectorOutput
    tier.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata({meta.store_event: 1})))
    assert tier.request_finished_all_groups(a, ids) == (False, None)
    manager.free(a)
    assert manager.reset_prefix_cache()
    # The same prompt: the hybrid host coordinator's hit needs the full group's
    # blocks and only the window's last ones.
    b = Request("b", list(range(14)), block_hasher=hasher)
    assert tier.get_num_new_matched_tokens(b, 0) == (12, True)
    manager.allocate_slots(b, 0, num_external_computed_tokens=12, delay_cache_blocks=True)
    tier.update_state_after_alloc(b, manager.get_blocks("b"), 12)
    load = tier._reqs_to_load["b"]
    b_full, b_window = manager.get_block_ids("b")
    host = dict(zip(meta.store_gpu_blocks, meta.store_cpu_blocks))
    assert load.gpu_block_ids == b_full[:3] + b_window[1:3]
    assert load.cpu_block_ids == [host[i] for i in full[:3] + window[1:3]]
