"""KVCacheManager, the scheduler-facing facade, one behaviour per test.

Block size 4 throughout. A pool of N blocks has N - 1 usable ones (block 0 is
the null block), handed out in id order: the first request gets [1, 2, ...].
Free-queue pictures list block ids from the head (reused first) to the tail.
"""

from __future__ import annotations

import pytest

from kvref import (
    BlockRemoved,
    BlockStored,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

NULL = "NULL"
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def _seed_hash_chain():
    init_none_hash(sha256)


# -- helpers -------------------------------------------------------------------


def make_config(num_blocks: int, *specs) -> KVCacheConfig:
    specs = specs or (FullAttentionSpec(BLOCK_SIZE),)
    return KVCacheConfig(num_blocks,
                         [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def make_manager(num_blocks: int = 8, *specs, scheduler_block_size: int = BLOCK_SIZE,
                 hash_block_size: int = BLOCK_SIZE, max_model_len: int = 1024,
                 **kwargs) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *specs), max_model_len=max_model_len,
                          scheduler_block_size=scheduler_block_size,
                          hash_block_size=hash_block_size, **kwargs)


def make_request(request_id: str, num_tokens: int, first_token: int = 0,
                 **kwargs) -> Request:
    """A prompt of ``num_tokens`` consecutive ids: equal prefixes hash equally."""
    return Request(request_id, list(range(first_token, first_token + num_tokens)),
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256), **kwargs)


def draw(blocks) -> list:
    return [NULL if b.is_null else b.block_id for b in blocks]


def table(manager: KVCacheManager, request_id: str) -> tuple[list, ...]:
    """The request's block tables, one list per group (NULL for the null block)."""
    return tuple(draw(group) for group in manager.coordinator.get_blocks(request_id))


