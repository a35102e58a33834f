"""BlockPool: allocation, reference counts, the LRU free queue, the prefix-cache
index and the KV events it emits.

Pools here are small (a handful of blocks of 4 tokens) so every queue order
can be written out in full. Event hashes marked "recorded" were produced by
vLLM 0.25.1's own BlockPool on the same calls (sha256, PYTHONHASHSEED=0).
"""

from __future__ import annotations

import pytest

from kvref.core import kv_cache_utils as ku
from kvref.core.block_pool import BlockPool
from kvref.hashing import sha256
from kvref.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from kvref.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvref.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request

BS = 4  # tokens per block


@pytest.fixture(autouse=True)
def seed0(monkeypatch):
    """Deterministic hashes (PYTHONHASHSEED=0, sha256); NONE_HASH restored after."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    monkeypatch.setattr(ku, "NONE_HASH", ku.NONE_HASH)
    init_none_hash(sha256)


def make_request(tokens, request_id="r", **kwargs) -> Request:
    return Request(request_id, list(tokens),
                   block_hasher=get_request_block_hasher(BS, sha256), **kwargs)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def indexed(pool: BlockPool) -> set[tuple[bytes, int]]:
    """(key, block id) pairs in the prefix-cache index."""
    return {(key, block.block_id) for key, block in pool.cached_block_hash_to_block.items()}


def cached_pool(num_blocks=6, events=True):
    """A pool where request ``r`` (8 tokens) cached blocks [1, 2] in group 0."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BS,
                     enable_kv_cache_events=events)
    req = make_request(range(8))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    return pool, req, blocks


# -- construction and the null block ---------------------------------------------


def test_null_block_is_block_0_and_marked_null():
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])


def test_new_pool_queues_every_block_but_the_null_block_in_id_order():
    pool = BlockPool(5, enable_caching=True, hash_block_size=BS)
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks[1:])


def test_get_new_blocks_never_returns_the_null_block():
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_pool_of_one_block_holds_only_the_null_block():
    pool = BlockPool(1, enable_caching=True, hash_block_size=BS)
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 0
    assert pool.get_new_blocks(0) == []


def test_freeing_the_null_block_never_queues_it():
    pool = BlockPool(3, enable_caching=True, hash_block_size=BS)
    a = pool.get_new_blocks(1)[0]
    pool.free_blocks([pool.null_block, a])
    assert free_ids(pool) == [1, 2]                # unhashed block 1 goes to the front
    assert pool.get_num_free_blocks() == 2


def test_touching_the_null_block_leaves_the_queue_alone():
    pool = BlockPool(3, enable_caching=True, hash_block_size=BS)
    pool.touch([pool.null_block])
    assert free_ids(pool) == [1, 2]


@pytest.mark.parametrize("num_gpu_blocks", [0, -1, True, 2.0])
def test_pool_needs_a_positive_int_number_of_blocks(num_gpu_blocks):
    with pytest.raises(ValueError):
        BlockPool(num_gpu_blocks, enable_caching=True, hash_block_size=BS)


@pytest.mark.parametrize("hash_block_size", [0, -16])
def test_pool_needs_a_positive_hash_block_size(hash_block_size):
    with pytest.raises(ValueError):
        BlockPool(4, enable_caching=True, hash_block_size=hash_block_size)


# -- get_new_blocks ------------------------------------------------------------


def test_get_new_blocks_pops_from_the_head_with_one_reference_each():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(2)
    assert ids(first) == [1, 2] and ids(second) == [3, 4]
    assert [b.ref_cnt for b in first + second] == [1, 1, 1, 1]
    assert free_ids(pool) == [5]


def test_get_new_blocks_beyond_the_free_count_raises_and_takes_nothing():
    pool = BlockPool(4, enable_caching=True, hash_block_size=BS)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_reusing_a_cached_free_block_evicts_it_with_a_block_removed_event():
    pool, req, blocks = cached_pool(num_blocks=4)
    pool.free_blocks(reversed(blocks))            # queue: 3, 2, 1
    pool.take_events()
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.take_events() == [BlockRemoved(
        block_hashes=[maybe_convert_block_hash(req.block_hashes[1])],
        medium="GPU", group_idx=0)]


def test_eviction_events_carry_the_group_and_the_int_hash():
    # Recorded from vLLM 0.25.1: blocks 8 and 6 were cached in group 1; popping
    # them evicts both, in pop order.
    pool, _, _ = recorded_scenario()
    pool.take_events()
    assert ids(pool.get_new_blocks(3)) == [7, 5, 9]
    assert pool.take_events() == []               # unhashed blocks: nothing to evict
    assert ids(pool.get_new_blocks(2)) == [8, 6]
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[7031853638339490588], medium="GPU", group_idx=1),
        BlockRemoved(block_hashes=[12936356408104208269], medium="GPU", group_idx=1),
    ]


