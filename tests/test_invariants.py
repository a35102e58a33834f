"""kvref.verify.invariants: each invariant passes on a healthy manager and catches one corruption.

Every test builds a healthy manager through the public API, checks it, breaks
exactly one thing, and expects ``InvariantViolation`` naming the invariant id
(see specs/) and the block. The last tests run short scenarios and check after
every step.

The healthy full-attention state used throughout (block size 4, 16 blocks)::

    a: 10 tokens      table [1, 2, 3]      1, 2 cached (shared with b); 3 partial
    b: 8 shared + 5   table [1, 2, 4, 5]   4 cached; 5 partial
    c: 6 tokens       freed: 6 cached -> queue tail, 7 uncached -> queue head

    free queue  head -> 7, 8, 9, ..., 15, 6 -> tail
"""

from __future__ import annotations

import pytest

from kvref import (
    BlockPool,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)
from kvref.verify.invariants import (
    CHECKED_INVARIANTS,
    InvariantViolation,
    check,
    check_block_pool,
    check_kv_cache_manager,
    check_prefix_hit,
)

BLOCK = 4


def make_manager(*specs, num_blocks: int = 16, enable_caching: bool = True) -> KVCacheManager:
    init_none_hash(sha256)
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheManager(KVCacheConfig(num_blocks, groups), max_model_len=256,
                          scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=enable_caching)


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, block_hasher=get_request_block_hasher(BLOCK, sha256))


def prefill(manager: KVCacheManager, request: Request) -> None:
    """Admit a request the way the scheduler does: hit, allocate, compute."""
    hit, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit) \
        is not None
    request.num_computed_tokens = request.num_tokens


def healthy_manager() -> tuple[KVCacheManager, dict[str, Request]]:
    """The state drawn in the module docstring."""
    manager = make_manager(FullAttentionSpec(BLOCK))
    requests = {"a": make_request("a", list(range(10))),
                "b": make_request("b", list(range(8)) + [50, 51, 52, 53, 54]),
                "c": make_request("c", list(range(100, 106)))}
    for request in requests.values():
        prefill(manager, request)
    manager.free(requests["c"])
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    assert manager.get_block_ids("b") == ([1, 2, 4, 5],)
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [b.block_id for b in queue] == [7, *range(8, 16), 6]
    check(manager)
    return manager, requests


def hybrid_manager() -> KVCacheManager:
    """Full attention (group 0) + sliding window 8 (group 1), one 10-token request."""
    manager = make_manager(FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, sliding_window=8))
    prefill(manager, make_request("a", list(range(10))))
    check(manager)
    return manager


def expect_violation(obj, invariant: str, block_id: int | None, **kwargs) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as info:
        check(obj, **kwargs)
    assert info.value.invariant == invariant, str(info.value)
    assert info.value.block_id == block_id, str(info.value)
    assert invariant in str(info.value)
    if block_id is not None:
        assert f"block {block_id}" in str(info.value)
    return info.value


def other_key(block_id: int) -> bytes:
    """A well-formed index key (group 0) that no request produced."""
    return make_block_hash_with_group_id(bytes([block_id]) * 32, 0)


# -- the violation object and dispatch ----------------------------------------


def test_violation_is_an_assertion_error_naming_invariant_and_block():
    error = InvariantViolation("INV-POOL-4", "block 3 has ref_cnt -1", 3)
    assert isinstance(error, AssertionError)
    assert (error.invariant, error.block_id) == ("INV-POOL-4", 3)
    assert str(error) == "INV-POOL-4 (block 3): block 3 has ref_cnt -1"


def test_check_accepts_a_manager_or_a_pool_and_nothing_else():
    manager, _ = healthy_manager()
    check(manager)
    check(manager.block_pool)
    check_kv_cache_manager(manager)
    check_block_pool(manager.block_pool)
    with pytest.raises(TypeError):
        check(object())


def test_a_fresh_pool_and_an_all_null_pool_are_healthy():
    check(BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK))
    check(BlockPool(num_gpu_blocks=1, enable_caching=True, hash_block_size=BLOCK))


def test_every_checked_invariant_has_a_test_here():
    source = open(__file__, encoding="utf-8").read()
    untested = [i for i in CHECKED_INVARIANTS if f'"{i}"' not in source]
    assert untested == []