def queue(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def run_prefill(manager: KVCacheManager, request: Request, num_tokens: int | None = None):
    """Schedule ``num_tokens`` (default: the whole prompt) and mark them computed."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    new = manager.allocate_slots(request, num_tokens)
    assert new is not None
    request.num_computed_tokens += num_tokens
    request.status = RequestStatus.RUNNING
    return new


# -- get_computed_blocks -----------------------------------------------------------


def test_prompt_of_exactly_n_full_blocks_hits_only_n_minus_1():
    """The last token is always recomputed for its logits: a 12-token prompt
    may hit at most 11 tokens, i.e. 2 blocks::

        cached by a    [1, 2, 3]       12 tokens
        b (12 tokens)  hit [1, 2] -> 8 tokens
        c (13 tokens)  hit [1, 2, 3] -> 12 tokens
    """
    manager = make_manager(16)
    run_prefill(manager, make_request("a", 12))

    hit, num_hit = manager.get_computed_blocks(make_request("b", 12))
    assert (hit.get_block_ids(), num_hit) == (([1, 2],), 8)

    hit, num_hit = manager.get_computed_blocks(make_request("c", 13))
    assert (hit.get_block_ids(), num_hit) == (([1, 2, 3],), 12)


def test_a_miss_returns_the_shared_empty_blocks():
    manager = make_manager(16)
    hit, num_hit = manager.get_computed_blocks(make_request("a", 12))
    assert hit is manager.empty_kv_cache_blocks
    assert num_hit == 0


def test_caching_off_returns_the_shared_empty_blocks():
    manager = make_manager(16, enable_caching=False)
    run_prefill(manager, make_request("a", 12))
    hit, num_hit = manager.get_computed_blocks(make_request("b", 13))
    assert hit is manager.empty_kv_cache_blocks
    assert num_hit == 0


def test_skip_reading_prefix_cache_returns_the_shared_empty_blocks_even_on_a_hit():
    manager = make_manager(16, log_stats=True)
    run_prefill(manager, make_request("a", 12))
    manager.make_prefix_cache_stats()
    hit, num_hit = manager.get_computed_blocks(
        make_request("b", 13, skip_reading_prefix_cache=True))
    assert hit is manager.empty_kv_cache_blocks
    assert num_hit == 0
    # Not a lookup, so not counted either.
    assert manager.make_prefix_cache_stats().requests == 0


# -- allocate_slots: basics ----------------------------------------------------------------


def test_allocate_slots_with_nothing_to_compute_or_load_is_an_error():
    manager = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(make_request("a", 8), 0)


def test_allocate_slots_returns_only_the_blocks_new_this_step():
    """::

        step 1: 6 tokens    new [1, 2]   table [1, 2]
        step 2: +1 token    new (none)   table [1, 2]     the shared empty blocks
        step 3: +2 tokens   new [3]      table [1, 2, 3]
    """
    manager = make_manager()
    request = make_request("a", 9)
    assert run_prefill(manager, request, 6).get_block_ids() == ([1, 2],)
    assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
    request.num_computed_tokens += 1
    assert manager.allocate_slots(request, 2).get_block_ids() == ([3],)
    assert manager.get_block_ids("a") == ([1, 2, 3],)


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short():
    """Pool of 4 (3 usable): a 16-token prompt needs 4 blocks."""
    manager = make_manager(4)
    request = make_request("a", 16)
    assert manager.allocate_slots(request, 16) is None
    assert manager.get_block_ids("a") == ([],)
    assert queue(manager) == [1, 2, 3]
    assert manager.allocate_slots(request, 12).get_block_ids() == ([1, 2, 3],)


def test_free_cached_hit_blocks_count_against_the_free_capacity():
    """Touching a hit block that sits in the free queue takes it out of the
    queue, so it uses up free capacity like a new block::

        a cached [1, 2] and finished; c holds [3, 4]; free queue [2, 1]
        b (9 tokens) hits [1, 2] and needs 1 new block:
        1 new + 2 revived = 3 > 2 free  -> None
    """
    manager = make_manager(5)
    a = make_request("a", 8)
    run_prefill(manager, a)
    manager.free(a)
    run_prefill(manager, make_request("c", 8, first_token=100))
    assert queue(manager) == [2, 1]

    b = make_request("b", 9)
    hit, num_hit = manager.get_computed_blocks(b)
    assert (hit.get_block_ids(), num_hit) == (([1, 2],), 8)
    assert manager.allocate_slots(b, 1, num_hit, hit) is None
    # Nothing was touched: the hit blocks are still free and cached.
    assert queue(manager) == [2, 1]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]


def test_a_prefix_hit_is_taken_into_the_table_before_the_new_blocks():
    manager = make_manager(8)
    a = make_request("a", 8)
    run_prefill(manager, a)
    manager.free(a)                    # queue [3, 4, 5, 6, 7, 2, 1]
    b = make_request("b", 10)
    hit, num_hit = manager.get_computed_blocks(b)
    new = manager.allocate_slots(b, 10 - num_hit, num_hit, hit)
    assert new.get_block_ids() == ([3],)
    assert manager.get_block_ids("b") == ([1, 2, 3],)
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]


def test_remove_skipped_blocks_frees_even_when_allocate_slots_returns_none():
    """Window 8, a 60-token prompt in chunks of 8, 12, then 40::

        after 20 tokens     [1, 2, 3, 4, 5]
        chunk of 40 asks for 15 blocks -> None, but blocks left of the
        window were freed first: [NULL, NULL, NULL, 4, 5]
    """
    manager = make_manager(8, SlidingWindowSpec(BLOCK_SIZE, sliding_window=8))
    request = make_request("a", 60)
    run_prefill(manager, request, 8)
    run_prefill(manager, request, 12)
    assert table(manager, "a") == ([1, 2, 3, 4, 5],)

    assert manager.allocate_slots(request, 40) is None
    assert table(manager, "a") == ([NULL, NULL, NULL, 4, 5],)
    assert manager.block_pool.get_num_free_blocks() == 5


# -- allocate_slots: admission gates ------------------------------------------------------


@pytest.mark.parametrize("status, has_scheduled_reqs, admitted", [
    (RequestStatus.WAITING, True, False),
    (RequestStatus.PREEMPTED, True, False),
    (RequestStatus.WAITING, False, True),    # nobody else scheduled: no watermark
    (RequestStatus.RUNNING, True, True),     # running requests ignore the watermark
])
def test_watermark_applies_only_to_waiting_or_preempted_requests_when_others_run(
        status, has_scheduled_reqs, admitted):
    """Pool of 8 (7 free), watermark 0.25 -> int(0.25 * 8) = 2 blocks kept free.
    A 24-token request needs 6 blocks: 6 + 2 > 7."""
    manager = make_manager(8, watermark=0.25)
    assert manager.watermark_blocks == 2
    request = make_request("a", 24)
    request.status = status
    new = manager.allocate_slots(request, 24, has_scheduled_reqs=has_scheduled_reqs)
    assert (new is not None) is admitted


def test_watermark_still_admits_a_request_that_leaves_it_free():
    manager = make_manager(8, watermark=0.25)
    assert manager.allocate_slots(make_request("a", 20), 20).get_block_ids() == \
        ([1, 2, 3, 4, 5],)


def test_reserved_blocks_are_left_for_other_requests():
    """7 free blocks, 6 needed: 1 may be reserved, 2 may not."""
    manager = make_manager(8)
    assert manager.allocate_slots(make_request("a", 24), 24, reserved_blocks=2) is None
    assert manager.allocate_slots(make_request("a", 24), 24, reserved_blocks=1) is not None


def test_full_sequence_must_fit_rejects_a_prompt_whose_first_chunk_would_fit():
    """A 40-token prompt needs 10 blocks; its first 8-token chunk needs 2."""
    manager = make_manager(8)
    request = make_request("a", 40)
    assert manager.allocate_slots(request, 8, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(request, 8).get_block_ids() == ([1, 2],)


def test_full_sequence_must_fit_returns_none_before_freeing_anything():
    """Same window-8 request as above, with the gate on: the gate fails first,
    so blocks left of the window are *not* freed (contrast with the test
    without the gate)."""
    manager = make_manager(8, SlidingWindowSpec(BLOCK_SIZE, sliding_window=8),
                           max_num_batched_tokens=64)
    request = make_request("a", 100)
    run_prefill(manager, request, 8)
    run_prefill(manager, request, 12)
    assert manager.allocate_slots(request, 40, full_sequence_must_fit=True) is None
    assert table(manager, "a") == ([1, 2, 3, 4, 5],)


# -- allocate_slots: what gets slots and what gets cached -----------------------------------


def test_lookahead_tokens_get_slots_but_are_not_cached():
    """8 prompt tokens + 8 lookahead slots = 4 blocks; only the 2 full blocks of
    real tokens are cached."""
    manager = make_manager(8)
    request = make_request("a", 8)
    new = manager.allocate_slots(request, 8, num_lookahead_tokens=8)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert new.get_unhashed_block_ids() == [3, 4]


def test_lookahead_slots_stop_at_max_model_len():
    manager = make_manager(8, max_model_len=12)
    new = manager.allocate_slots(make_request("a", 8), 8, num_lookahead_tokens=8)
    assert new.get_block_ids() == ([1, 2, 3],)


def test_draft_tokens_beyond_the_request_are_not_cached():
    """9 real tokens (8 computed + 1 sampled) and 3 draft tokens scheduled:
    slots for 12 tokens, but only the 2 blocks of real tokens are cached."""
    manager = make_manager(8)
    request = make_request("a", 8)
    run_prefill(manager, request)
    request.append_output_token_ids(8)
    new = manager.allocate_slots(request, 1 + 3)
    assert new.get_block_ids() == ([3],)
    assert manager.get_blocks("a").get_unhashed_block_ids() == [3]


def test_delay_cache_blocks_leaves_the_blocks_unhashed_until_cache_blocks():
    manager = make_manager(8)
    request = make_request("a", 8)
    new = manager.allocate_slots(request, 8, delay_cache_blocks=True)
    assert new.get_unhashed_block_ids() == [1, 2]
    assert manager.get_computed_blocks(make_request("b", 9))[1] == 0

    manager.cache_blocks(request, 8)
    assert manager.get_blocks("a").get_unhashed_block_ids() == []
    assert manager.get_computed_blocks(make_request("b", 9))[1] == 8


def test_external_computed_tokens_get_blocks_before_the_new_tokens():
    """8 tokens loaded by a KV connector, 4 computed here::

        table  [1, 2 | 3]        1, 2 for the external tokens; 3 is returned as new
    """
    manager = make_manager(8)
    request = make_request("a", 12)
    new = manager.allocate_slots(request, 4, num_external_computed_tokens=8)
    assert new.get_block_ids() == ([3],)
    assert manager.get_block_ids("a") == ([1, 2, 3],)


def test_external_tokens_alone_may_be_allocated_with_no_new_tokens():
    manager = make_manager(8)
    request = make_request("a", 12)
    new = manager.allocate_slots(request, 0, num_external_computed_tokens=8,
                                 delay_cache_blocks=True)
    assert new is manager.empty_kv_cache_blocks
    assert manager.get_block_ids("a") == ([1, 2],)


def test_cross_attention_blocks_are_one_static_allocation_for_the_encoder():
    """Decoder (full attention) grows per step; the encoder's 12 tokens get
    3 blocks on the first step and nothing after::

        step 1: 5 tokens    decoder [1, 2]      encoder [3, 4, 5]
        step 2: +4 tokens   decoder [1, 2, 6]   encoder [3, 4, 5]
    """
    manager = make_manager(16, FullAttentionSpec(BLOCK_SIZE), CrossAttentionSpec(BLOCK_SIZE),
                           enable_caching=False)
    request = make_request("a", 9)
    new = manager.allocate_slots(request, 5, num_encoder_tokens=12)
    assert new.get_block_ids() == ([1, 2], [3, 4, 5])
    request.num_computed_tokens = 5
    new = manager.allocate_slots(request, 4, num_encoder_tokens=12)
    assert new.get_block_ids() == ([6], [])
    assert manager.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])


def test_encoder_blocks_count_toward_admission():
    """Pool of 5 (4 free): 5 decoder tokens need 2 blocks, 12 encoder tokens 3."""
    manager = make_manager(5, FullAttentionSpec(BLOCK_SIZE), CrossAttentionSpec(BLOCK_SIZE),
                           enable_caching=False)
    request = make_request("a", 5)
    assert manager.allocate_slots(request, 5, num_encoder_tokens=12) is None
    assert manager.allocate_slots(request, 5, num_encoder_tokens=8).get_block_ids() == \
        ([1, 2], [3, 4])


# -- free and pop_blocks_for_free ------------------------------------------------------------


def test_free_puts_the_tail_first_in_eviction_order():
    """Cached blocks go to the queue's tail in reverse (the prefix's tail is
    evicted first); the unfinished last block, not cached, goes to the head::

        a holds [1, 2, 3]  (10 tokens: 1 and 2 cached, 3 partial)
        queue before  [4, 5, 6, 7]
        queue after   [3, 4, 5, 6, 7, 2, 1]
    """
    manager = make_manager(8)
    request = make_request("a", 10)
    run_prefill(manager, request)
    assert queue(manager) == [4, 5, 6, 7]
    manager.free(request)
    assert queue(manager) == [3, 4, 5, 6, 7, 2, 1]
    assert manager.get_block_ids("a") == ([],)


def test_pop_blocks_for_free_forgets_the_request_but_keeps_the_blocks_referenced():
    manager = make_manager(8)
    request = make_request("a", 10)
    run_prefill(manager, request)
    blocks = manager.pop_blocks_for_free(request)
    assert draw(blocks) == [1, 2, 3]
    assert manager.get_block_ids("a") == ([],)
    assert queue(manager) == [4, 5, 6, 7]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]

    manager.block_pool.free_blocks(reversed(blocks))
    assert queue(manager) == [3, 4, 5, 6, 7, 2, 1]


def test_freeing_a_request_that_holds_nothing_is_a_no_op():
    manager = make_manager(8)
    run_prefill(manager, make_request("a", 8))
    manager.free(make_request("never-allocated", 8))
    assert queue(manager) == [3, 4, 5, 6, 7]
    assert manager.pop_blocks_for_free(make_request("never-allocated", 8)) == []
    # Looking did not create an entry (it would skew common-prefix counting).
    assert manager.get_num_common_prefix_blocks("a") == [2]


def test_common_prefix_blocks_are_counted_per_group():
    manager = make_manager(16)
    run_prefill(manager, make_request("a", 12))
    b = make_request("b", 13)
    hit, num_hit = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 13 - num_hit, num_hit, hit)
    assert manager.get_block_ids("b") == ([1, 2, 3, 4],)
    assert manager.get_num_common_prefix_blocks("a") == [3]


# -- prefix cache reset and stats -----------------------------------------------------------


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    manager = make_manager(8, log_stats=True)
    a = make_request("a", 8)
    run_prefill(manager, a)
    assert manager.reset_prefix_cache() is False
    assert manager.make_prefix_cache_stats().reset is False

    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.make_prefix_cache_stats().reset is True
    assert manager.make_prefix_cache_stats().reset is False  # a fresh interval
    assert manager.get_computed_blocks(make_request("b", 9))[1] == 0


def test_prefix_cache_stats_count_preempted_requests_apart():
    """a: 12 tokens, no hit.  b: 13 tokens, hits 12.  c (preempted once):
    9 tokens, hits 8."""
    manager = make_manager(16, log_stats=True)
    a = make_request("a", 12)
    manager.get_computed_blocks(a)
    run_prefill(manager, a)
    manager.get_computed_blocks(make_request("b", 13))
    c = make_request("c", 9)
    c.num_preemptions = 1
    manager.get_computed_blocks(c)

    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 25, 12)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    fresh = manager.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.preempted_requests) == (0, 0, 0)


def test_prefix_cache_stats_are_none_without_log_stats():
    assert make_manager(8).make_prefix_cache_stats() is None


# -- events and new block ids -------------------------------------------------------------------


def test_take_events_annotates_block_stored_with_the_group_spec():
    manager = make_manager(16, FullAttentionSpec(BLOCK_SIZE),
                           SlidingWindowSpec(BLOCK_SIZE, sliding_window=8),
                           enable_kv_cache_events=True)
    run_prefill(manager, make_request("a", 8))
    events = manager.take_events()
    assert [(type(e), e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in events] == [
        (BlockStored, 0, "full_attention", None),
        (BlockStored, 1, "sliding_window", 8),
    ]
    assert [len(e.block_hashes) for e in events] == [2, 2]
    assert manager.take_events() == []


def test_take_events_leaves_block_removed_as_is():
    manager = make_manager(4, enable_kv_cache_events=True)
    a = make_request("a", 8)
    run_prefill(manager, a)
    manager.free(a)                     # queue [3, 2, 1]: block 3 is reused first
    manager.take_events()
    run_prefill(manager, make_request("b", 8, first_token=100))  # evicts 2, then caches
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1
    assert not hasattr(removed[0], "kv_cache_spec_kind")


def test_take_new_block_ids_reports_only_full_attention_blocks():
    """Full attention gets [1, 2], the window group [3, 4]; only 1 and 2 are
    reported (to be zeroed), once."""
    manager = make_manager(16, FullAttentionSpec(BLOCK_SIZE),
                           SlidingWindowSpec(BLOCK_SIZE, sliding_window=8))
    run_prefill(manager, make_request("a", 8))
    assert manager.get_block_ids("a") == ([1, 2], [3, 4])
    assert manager.take_new_block_ids() == [1, 2]
    assert manager.take_new_block_ids() == []


# -- get_block_ids_for_computed_tokens ------------------------------------------------------------


def test_block_ids_for_computed_tokens_are_clipped_to_the_blocks_that_hold_them():
    manager = make_manager(16)
    run_prefill(manager, make_request("a", 10))
    assert manager.get_block_ids_for_computed_tokens("a", 10) == ([1, 2, 3],)
    assert manager.get_block_ids_for_computed_tokens("a", 5) == ([1, 2],)
    assert manager.get_block_ids_for_computed_tokens("a", 4) == ([1],)
    assert manager.get_block_ids_for_computed_tokens("a", 0) == ([],)


def test_block_ids_for_computed_tokens_keep_mamba_tables_whole():
    manager = make_manager(16, FullAttentionSpec(BLOCK_SIZE),
                           MambaSpec(BLOCK_SIZE, mamba_cache_mode="all"))
    run_prefill(manager, make_request("a", 10))
    assert manager.get_block_ids("a") == ([1, 2, 3], [4, 5, 6])
    assert manager.get_block_ids_for_computed_tokens("a", 5) == ([1, 2], [4, 5, 6])


# -- bad settings -----------------------------------------------------------------------------------


def test_pool_of_no_blocks_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        make_config(0)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionSpec(0)


def test_negative_watermark_is_rejected():
    with pytest.raises(ValueError, match="watermark"):
        make_manager(8, watermark=-0.1)


def test_group_block_size_must_divide_the_scheduler_block_size():
    with pytest.raises(ValueError, match="scheduler_block_size"):
        make_manager(16, FullAttentionSpec(4), SlidingWindowSpec(6, sliding_window=8),
                     scheduler_block_size=8)


def test_one_cached_group_needs_hash_block_size_equal_to_its_block_size():
    with pytest.raises(ValueError, match="hash_block_size"):
        make_manager(8, FullAttentionSpec(8), scheduler_block_size=8, hash_block_size=4)
    # Without caching nothing is hashed, so it does not matter.
    make_manager(8, FullAttentionSpec(8), scheduler_block_size=8, hash_block_size=4,
                 enable_caching=False)


def test_cross_attention_cannot_be_prefix_cached():
    with pytest.raises(ValueError, match="enable_caching"):
        make_manager(8, FullAttentionSpec(BLOCK_SIZE), CrossAttentionSpec(BLOCK_SIZE))


@pytest.mark.parametrize("setting", ["dcp_world_size", "pcp_world_size"])
def test_context_parallelism_is_not_modelled(setting):
    with pytest.raises(ValueError, match=setting):
        make_manager(8, **{setting: 2})
