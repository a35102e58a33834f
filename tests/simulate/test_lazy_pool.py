"""The simulation's lazy block pool against vLLM's plain one: the same blocks, in the
same order, op for op; a huge pool costs what its used blocks cost."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, strategies as st

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvref.math_utils import cdiv
from kvref.simulate import TraceRequest, load_trace, pool_from_tokens, simulate
from kvref.simulate.engine import StepTime
from kvref.simulate.lazy_pool import LazyBlockPool, LazyFreeQueue, MadeOnDemand
from kvref.simulate.record import record_steps
from kvref.simulate.sizing import NAMED_SHAPES, pool_from_memory


def ids(queue) -> list[int]:
    return [b.block_id for b in queue]


# One op on both queues: pop k from the head; give back some of the blocks held
# at the head (no hash) or the tail (hashed); revive one queued block (a hit).
OPS = st.lists(st.tuples(st.sampled_from(["pop", "prepend", "append", "remove"]),
                         st.integers(0, 6), st.integers(0, 1000)), max_size=60)


@given(n=st.integers(1, 40), ops=OPS)
def test_the_lazy_queue_is_the_plain_queue_op_for_op(n, ops):
    plain_blocks = [KVCacheBlock(i) for i in range(n)]
    plain = FreeKVCacheBlockQueue(plain_blocks)
    made = MadeOnDemand(n)
    lazy = LazyFreeQueue(made)
    held: list[int] = []                 # ids handed out, the same on both sides
    returned: list[int] = []             # ids given back (removable)
    for op, k, pick in ops:
        if op == "pop":
            k = min(k, plain.num_free_blocks)
            got = [b.block_id for b in plain.popleft_n(k)]
            assert [b.block_id for b in lazy.popleft_n(k)] == got
            held += got
            returned = [r for r in returned if r not in got]
        elif op in ("prepend", "append") and held:
            give = held[:k]
            held = held[k:]
            getattr(plain, f"{op}_n")([plain_blocks[i] for i in give])
            getattr(lazy, f"{op}_n")([made[i] for i in give])
            returned += give
        elif op == "remove" and returned:
            victim = returned.pop(pick % len(returned))
            plain.remove(plain_blocks[victim])
            lazy.remove(made[victim])
            held.append(victim)
        assert ids(lazy) == ids(plain)
        assert lazy.num_free_blocks == plain.num_free_blocks
        assert ids(lazy.get_all_free_blocks()) == ids(plain.get_all_free_blocks())
    # Blocks are made only when handed out (or when the queue is walked, as above).
    with pytest.raises(ValueError):
        lazy.popleft_n(lazy.num_free_blocks + 1)


def test_a_pool_makes_only_the_blocks_it_hands_out():
    pool = LazyBlockPool(18_350_058, enable_caching=True, hash_block_size=16)
    plain = BlockPool(64, enable_caching=True, hash_block_size=16)
    assert pool.get_num_free_blocks() == 18_350_057 and pool.null_block.block_id == 0
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [b.block_id for b in plain.get_new_blocks(5)]
    assert len(pool.blocks.made) == 6 and pool.get_usage() == pytest.approx(5 / 18_350_057)
    pool.free_blocks(reversed(got))
    assert pool.reset_prefix_cache() and len(pool.blocks.made) == 6
    assert pool.blocks[-1].block_id == 18_350_057 and len(pool.blocks) == 18_350_058
    with pytest.raises(ValueError):
        LazyBlockPool(0, enable_caching=True, hash_block_size=16)
    with pytest.raises(ValueError):
        LazyBlockPool(True, enable_caching=True, hash_block_size=16)


def test_the_lazy_pool_has_every_field_of_the_plain_one():
    lazy = LazyBlockPool(10, enable_caching=True, hash_block_size=16,
                         enable_kv_cache_events=True)
    plain = BlockPool(10, enable_caching=True, hash_block_size=16,
                      enable_kv_cache_events=True)
    assert set(vars(lazy)) == set(vars(plain))
    assert lazy.num_gpu_blocks == plain.num_gpu_blocks == 10


def summary(result) -> dict:
    doc = result.to_json(per_request=True)
    doc.pop("wall_seconds")
    return doc | {"timeline": result.timeline, "delays": result.queue_delays_s}


def pressure_requests() -> list[TraceRequest]:
    shared = list(range(1000, 1040))
    return [TraceRequest(f"r{i}", 50, 30, 0.01 * i, tokens=shared + [2000 + 10 * i + j
                                                                      for j in range(10)])
            for i in range(8)]


@pytest.mark.parametrize("case", ["mooncake", "pressure", "host tier", "gemma", "nemotron"])
def test_a_simulation_is_the_same_on_both_pools(case):
    options = dict(arrivals="timestamps")
    if case == "mooncake":
        requests, pool = load_trace("conversation", max_requests=60), pool_from_tokens(6000)
        options["max_output_tokens"] = 8
    elif case == "pressure":           # preemptions in a tiny pool
        requests, pool = pressure_requests(), pool_from_tokens(9)
        options["max_model_len"] = 96
    elif case == "host tier":
        requests, pool = pressure_requests(), pool_from_tokens(12)
        options.update(max_model_len=96, kv_offloading_size=0.001)
    else:                              # sliding window, or Mamba: several groups, one pool
        shape = NAMED_SHAPES["gemma-3-12b-like" if case == "gemma" else "nemotron-h-8b-like"]
        requests = load_trace("synthetic", max_requests=20)
        pool = pool_from_memory(shape, gpu_memory_gib=48 if case == "gemma" else 40,
                                max_model_len=60_000, max_num_batched_tokens=8192)
        options.update(max_output_tokens=8, max_model_len=60_000)
    lazy = simulate(requests, pool, step_time=StepTime(), **options)
    plain = simulate(requests, pool, step_time=StepTime(), lazy_pool=False, **options)
    assert summary(lazy) == summary(plain)
    if case == "pressure":
        # the case does what it is for: requests preempted and computed again
        assert lazy.num_preemptions > 0 and lazy.misses_by_cause["recompute_after_preemption"] > 0


def test_the_recorded_steps_have_the_same_block_ids(tmp_path):
    """Every manager call of the first 60 steps, with its answer (block ids included),
    is the same on both pools."""
    requests, pool = pressure_requests(), pool_from_tokens(9)
    traces = []
    for lazy in (True, False):
        path = tmp_path / f"{lazy}.json.gz"
        record_steps(requests, pool, dict(max_model_len=96, lazy_pool=lazy), str(path), 60)
        with gzip.open(path, "rt") as f:
            traces.append(json.load(f)["ops"])
    assert traces[0] == traces[1] and len(traces[0]) > 200


def test_a_huge_pool_makes_only_what_the_trace_uses():
    """The issue's pool: a small model's config.json on 80 GiB, 18,350,058 blocks."""
    pools = []

    def factory(config, **kwargs):
        from kvref.core.kv_cache_manager import KVCacheManager

        manager = KVCacheManager(config, **kwargs)
        pools.append(manager.block_pool)
        return manager

    requests = load_trace("conversation", max_requests=30)
    result = simulate(requests, pool_from_tokens(18_350_058), arrivals="order",
                      max_output_tokens=4, manager_factory=factory)
    [pool] = pools
    assert isinstance(pool, LazyBlockPool) and pool.num_gpu_blocks == 18_350_058
    needed = sum(cdiv(r.input_length + 4, 16) for r in requests)
    assert len(pool.blocks.made) <= needed + 1
    assert result.free_gpu_blocks_at_end == 18_350_057