# -- INV-POOL: the blocks themselves ---------------------------------------------


def test_pool_1_block_ids_match_positions():
    manager, _ = healthy_manager()
    blocks = manager.block_pool.blocks
    blocks[8], blocks[9] = blocks[9], blocks[8]
    expect_violation(manager, "INV-POOL-1", 8)


def test_pool_2_only_block_0_is_the_null_block():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[9].is_null = True
    expect_violation(manager, "INV-POOL-2", 9)


def test_pool_3_null_block_never_enters_the_free_queue():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.free_block_queue.append(pool.null_block)
    expect_violation(manager, "INV-POOL-3", 0)


def test_pool_3_null_block_is_never_hashed():
    manager, _ = healthy_manager()
    manager.block_pool.null_block.set_block_hash(other_key(0))
    expect_violation(manager, "INV-POOL-3", 0)


def test_pool_3_null_block_is_never_indexed():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.cached_block_hash_to_block.insert(other_key(0), pool.null_block)
    expect_violation(manager, "INV-POOL-3", 0)


def test_pool_4_ref_counts_are_never_negative():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[3].ref_cnt = -1
    expect_violation(manager, "INV-POOL-4", 3)


def test_pool_4_ignores_the_null_blocks_drifting_ref_cnt():
    manager, _ = healthy_manager()
    manager.block_pool.null_block.ref_cnt = -5  # vLLM does not maintain it either
    check(manager)


def test_pool_5_usage_stays_within_0_and_1():
    manager, _ = healthy_manager()
    assert 0.0 <= manager.usage <= 1.0
    manager.block_pool.get_usage = lambda: 1.5  # a broken report, nothing else
    expect_violation(manager, "INV-POOL-5", None)


# -- INV-QUEUE: the free queue -----------------------------------------------------


def test_queue_1_every_forward_link_has_its_back_link():
    manager, _ = healthy_manager()
    blocks = manager.block_pool.blocks
    blocks[9].prev_free_block = blocks[10]  # queue is 7, 8, 9, 10, ...: should be 8
    expect_violation(manager, "INV-QUEUE-1", 9)


def test_queue_1_the_chain_reaches_the_tail_sentinel():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[12].next_free_block = None
    expect_violation(manager, "INV-QUEUE-1", 12)


def test_queue_1_sentinels_do_not_link_outward():
    manager, _ = healthy_manager()
    queue = manager.block_pool.free_block_queue
    queue.fake_free_list_head.prev_free_block = manager.block_pool.blocks[8]
    expect_violation(manager, "INV-QUEUE-1", None)


def test_queue_2_num_free_blocks_counts_the_chain():
    manager, _ = healthy_manager()
    manager.block_pool.free_block_queue.num_free_blocks += 1
    expect_violation(manager, "INV-QUEUE-2", None)


def test_queue_3_only_pool_blocks_are_queued():
    manager, _ = healthy_manager()
    manager.block_pool.free_block_queue.append(KVCacheBlock(block_id=99))
    expect_violation(manager, "INV-QUEUE-3", 99)


def test_queue_4_a_queued_block_is_unreferenced():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[10].ref_cnt = 1
    expect_violation(manager, "INV-QUEUE-4", 10)


def test_queue_5_an_unreferenced_block_is_queued_not_leaked():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.free_block_queue.remove(pool.blocks[10])
    expect_violation(manager, "INV-QUEUE-5", 10)


def test_queue_5_a_sink_managers_blocks_are_held_not_leaked():
    manager = make_manager(SinkFullAttentionSpec(BLOCK, sink_len=2 * BLOCK))
    (sink_manager,) = manager.coordinator.single_type_managers
    assert [b.ref_cnt for b in sink_manager.sink_blocks] == [0, 0]  # off the queue, unreferenced
    check(manager)
    forgotten = sink_manager.sink_blocks.pop()
    expect_violation(manager, "INV-QUEUE-5", forgotten.block_id)


def test_queue_6_a_block_outside_the_queue_has_no_links():
    manager, _ = healthy_manager()
    blocks = manager.block_pool.blocks
    blocks[3].next_free_block = blocks[8]  # block 3 is in use by a
    expect_violation(manager, "INV-QUEUE-6", 3)