# -- touch ---------------------------------------------------------------------


def test_touch_revives_a_free_cached_block_out_of_the_queue():
    pool, _, blocks = cached_pool(num_blocks=5)
    pool.free_blocks(reversed(blocks))            # queue: 3, 4, 2, 1
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2]
    assert blocks[0].block_hash is not None       # a hit keeps the hash


def test_touch_of_a_block_in_use_only_adds_a_reference():
    pool, _, blocks = cached_pool(num_blocks=5)
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [2, 2]
    assert free_ids(pool) == [3, 4]


# -- free_blocks ----------------------------------------------------------------


def test_free_puts_unhashed_blocks_at_the_front_and_hashed_at_the_back():
    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    req = make_request(range(8))
    b1, b2, b3, b4, b5, b6 = pool.get_new_blocks(6)   # queue: 7
    pool.cache_full_blocks(req, [b2, b5], 0, 2, BS, 0)
    pool.free_blocks([b6, b5, b4, b3, b2, b1])
    # unhashed keep their given order ahead of the old queue; hashed follow it
    assert free_ids(pool) == [6, 4, 3, 1, 7, 5, 2]


def test_free_of_a_request_tail_first_evicts_the_tail_of_its_prefix_first():
    pool, _, blocks = cached_pool(num_blocks=4)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]


def test_free_of_a_shared_block_only_drops_a_reference():
    pool, _, blocks = cached_pool(num_blocks=4)
    pool.touch(blocks)
    pool.free_blocks(blocks)
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_ids(pool) == [3]


def test_over_freeing_raises_value_error_without_changing_anything():
    pool = BlockPool(5, enable_caching=True, hash_block_size=BS)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])                                # a: 2 refs, b: 1 ref
    with pytest.raises(ValueError):
        pool.free_blocks([a, b, b])                # b freed twice
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    assert free_ids(pool) == [3, 4]
    with pytest.raises(ValueError):
        pool.free_blocks([pool.blocks[3]])         # never allocated
    assert free_ids(pool) == [3, 4] and pool.blocks[3].ref_cnt == 0


# -- cache_full_blocks ----------------------------------------------------------------


def test_cache_full_blocks_sets_hashes_with_group_id_and_indexes_them():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(10))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, kv_cache_group_id=3)
    keys = [make_block_hash_with_group_id(h, 3) for h in req.block_hashes]
    assert [b.block_hash for b in blocks] == keys + [None]
    assert indexed(pool) == {(keys[0], 1), (keys[1], 2)}
    assert pool.get_cached_block(req.block_hashes[1], [3]) == [blocks[1]]
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None


def test_cache_full_blocks_caches_only_the_new_range():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 1, 2, BS, 0)
    assert [b.block_hash is not None for b in blocks] == [False, True, False]


def test_cache_full_blocks_with_nothing_new_changes_nothing():
    pool, req, blocks = cached_pool()
    pool.take_events()
    pool.cache_full_blocks(req, blocks, 2, 2, BS, 0)
    assert pool.take_events() == []
    assert len(indexed(pool)) == 2


def test_cache_full_blocks_needs_enough_hashes():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(6))                   # one full block
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, pool.get_new_blocks(2), 0, 2, BS, 0)


def test_cache_full_blocks_needs_one_mask_entry_per_new_block():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(8))
    with pytest.raises(ValueError):
        pool.cache_full_blocks(req, pool.get_new_blocks(2), 0, 2, BS, 0, block_mask=[True])


def test_cache_full_blocks_skips_null_and_masked_blocks():
    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    req = make_request(range(16))
    blocks = pool.get_new_blocks(4)
    blocks[0] = pool.null_block
    pool.cache_full_blocks(req, blocks, 0, 4, BS, 0, block_mask=[True, True, False, True])
    assert pool.null_block.block_hash is None
    assert blocks[2].block_hash is None
    assert {block_id for _, block_id in indexed(pool)} == {2, 4}


def test_coarser_group_reads_every_nth_fine_hash():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(16))                  # 4 fine hashes of 4 tokens
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 2 * BS, 0)
    assert [b.block_hash[:32] for b in blocks] == [req.block_hashes[1], req.block_hashes[3]]


