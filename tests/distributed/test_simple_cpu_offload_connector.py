"""The CPU offload tier: blocks the device pool lost come back from host memory."""

from __future__ import annotations

from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    HostLRUPool)

from .harness import BLOCK_SIZE, MiniEngine


def offload(num_cpu_blocks: int) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config={"num_cpu_blocks": num_cpu_blocks})


def run(engine: MiniEngine, req_id: str, tokens: list[int]):
    req = engine.request(req_id, tokens)
    hit = engine.admit(req)
    if hit[2]:
        engine.step([])                          # the load lands; nothing computes
        engine.resume_after_load(req)
    engine.step([req])
    engine.assert_kv_is_computed(req)
    engine.finish(req)
    return req, hit


def test_an_evicted_prefix_comes_back_from_the_host_tier_asynchronously():
    engine = MiniEngine(offload(num_cpu_blocks=8), num_blocks=8)
    run(engine, "a", list(range(14)))
    assert engine.worker_side.stats.num_saved_blocks == 3
    assert engine.manager.reset_prefix_cache()   # the device pool forgets everything
    b, hit = run(engine, "b", list(range(14)))
    assert hit == (0, 12, True)                  # 3 blocks from the host, loaded async
    assert engine.computed_tokens["b"] == 2
    stats = engine.worker_side.stats
    assert stats.num_loaded_blocks == 3
    assert stats.bytes_loaded == 3 * engine.scheduler_side._block_bytes


def test_while_a_load_is_in_flight_its_blocks_are_not_hits_for_others():
    engine = MiniEngine(offload(num_cpu_blocks=8), num_blocks=12)
    run(engine, "a", list(range(9)))
    engine.manager.reset_prefix_cache()
    b = engine.request("b", list(range(9)))
    assert engine.admit(b) == (0, 8, True)
    c = engine.request("c", list(range(9)))
    _, num_local = engine.manager.get_computed_blocks(c)
    assert num_local == 0                        # delay_cache_blocks: b's blocks are uncached
    engine.step([])
    engine.resume_after_load(b)
    assert engine.manager.get_computed_blocks(c)[1] == 8


def test_the_host_pool_evicts_its_least_recently_used_unpinned_block():
    pool = HostLRUPool(2)
    pool.allocate(b"x"), pool.allocate(b"y")
    assert pool.lookup(b"x") is None             # being stored: not a hit yet
    pool.mark_ready([b"x", b"y"])
    pool.pin(b"x")                               # a load reads it
    assert pool.allocate(b"z") is not None and b"y" not in pool and b"x" in pool
    assert pool.allocate(b"w") is None           # x pinned, z being stored
    pool.unpin(b"x")
    pool.mark_ready([b"z"])
    assert pool.allocate(b"w") is not None and b"x" not in pool
    assert pool.num_evictions == 2


def test_a_full_host_tier_skips_stores_while_its_slots_are_being_written():
    engine = MiniEngine(offload(num_cpu_blocks=2), num_blocks=12)
    run(engine, "a", list(range(13)))            # 3 blocks for 2 slots, in one step
    pool = engine.scheduler_side.host_pool
    assert len(pool) == 2
    engine.manager.reset_prefix_cache()
    _, hit = run(engine, "b", list(range(13)))
    # Both slots were still being written when the third block came: it was not stored.
    assert hit == (0, 8, True)


def test_cpu_bytes_to_use_sizes_the_host_pool():
    config = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 10_000})
    engine = MiniEngine(config)
    block_bytes = 2 * 2 * BLOCK_SIZE * 2 * 3 * 4
    assert engine.scheduler_side.num_cpu_blocks == 10_000 // block_bytes