# -- INV-HASH: the prefix-cache index ----------------------------------------------


def test_hash_1_an_indexed_block_carries_the_key_it_is_indexed_under():
    manager, _ = healthy_manager()
    block = manager.block_pool.blocks[6]  # free and cached
    block.reset_hash()
    block.set_block_hash(other_key(6))
    expect_violation(manager, "INV-HASH-1", 6)


def test_hash_1_the_index_holds_only_pool_blocks():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    key = pool.blocks[6].block_hash
    stranger = KVCacheBlock(block_id=6)
    stranger.set_block_hash(key)
    pool.cached_block_hash_to_block._cache[key] = {6: stranger}
    expect_violation(manager, "INV-HASH-1", 6)


def test_hash_2_a_dropped_index_entry_is_caught():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.cached_block_hash_to_block.pop(pool.blocks[6].block_hash, 6)
    expect_violation(manager, "INV-HASH-2", 6)


def test_hash_2_a_free_block_with_a_stale_hash_is_caught():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[7].set_block_hash(other_key(7))  # 7 is free, uncached
    expect_violation(manager, "INV-HASH-2", 7)


def test_hash_3_no_key_maps_to_an_empty_set():
    manager, _ = healthy_manager()
    manager.block_pool.cached_block_hash_to_block._cache[other_key(1)] = {}
    expect_violation(manager, "INV-HASH-3", None)


def test_hash_4_nothing_is_hashed_with_caching_disabled():
    manager = make_manager(FullAttentionSpec(BLOCK), enable_caching=False)
    prefill(manager, make_request("a", list(range(10))))
    check(manager)
    pool = manager.block_pool
    block = pool.blocks[1]
    block.set_block_hash(other_key(1))
    pool.cached_block_hash_to_block.insert(other_key(1), block)
    expect_violation(manager, "INV-HASH-4", 1)


def test_hash_5_a_partial_entry_is_a_healthy_extra_key():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.cached_block_hashes_by_block[6] = [other_key(6)]  # block 6 holds a hash
    pool.cached_block_hash_to_block.insert(other_key(6), pool.blocks[6])
    check(manager)


@pytest.mark.parametrize("extra, why", [
    ([], "empty list"), (["own"], "its own hash"), (["other", "other"], "twice")])
def test_hash_5_malformed_extra_keys_are_caught(extra, why):
    manager, _ = healthy_manager()
    pool = manager.block_pool
    pool.cached_block_hash_to_block.insert(other_key(6), pool.blocks[6])
    keys = {"own": pool.blocks[6].block_hash, "other": other_key(6)}
    pool.cached_block_hashes_by_block[6] = [keys[k] for k in extra]
    error = expect_violation(manager, "INV-HASH-5", 6)
    assert why in str(error)


# -- INV-MGR: block tables against the pool ------------------------------------------


def test_mgr_1_ref_cnt_counts_the_table_slots_holding_a_block():
    manager, _ = healthy_manager()
    manager.block_pool.blocks[3].ref_cnt += 1
    error = expect_violation(manager, "INV-MGR-1", 3)
    assert "'a'@group0" in str(error)


def test_mgr_1_a_shared_prefix_block_counts_both_holders():
    manager, _ = healthy_manager()
    assert manager.block_pool.blocks[1].ref_cnt == 2  # a and b
    manager.block_pool.blocks[1].ref_cnt = 1
    expect_violation(manager, "INV-MGR-1", 1)


def test_mgr_1_popped_but_unfreed_blocks_still_count_when_passed():
    manager, requests = healthy_manager()
    popped = manager.pop_blocks_for_free(requests["a"])
    expect_violation(manager, "INV-MGR-1", 1)   # first block whose holders went missing
    check(manager, popped_blocks=[popped])
    manager.block_pool.free_blocks(reversed(popped))
    check(manager)


def test_mgr_2_every_group_shares_the_coordinators_pool():
    manager, _ = healthy_manager()
    manager.coordinator.single_type_managers[0].block_pool = \
        BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK)
    expect_violation(manager, "INV-MGR-2", None)


def test_mgr_3_tables_hold_only_pool_blocks():
    manager, _ = healthy_manager()
    table = manager.coordinator.single_type_managers[0].req_to_blocks["a"]
    table[2] = KVCacheBlock(block_id=3, ref_cnt=1)  # a look-alike of block 3
    expect_violation(manager, "INV-MGR-3", 3)