def test_duplicate_hashes_hit_the_first_inserted_block():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    ra, rb = make_request(range(8), "a"), make_request(range(8), "b")
    ba, bb = pool.get_new_blocks(2), pool.get_new_blocks(2)   # [1, 2], [3, 4]
    pool.cache_full_blocks(ra, ba, 0, 2, BS, 0)
    pool.cache_full_blocks(rb, bb, 0, 2, BS, 0)
    assert ra.block_hashes == rb.block_hashes
    assert pool.get_cached_block(ra.block_hashes[0], [0]) == [ba[0]]
    assert len(indexed(pool)) == 4                # both copies are indexed
    pool.evict_blocks({1})
    assert pool.get_cached_block(ra.block_hashes[0], [0]) == [bb[0]]


def test_get_cached_block_misses_if_any_group_misses():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    req = make_request(range(4))
    g0, g1 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(req, g0, 0, 1, BS, 0)
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) is None
    pool.cache_full_blocks(req, g1, 0, 1, BS, 1)
    assert pool.get_cached_block(req.block_hashes[0], [1, 0]) == [g1[0], g0[0]]


# -- BlockStored events (recorded from vLLM 0.25.1) ------------------------------------


def recorded_scenario():
    """The call sequence recorded against vLLM 0.25.1's BlockPool.

    16 tokens (100..115) in blocks of 4, LoRA "adapter-a" (id 7), salt "salt-1",
    images A at [2, 5), B at [5, 8), C at [9, 11). Group 2 caches blocks
    [1, null, 3] then [4]; group 1 caches [5, 6, 7, 8] with mask F T F T.
    Returns the pool (events still queued), the request, and the two events
    lists as emitted.
    """
    pool = BlockPool(10, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    req = make_request(range(100, 116), lora_request=LoRARequest("adapter-a", 7),
                       cache_salt="salt-1",
                       mm_features=[MultiModalFeatureSpec("img-A", PlaceholderRange(2, 3)),
                                    MultiModalFeatureSpec("img-B", PlaceholderRange(5, 3)),
                                    MultiModalFeatureSpec("img-C", PlaceholderRange(9, 2))])
    blocks = pool.get_new_blocks(4)                # [1, 2, 3, 4]; 2 stays held
    blocks[1] = pool.null_block
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 2)
    pool.cache_full_blocks(req, blocks, 3, 4, BS, 2)
    masked = pool.get_new_blocks(4)                # [5, 6, 7, 8]
    pool.cache_full_blocks(req, masked, 0, 4, BS, 1, block_mask=[False, True, False, True])
    pool.free_blocks(reversed(masked))
    pool.free_blocks([blocks[3], blocks[2], blocks[0]])
    return pool, req, blocks


def test_block_stored_events_match_vllm():
    pool, _, _ = recorded_scenario()
    first, second, masked = pool.take_events()
    # Null block 2 is skipped in block_hashes and extra_keys, not in token_ids.
    assert first == BlockStored(
        block_hashes=[17853341648195394693, 10519470075173849209],
        parent_block_hash=None, token_ids=list(range(100, 112)), block_size=4,
        lora_id=7, medium="GPU", lora_name="adapter-a",
        extra_keys=[("adapter-a", ("img-A", 2), "salt-1"), ("adapter-a", ("img-C", 1))],
        group_idx=2)
    assert second == BlockStored(
        block_hashes=[7031853638339490588], parent_block_hash=10519470075173849209,
        token_ids=[112, 113, 114, 115], block_size=4, lora_id=7, medium="GPU",
        lora_name="adapter-a", extra_keys=[("adapter-a",)], group_idx=2)
    assert masked == BlockStored(
        block_hashes=[12936356408104208269, 7031853638339490588], parent_block_hash=None,
        token_ids=list(range(100, 116)), block_size=4, lora_id=7, medium="GPU",
        lora_name="adapter-a",
        extra_keys=[("adapter-a", ("img-A", -2), ("img-B", 1)), ("adapter-a",)],
        group_idx=1)


def test_block_stored_event_hashes_are_the_request_hashes_as_ints():
    pool, req, _ = recorded_scenario()
    first = pool.take_events()[0]
    assert first.block_hashes == [maybe_convert_block_hash(req.block_hashes[i]) for i in (0, 2)]


def test_free_order_after_the_recorded_scenario_matches_vllm():
    pool, _, _ = recorded_scenario()
    assert free_ids(pool) == [7, 5, 9, 8, 6, 4, 3, 1]


