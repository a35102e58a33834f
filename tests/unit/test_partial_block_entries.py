"""Partial-block prefix-cache entries: ``BlockPool.cache_partial_block``.

A partial entry indexes a block under a prefix that ends inside it. Hashes are
computed every 2 tokens (``hash_block_size``) and the group's blocks hold 6,
as in the method's drawing::

    tokens  | 0 1 . 2 3 . 4 5 | 6 7 . 8 9 . _ _ |
    fine    |  a     b     c  |  d     e        |     request.block_hashes
    block        block 1           block 2

The pool's own tests are in ``test_block_pool.py``; vLLM 0.25.1's nine tests
of these primitives run on kvref through ``tools/vllm_unit_tests.py``, and
``tests/conformance/test_block_pool_traces.py`` replays vLLM's answers to
random sequences of pool operations that include them.
"""

from __future__ import annotations

import pytest

from kvref.core import kv_cache_utils as ku
from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from kvref.hashing import sha256
from kvref.kv_events import BlockRemoved, BlockStored
from kvref.request import LoRARequest, Request
from kvref.verify.invariants import InvariantViolation, check

HBS, BS = 2, 6    # hash_block_size, the group's block_size
TOKENS = list(range(10))


@pytest.fixture(autouse=True)
def seed0(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    monkeypatch.setattr(ku, "NONE_HASH", ku.NONE_HASH)
    init_none_hash(sha256)


def make_request(tokens=TOKENS, request_id="r", **kwargs) -> Request:
    return Request(request_id, list(tokens),
                   block_hasher=get_request_block_hasher(HBS, sha256), **kwargs)


def fine_key(request: Request, num_tokens: int, group: int = 0) -> bytes:
    return make_block_hash_with_group_id(request.block_hashes[num_tokens // HBS - 1], group)


def keys_of(pool: BlockPool, block) -> list[bytes]:
    """Every key the index holds ``block`` under, in index order."""
    return [key for key, b in pool.cached_block_hash_to_block.items() if b is block]


def two_block_pool(events=True):
    """Request ``r`` (10 tokens) holds blocks [1, 2]; block 1 is cached full."""
    pool = BlockPool(4, enable_caching=True, hash_block_size=HBS,
                     enable_kv_cache_events=events)
    req = make_request()
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 1, BS, 0)
    pool.take_events()
    return pool, req, blocks


def event_hash(request: Request, num_tokens: int) -> int:
    return maybe_convert_block_hash(request.block_hashes[num_tokens // HBS - 1])


# -- what an entry is -------------------------------------------------------------


def test_the_entry_is_the_fine_hash_at_the_boundary_and_a_lookup_finds_the_block():
    pool, req, blocks = two_block_pool()
    key = pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    assert key == fine_key(req, 10)                     # hash "e" of the drawing
    assert pool.get_cached_block(req.block_hashes[4], [0]) == [blocks[1]]
    assert pool.get_cached_block(req.block_hashes[4], [1]) is None   # another group misses
    # A later request with the same first 10 tokens (and more) finds it too.
    longer = make_request(TOKENS + [10, 11, 12], "later")
    assert pool.get_cached_block(longer.block_hashes[4], [0]) == [blocks[1]]
    check(pool)


def test_an_unhashed_block_takes_the_entry_as_its_hash_covering_num_tokens():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    assert blocks[1].block_hash == fine_key(req, 10)
    assert blocks[1].block_hash_num_tokens == 10
    assert blocks[0].block_hash_num_tokens == 6         # a full block covers its boundary
    assert pool.cached_block_hashes_by_block == {}


def test_asking_again_for_the_same_entry_changes_nothing_and_emits_nothing():
    pool, req, blocks = two_block_pool()
    first = pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.take_events()
    assert pool.cache_partial_block(req, blocks[1], 8, 0, BS) == first
    assert pool.take_events() == []
    assert keys_of(pool, blocks[1]) == [first]


def test_two_blocks_with_the_same_prefix_are_both_indexed_oldest_found_first():
    pool = BlockPool(4, enable_caching=True, hash_block_size=HBS)
    req = make_request([0, 1, 2, 3])
    a, b = pool.get_new_blocks(2)
    assert pool.cache_partial_block(req, a, 2, 0, 4) == pool.cache_partial_block(req, b, 2, 0, 4)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [a]
    assert a.block_hash == b.block_hash and pool.cached_block_hashes_by_block == {}


# -- an entry changes: longer, shorter, full ----------------------------------------


def test_a_longer_prefix_replaces_the_entry_removed_before_stored():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.take_events()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    removed, stored = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [event_hash(req, 8)]
    assert isinstance(stored, BlockStored) and stored.block_hashes == [event_hash(req, 10)]
    assert keys_of(pool, blocks[1]) == [fine_key(req, 10)]
    assert blocks[1].block_hash_num_tokens == 10


def test_a_shorter_prefix_is_an_extra_key_that_leaves_with_the_block():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    assert blocks[1].block_hash == fine_key(req, 10)    # the hash keeps the longer prefix
    assert pool.cached_block_hashes_by_block == {blocks[1].block_id: [fine_key(req, 8)]}
    assert pool.get_cached_block(req.block_hashes[3], [0]) == [blocks[1]]
    check(pool)
    pool.take_events()
    pool.evict_blocks({blocks[1].block_id})
    # One BlockRemoved per key, the block's hash first, then its extra keys.
    assert [e.block_hashes for e in pool.take_events()] == [[event_hash(req, 10)],
                                                             [event_hash(req, 8)]]
    assert keys_of(pool, blocks[1]) == [] and pool.cached_block_hashes_by_block == {}
    assert blocks[1].block_hash is None and blocks[1].block_hash_num_tokens is None


def test_a_hash_set_from_outside_covers_an_unknown_length_so_the_entry_is_an_extra_key():
    pool, req, blocks = two_block_pool()
    outside = make_block_hash_with_group_id(bytes(32), 0)
    blocks[1].set_block_hash(outside)                   # no num_tokens, as vLLM's tests do
    pool.cached_block_hash_to_block.insert(outside, blocks[1])
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    assert blocks[1].block_hash == outside
    assert pool.cached_block_hashes_by_block == {blocks[1].block_id: [fine_key(req, 10)]}


def test_filling_the_block_promotes_the_entry_to_the_full_key():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.take_events()
    req.append_output_token_ids([10, 11])               # 12 tokens: block 2 is full
    pool.cache_full_blocks(req, blocks, 1, 2, BS, 0)
    *removed, stored = pool.take_events()
    assert [e.block_hashes for e in removed] == [[event_hash(req, 10)], [event_hash(req, 8)]]
    assert stored.block_hashes == [event_hash(req, 12)]
    assert keys_of(pool, blocks[1]) == [fine_key(req, 12)]
    assert blocks[1].block_hash_num_tokens == 12
    assert pool.cached_block_hashes_by_block == {}
    check(pool)


def test_cache_full_blocks_refuses_a_block_whose_hash_is_not_a_shorter_partial_entry():
    pool, req, blocks = two_block_pool()
    req.append_output_token_ids([10, 11])
    pool.cache_full_blocks(req, blocks, 1, 2, BS, 0)
    before = keys_of(pool, blocks[1])
    with pytest.raises(RuntimeError, match="block 2 is already cached"):
        pool.cache_full_blocks(req, blocks, 1, 2, BS, 0)
    assert keys_of(pool, blocks[1]) == before and pool.take_events()[1:] == []


# -- the block goes: reuse, reset -----------------------------------------------------


def test_a_freed_block_with_an_entry_is_cached_so_it_waits_at_the_tail():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.free_blocks([blocks[1], blocks[0]])
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1]


def test_reusing_the_block_evicts_every_key_it_had():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 1, BS)   # another group: an extra key
    pool.free_blocks([blocks[1]])
    pool.get_new_blocks(2)                               # block 3, then block 2 again
    assert keys_of(pool, blocks[1]) == [] and pool.cached_block_hashes_by_block == {}
    assert pool.get_cached_block(req.block_hashes[3], [1]) is None
    check(pool)


def test_reset_prefix_cache_forgets_the_extra_keys():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hashes_by_block == {}
    assert pool.get_cached_block(req.block_hashes[3], [0]) is None


# -- the event ------------------------------------------------------------------------


def test_the_event_covers_the_entrys_last_fine_block_only():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 2, BS)
    (stored,) = pool.take_events()
    assert stored.token_ids == [8, 9] and stored.block_size == HBS
    assert stored.parent_block_hash == event_hash(req, 8)
    assert stored.group_idx == 2 and stored.extra_keys == [None]


def test_an_entry_at_the_first_fine_block_has_no_parent_and_carries_the_lora():
    pool = BlockPool(2, enable_caching=True, hash_block_size=HBS, enable_kv_cache_events=True)
    req = make_request([0, 1, 2], lora_request=LoRARequest("sql", 7))
    pool.cache_partial_block(req, pool.get_new_blocks(1)[0], 2, 0, BS)
    (stored,) = pool.take_events()
    assert stored.parent_block_hash is None and stored.token_ids == [0, 1]
    assert (stored.lora_id, stored.lora_name, stored.extra_keys) == (7, "sql", [("sql",)])


# -- what is refused ------------------------------------------------------------------


def test_the_null_block_gets_no_entry():
    pool, req, _ = two_block_pool()
    assert pool.cache_partial_block(req, pool.null_block, 3, 0, BS) is None  # not even checked
    assert pool.null_block.block_hash is None and pool.take_events() == []


@pytest.mark.parametrize("num_tokens, block_size, message", [
    (3, BS, "multiple of hash_block_size 2 and not of block_size 6"),   # off the fine grid
    (6, BS, "multiple of hash_block_size 2 and not of block_size 6"),   # a full block
    (0, BS, "multiple of hash_block_size 2 and not of block_size 6"),
    (14, BS, "needs 7 block hashes, request 'r' has 5"),                # beyond the request
    (2, HBS, "block_size 2 must be a multiple of hash_block_size 2 and larger"),
    (2, 5, "block_size 5 must be a multiple"),
])
def test_bad_arguments_raise_assertion_error_as_vllm_and_change_nothing(
        num_tokens, block_size, message):
    pool, req, blocks = two_block_pool()
    with pytest.raises(AssertionError, match=message):
        pool.cache_partial_block(req, blocks[1], num_tokens, 0, block_size)
    assert blocks[1].block_hash is None and pool.take_events() == []


# -- the checker knows entries ----------------------------------------------------


def test_the_checker_flags_an_extra_key_missing_from_the_index():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.cached_block_hash_to_block.pop(fine_key(req, 8), blocks[1].block_id)
    with pytest.raises(InvariantViolation, match="INV-HASH-2"):
        check(pool)


def test_the_checker_flags_extra_keys_on_a_block_without_a_hash():
    pool, req, blocks = two_block_pool()
    pool.cache_partial_block(req, blocks[1], 10, 0, BS)
    pool.cache_partial_block(req, blocks[1], 8, 0, BS)
    pool.cached_block_hash_to_block.pop(blocks[1].block_hash, blocks[1].block_id)
    blocks[1].reset_hash()             # the hash went, its extra key stayed behind
    with pytest.raises(InvariantViolation, match="partial-prefix keys but no hash"):
        check(pool)