def test_mgr_4_no_block_is_held_by_two_groups():
    manager = hybrid_manager()
    full, window = manager.coordinator.single_type_managers
    shared = full.req_to_blocks["a"][0]
    window.req_to_blocks["a"].append(shared)
    expect_violation(manager, "INV-MGR-4", shared.block_id)


def test_mgr_5_num_cached_block_never_exceeds_the_table():
    manager, _ = healthy_manager()
    manager.coordinator.single_type_managers[0].num_cached_block["a"] = 4
    expect_violation(manager, "INV-MGR-5", None)


def test_mgr_6_only_cached_positions_carry_hashes():
    manager, _ = healthy_manager()
    manager.coordinator.single_type_managers[0].num_cached_block["b"] = 1
    expect_violation(manager, "INV-MGR-6", 2)  # b's block at index 1 is hashed


def test_mgr_7_a_group_indexes_its_blocks_under_its_own_group_id():
    manager = hybrid_manager()
    pool = manager.block_pool
    block = manager.coordinator.single_type_managers[0].req_to_blocks["a"][0]
    key = block.block_hash
    wrong = key[:-4] + (1).to_bytes(4, "big")  # same content, group 1's key
    pool.cached_block_hash_to_block.pop(key, block.block_id)
    block.reset_hash()
    block.set_block_hash(wrong)
    pool.cached_block_hash_to_block.insert(wrong, block)
    check_block_pool(pool)  # the pool alone is consistent
    expect_violation(manager, "INV-MGR-7", block.block_id)


def test_mgr_8_full_attention_tables_never_hold_the_null_block():
    manager, _ = healthy_manager()
    pool = manager.block_pool
    manager.coordinator.single_type_managers[0].req_to_blocks["a"].append(pool.null_block)
    expect_violation(manager, "INV-MGR-8", 0)


def test_mgr_8_sliding_window_nulls_form_a_prefix():
    manager = hybrid_manager()
    pool = manager.block_pool
    window_table = manager.coordinator.single_type_managers[1].req_to_blocks["a"]
    last_real = window_table[-1]
    window_table.append(pool.null_block)  # a null right of a real block
    expect_violation(manager, "INV-MGR-8", last_real.block_id)


# -- whole scenarios, checked after every step ---------------------------------------


@pytest.mark.parametrize("specs", [
    (FullAttentionSpec(BLOCK),),
    (FullAttentionSpec(BLOCK), SlidingWindowSpec(BLOCK, sliding_window=8)),
], ids=["full", "full+sliding_window"])
def test_a_day_in_the_life_keeps_every_invariant(specs):
    """Arrive, share a prefix, prefill in chunks, decode, preempt, resume,
    finish through pop_blocks_for_free, evict, reset: check after each step."""
    manager = make_manager(*specs, num_blocks=24)
    steps = 0

    def step():
        nonlocal steps
        check(manager)
        steps += 1

    system = list(range(12))
    a = make_request("a", system + [20, 21, 22])
    b = make_request("b", system + [30, 31, 32, 33, 34, 35])
    prefill(manager, a); step()

    hit, num_hit = manager.get_computed_blocks(b); step()
    assert num_hit > 0
    assert manager.allocate_slots(b, 4, num_hit, hit) is not None; step()   # first chunk
    b.num_computed_tokens = num_hit + 4
    assert manager.allocate_slots(b, b.num_tokens - b.num_computed_tokens) is not None; step()
    b.num_computed_tokens = b.num_tokens

    for token in range(40, 49):                                             # decode both
        for request in (a, b):
            request.append_output_token_ids([token])
            assert manager.allocate_slots(request, 1) is not None; step()
            request.num_computed_tokens += 1

    manager.free(a); step()                                                 # preempt a
    a.num_computed_tokens = 0
    prefill(manager, a); step()                                             # a resumes

    popped = manager.pop_blocks_for_free(b)                                 # b finishes
    check(manager, popped_blocks=[popped]); steps += 1
    manager.block_pool.free_blocks(reversed(popped)); step()

    cached = [blk.block_id for blk in manager.block_pool.blocks if blk.block_hash]
    manager.evict_blocks(set(cached[:3])); step()
    assert manager.reset_prefix_cache() is False; step()                    # a still runs
    manager.free(a); step()
    assert manager.reset_prefix_cache() is True; step()
    assert manager.usage == 0.0
    assert steps > 20