def test_block_stored_event_at_a_coarser_block_size_matches_vllm():
    pool, req, _ = recorded_scenario()
    coarse = BlockPool(8, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    coarse.cache_full_blocks(req, coarse.get_new_blocks(2), 0, 2, 2 * BS, 0)
    # Extra keys are those of the 8-token blocks, as vLLM reports them.
    assert coarse.take_events() == [BlockStored(
        block_hashes=[12936356408104208269, 7031853638339490588], parent_block_hash=None,
        token_ids=list(range(100, 116)), block_size=8, lora_id=7, medium="GPU",
        lora_name="adapter-a",
        extra_keys=[("adapter-a", ("img-A", 2), ("img-B", 5), "salt-1"),
                    ("adapter-a", ("img-C", 1))],
        group_idx=0)]


def test_block_stored_event_without_extras_has_none_per_block_and_no_lora():
    pool, req, _ = cached_pool()
    (event,) = pool.take_events()
    assert event.extra_keys == [None, None]
    assert (event.lora_id, event.lora_name, event.parent_block_hash) == (None, None, None)
    assert event.token_ids == list(range(8))
    assert event.group_idx == 0 and event.block_size == BS


def test_block_stored_event_with_every_block_skipped_stores_nothing():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    req = make_request(range(8))
    pool.cache_full_blocks(req, [pool.null_block, pool.null_block], 0, 2, BS, 0)
    (event,) = pool.take_events()
    assert event.block_hashes == [] and event.extra_keys is None
    assert event.token_ids == list(range(8))
    assert len(indexed(pool)) == 0


# -- evict_blocks -----------------------------------------------------------------


def test_evict_blocks_drops_the_hash_but_keeps_references_and_queue_order():
    pool, req, blocks = cached_pool(num_blocks=5)
    pool.free_blocks([blocks[1]])                 # queue: 3, 4, 2; block 1 in use
    pool.take_events()
    pool.evict_blocks({1, 2})
    assert [b.block_hash for b in blocks] == [None, None]
    assert len(indexed(pool)) == 0
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (1, 0)
    assert free_ids(pool) == [3, 4, 2]
    removed = pool.take_events()
    assert sorted(e.block_hashes[0] for e in removed) == sorted(
        maybe_convert_block_hash(h) for h in req.block_hashes)
    assert all(isinstance(e, BlockRemoved) and e.group_idx == 0 for e in removed)


def test_evict_blocks_of_uncached_blocks_emits_nothing():
    pool, _, _ = cached_pool(num_blocks=5)
    pool.take_events()
    pool.evict_blocks({3, 4})
    assert pool.take_events() == []
    assert len(indexed(pool)) == 2


def test_evict_blocks_matches_vllm_in_the_recorded_scenario():
    pool, _, _ = recorded_scenario()
    pool.take_events()
    pool.evict_blocks({4, 2, 7})                  # only block 4 is cached
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[7031853638339490588], medium="GPU", group_idx=2)]
    assert free_ids(pool) == [7, 5, 9, 8, 6, 4, 3, 1]


@pytest.mark.parametrize("block_id", [6, 100, -1])
def test_evict_blocks_outside_the_pool_raises_value_error(block_id):
    pool, _, _ = cached_pool(num_blocks=6)
    with pytest.raises(ValueError):
        pool.evict_blocks({block_id})


# -- reset_prefix_cache --------------------------------------------------------------


def test_reset_prefix_cache_refuses_while_a_block_is_in_use():
    pool, _, blocks = cached_pool()
    pool.take_events()
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert all(b.block_hash is not None for b in blocks)
    assert len(indexed(pool)) == 2
    assert pool.take_events() == []


def test_reset_prefix_cache_clears_every_hash_and_keeps_queue_order():
    pool, _, blocks = cached_pool()
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in pool.blocks)
    assert len(indexed(pool)) == 0
    assert free_ids(pool) == order == [3, 4, 5, 2, 1]
    assert pool.take_events() == [AllBlocksCleared()]


def test_reset_prefix_cache_of_an_empty_cache_still_reports_it():
    pool = BlockPool(3, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]


# -- views -------------------------------------------------------------------------


def test_usage_counts_blocks_in_use_without_the_null_block():
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(2 / 5)
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)


def test_free_cached_blocks_count_as_free():
    pool, _, blocks = cached_pool(num_blocks=6)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0


def test_take_events_drains_the_queue():
    pool, _, _ = cached_pool()
    assert len(pool.take_events()) == 1
    assert pool.take_events() == []


def test_take_events_is_empty_when_events_are_off():
    pool, _, blocks = cached_pool(num_blocks=4, events=False)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(3)                         # evicts both cached blocks
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    assert pool.kv_event_queue == []


def test_without_caching_new_blocks_do_not_evict():
    pool = BlockPool(4, enable_caching=False, hash_block_size=BS, enable_kv_cache_events=True)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.take_events() == []