def test_filling_the_pool_and_refusing_keeps_every_invariant():
    """Allocation failures (None) leave the state consistent."""
    manager = make_manager(FullAttentionSpec(BLOCK), num_blocks=6)
    requests = [make_request(f"r{i}", list(range(100 * i, 100 * i + 7))) for i in range(4)]
    results = []
    for request in requests:
        hit, num_hit = manager.get_computed_blocks(request)
        results.append(manager.allocate_slots(request, request.num_tokens - num_hit,
                                              num_hit, hit))
        check(manager)
    assert [r is not None for r in results] == [True, True, False, False]
    for request in requests:
        manager.free(request)
        check(manager)


# -- one prefix hit: check_prefix_hit (INV-HIT-1, INV-HIT-2) ----------------------

def test_prefix_hit_healthy_answers_pass():
    manager, requests = healthy_manager()
    again = make_request("again", list(range(10)))
    hit, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 8
    check_prefix_hit(manager, again, hit, num_hit)
    hybrid = hybrid_manager()
    again = make_request("again", list(range(10)))
    hit, num_hit = hybrid.get_computed_blocks(again)
    check_prefix_hit(hybrid, again, hit, num_hit)


def test_prefix_hit_1_the_whole_prompt_may_not_hit():
    manager, _ = healthy_manager()
    exact = make_request("exact", list(range(8)))
    hit, num_hit = manager.get_computed_blocks(exact)
    assert num_hit == 4                      # the cap: block 1 is recomputed whole
    longer = manager.create_kv_cache_blocks(
        ([manager.block_pool.blocks[1], manager.block_pool.blocks[2]],))
    with pytest.raises(InvariantViolation) as info:
        check_prefix_hit(manager, exact, longer, 8)
    assert info.value.invariant == "INV-HIT-1" and "num_tokens - 1 = 7" in str(info.value)


def test_prefix_hit_1_a_hit_is_whole_blocks():
    manager, _ = healthy_manager()
    req = make_request("r", list(range(10)))
    hit, _ = manager.get_computed_blocks(req)
    with pytest.raises(InvariantViolation) as info:
        check_prefix_hit(manager, req, hit, 6)
    assert info.value.invariant == "INV-HIT-1"


def test_prefix_hit_2_a_group_list_shorter_than_the_hit_is_caught():
    manager = hybrid_manager()
    req = make_request("again", list(range(10)))
    hit, num_hit = manager.get_computed_blocks(req)
    assert num_hit == 8
    short = manager.create_kv_cache_blocks((hit.blocks[0][:1], hit.blocks[1]))
    with pytest.raises(InvariantViolation) as info:
        check_prefix_hit(manager, req, short, num_hit)
    assert info.value.invariant == "INV-HIT-2" and "group 0" in str(info.value)


def test_prefix_hit_2_flags_vllm_0_25_1_eagle_with_mamba():
    """The recorded vLLM defect (specs/coordinator.md, INV-HIT-2): EAGLE on a
    full-attention + Mamba model; Mamba ignores the drop, the hit outruns the
    full-attention blocks. kvref answers as vLLM does, and the check says so."""
    init_none_hash(sha256)
    groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(BLOCK)),
              KVCacheGroupSpec(["mamba"], MambaSpec(BLOCK, mamba_cache_mode="all"))]
    manager = KVCacheManager(KVCacheConfig(32, groups), max_model_len=256,
                             scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                             use_eagle=True)
    a = make_request("a", list(range(10)))
    manager.allocate_slots(a, 10, num_lookahead_tokens=2)
    a.num_computed_tokens = 10
    manager.free(a)
    b = make_request("b", list(range(8)) + [50, 51])
    manager.new_step_starts()
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and len(hit.blocks[0]) == 1       # vLLM 0.25.1's answer
    with pytest.raises(InvariantViolation) as info:
        check_prefix_hit(manager, b, hit, num_hit)
    assert info.value.invariant == "INV-HIT-2" and "group 0's hit has 1 block of" in str(info.value)
