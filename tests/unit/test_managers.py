"""Each single-type manager on small hand-drawn cases.

Pictures in the docstrings read like this (block size 4 unless stated)::

    hash     h0  h1  h2  h3         the request's block hashes
    cached    5   _   7   8         block id holding that hash, _ = not cached
    hit     [NULL, NULL, 7, 8]      what find_longest_cache_hit returns

``NULL`` is the pool's null block (id 0): a position the attention type does
not need, counted as computed but holding nothing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvref import (
    BlockPool,
    ChunkedLocalAttentionManager,
    ChunkedLocalAttentionSpec,
    CrossAttentionManager,
    CrossAttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    MambaManager,
    MambaSpec,
    Request,
    SlidingWindowManager,
    SlidingWindowSpec,
    get_manager_for_kv_cache_spec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

NULL = "NULL"
_ = None  # "not cached" in a picture
BLOCK_SIZE = 4
# Stand-in block hashes: the pool only compares them, so any distinct bytes do.
HASHES = [f"hash-{i}".encode() for i in range(16)]


@pytest.fixture(autouse=True)
def _seed_hash_chain():
    init_none_hash(sha256)


# -- helpers -------------------------------------------------------------------


def make_pool(num_blocks: int = 32, hash_block_size: int = BLOCK_SIZE) -> BlockPool:
    return BlockPool(num_blocks, enable_caching=True, hash_block_size=hash_block_size)


def cache(pool: BlockPool, picture: list[int | None], group_id: int = 0,
          block_size: int = BLOCK_SIZE) -> None:
    """Cache ``HASHES[i]`` in block ``picture[i]`` for ``group_id``; ``_`` leaves
    hash ``i`` uncached. The blocks stay in the free queue (ref_cnt 0), as
    blocks of a finished request do."""
    blocks = [pool.null_block if b is None else pool.blocks[b] for b in picture]
    seed = SimpleNamespace(request_id="seed", block_hashes=HASHES)
    pool.cache_full_blocks(request=seed, blocks=blocks, num_cached_blocks=0,
                           num_full_blocks=len(blocks), block_size=block_size,
                           kv_cache_group_id=group_id)


def draw(blocks) -> list:
    return [NULL if b.is_null else b.block_id for b in blocks]


def lookup(manager_cls, pool, spec, max_length, group_ids=(0,), eagle=False,
           alignment=None) -> tuple[list, ...]:
    hit = manager_cls.find_longest_cache_hit(
        HASHES, max_length, list(group_ids), pool, spec, eagle,
        spec.block_size if alignment is None else alignment)
    return tuple(draw(blocks) for blocks in hit)


def make_manager(spec, pool, scheduler_block_size=None, max_num_batched_tokens=64,
                 max_model_len=1024):
    return get_manager_for_kv_cache_spec(
        spec, max_num_batched_tokens, max_model_len, block_pool=pool,
        enable_caching=True, kv_cache_group_id=0,
        scheduler_block_size=scheduler_block_size or spec.block_size)


def make_request(request_id: str, num_tokens: int, block_size: int = BLOCK_SIZE) -> Request:
    return Request(request_id, list(range(num_tokens)),
                   block_hasher=get_request_block_hasher(block_size, sha256))


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


FULL = FullAttentionSpec(BLOCK_SIZE)
WINDOW_8 = SlidingWindowSpec(BLOCK_SIZE, sliding_window=8)  # needs cdiv(7, 4) = 2 blocks
CHUNK_8 = ChunkedLocalAttentionSpec(BLOCK_SIZE, attention_chunk_size=8)
MAMBA = MambaSpec(BLOCK_SIZE, mamba_cache_mode="all")


# -- FullAttentionManager.find_longest_cache_hit --------------------------------


def test_full_attention_hit_stops_at_the_first_miss():
    """A later cached block cannot be used once one block misses::

        hash     h0  h1  h2  h3
        cached    5   6   _   8
        hit     [ 5,  6]
    """
    pool = make_pool()
    cache(pool, [5, 6, _, 8])
    assert lookup(FullAttentionManager, pool, FULL, 16) == ([5, 6],)


def test_full_attention_hit_covers_only_whole_blocks_within_max_length():
    """max_length 11 allows 11 // 4 = 2 blocks::

        cached    5   6   7   8
        hit     [ 5,  6]
    """
    pool = make_pool()
    cache(pool, [5, 6, 7, 8])
    assert lookup(FullAttentionManager, pool, FULL, 11) == ([5, 6],)


def test_full_attention_empty_cache_is_an_empty_hit():
    pool = make_pool()
    assert lookup(FullAttentionManager, pool, FULL, 16) == ([],)
    assert lookup(FullAttentionManager, pool, FULL, 16, eagle=True) == ([],)


def test_full_attention_eagle_drops_the_last_hit_block():
    """EAGLE recomputes the last hit block to get its hidden states::

        cached    5   6   7
        plain   [ 5,  6,  7]
        eagle   [ 5,  6]
    """
    pool = make_pool()
    cache(pool, [5, 6, 7])
    assert lookup(FullAttentionManager, pool, FULL, 12) == ([5, 6, 7],)
    assert lookup(FullAttentionManager, pool, FULL, 12, eagle=True) == ([5, 6],)


def test_full_attention_hit_is_popped_back_to_the_alignment():
    """alignment 8 tokens = 2 blocks of 4: a 3-block hit is cut to 2::

        cached    5   6   7
        hit     [ 5,  6]           (12 tokens is not a multiple of 8)
    """
    pool = make_pool()
    cache(pool, [5, 6, 7])
    assert lookup(FullAttentionManager, pool, FULL, 16, alignment=8) == ([5, 6],)


def test_full_attention_eagle_drop_then_alignment_pop():
    """The EAGLE drop comes first, then the alignment pop::

        cached    5   6   7   8
        found   [ 5,  6,  7,  8]   16 tokens
        eagle   [ 5,  6,  7]       12 tokens
        aligned [ 5,  6]            8 tokens (alignment 8)
    """
    pool = make_pool()
    cache(pool, [5, 6, 7, 8])
    assert lookup(FullAttentionManager, pool, FULL, 16, eagle=True, alignment=8) == ([5, 6],)


def test_full_attention_several_groups_hit_only_where_all_groups_hit():
    """Groups 0 and 1 are looked up together; a block counts only if both have it::

        hash       h0  h1  h2
        group 0     5   6   7
        group 1     9  10   _
        hit      ([5, 6], [9, 10])
    """
    pool = make_pool()
    cache(pool, [5, 6, 7], group_id=0)
    cache(pool, [9, 10, _], group_id=1)
    assert lookup(FullAttentionManager, pool, FULL, 12, group_ids=(0, 1)) == ([5, 6], [9, 10])
    # Group ids are part of the cache key: group 1 alone does not see group 0's h2.
    assert lookup(FullAttentionManager, pool, FULL, 12, group_ids=(1,)) == ([9, 10],)


# -- SlidingWindowManager.find_longest_cache_hit ---------------------------------


def test_sliding_window_hit_needs_only_the_last_blocks_of_the_window():
    """Window 8, block 4: the next token reads 7 earlier tokens = 2 blocks.
    Blocks left of the run are outside the window and become NULL::

        hash     h0  h1  h2  h3
        cached    5   _   7   8
        hit     [NULL, NULL, 7, 8]     16 tokens, 2 real blocks
    """
    pool = make_pool()
    cache(pool, [5, _, 7, 8])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([NULL, NULL, 7, 8],)


def test_sliding_window_trims_cached_blocks_right_of_the_run():
    """The scan goes right to left; block 10 alone is no run, the hit ends at 8::

        cached    5   _   7   8   _  10
        hit     [NULL, NULL, 7, 8]
    """
    pool = make_pool()
    cache(pool, [5, _, 7, 8, _, 10])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 24) == ([NULL, NULL, 7, 8],)


def test_sliding_window_takes_the_rightmost_run():
    """Runs at 0-1 and 3-4: the rightmost one gives the longer hit::

        cached    5   6   _   8   9
        hit     [NULL, NULL, NULL, 8, 9]
    """
    pool = make_pool()
    cache(pool, [5, 6, _, 8, 9])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 20) == ([NULL, NULL, NULL, 8, 9],)


def test_sliding_window_without_a_full_run_only_the_run_from_block_0_counts():
    """No 2 blocks in a row: a prefix shorter than the window needs no NULLs,
    so the cached run starting at block 0 is the hit (here 1 block)::

        cached    5   _   7   _
        hit     [5]
    """
    pool = make_pool()
    cache(pool, [5, _, 7, _])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([5],)


def test_sliding_window_without_a_run_and_block_0_missing_is_no_hit():
    """::

        cached    _   6   _   8
        hit     []
    """
    pool = make_pool()
    cache(pool, [_, 6, _, 8])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([],)


def test_sliding_window_run_must_end_on_an_aligned_boundary():
    """Alignment 8 (2 blocks): a run may only end after block 1, 3, ...
    Block 2 is cached but ends at token 12, so the scan skips it::

        cached      5   6   7   _
        align 4   [NULL, 6, 7]          12 tokens
        align 8   [ 5,  6]               8 tokens
    """
    pool = make_pool()
    cache(pool, [5, 6, 7, _])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([NULL, 6, 7],)
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16, alignment=8) == ([5, 6],)


def test_sliding_window_run_length_counts_window_minus_one_tokens():
    """The next token reads itself plus ``window - 1`` earlier tokens: window 5
    with block 4 needs cdiv(4, 4) = 1 cached block, not cdiv(5, 4) = 2::

        cached    _   6
        hit     [NULL, 6]
    """
    pool = make_pool()
    cache(pool, [_, 6])
    spec = SlidingWindowSpec(BLOCK_SIZE, sliding_window=5)
    assert lookup(SlidingWindowManager, pool, spec, 8) == ([NULL, 6],)


def test_sliding_window_eagle_needs_one_more_block_and_drops_it():
    """With EAGLE a hit needs 3 blocks in a row; the last is then dropped::

        cached      _   6   7   8
        plain     [NULL, NULL, 7, 8]
        eagle     [NULL, 6, 7, 8] -> [NULL, 6, 7]
    """
    pool = make_pool()
    cache(pool, [_, 6, 7, 8])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([NULL, NULL, 7, 8],)
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16, eagle=True) == ([NULL, 6, 7],)


def test_sliding_window_eagle_with_only_a_two_block_run_is_no_hit():
    """::

        cached      _   _   7   8
        plain     [NULL, NULL, 7, 8]
        eagle     []                    (a run of 3 is needed)
    """
    pool = make_pool()
    cache(pool, [_, _, 7, 8])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16) == ([NULL, NULL, 7, 8],)
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16, eagle=True) == ([],)


def test_sliding_window_eagle_run_ends_on_the_boundary_before_the_drop():
    """With EAGLE the run's last block is dropped, so the run itself ends one
    block past an aligned boundary. Alignment 8, need 3::

        cached    5   6   7   _
        run     [ 5,  6,  7]      ends at 12, after the drop at 8: aligned
        hit     [ 5,  6]
    """
    pool = make_pool()
    cache(pool, [5, 6, 7, _])
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16, eagle=True, alignment=8) == \
        ([5, 6],)


def test_sliding_window_several_groups_share_one_run():
    """::

        hash       h0  h1  h2  h3
        group 0     _   _   7   8
        group 1     _  10  11  12
        hit      ([NULL, NULL, 7, 8], [NULL, NULL, 11, 12])
    """
    pool = make_pool()
    cache(pool, [_, _, 7, 8], group_id=0)
    cache(pool, [_, 10, 11, 12], group_id=1)
    assert lookup(SlidingWindowManager, pool, WINDOW_8, 16, group_ids=(0, 1)) == \
        ([NULL, NULL, 7, 8], [NULL, NULL, 11, 12])


# -- ChunkedLocalAttentionManager.find_longest_cache_hit ------------------------------


def test_chunked_local_blocks_before_the_current_chunk_hit_even_with_an_empty_cache():
    """Chunk 8, max_length 16: token 16 starts a new chunk, so tokens 0-15 are
    never read again. A brand-new request "hits" all four blocks::

        cached    _   _   _   _
        hit     [NULL, NULL, NULL, NULL]    16 tokens
    """
    pool = make_pool()
    assert lookup(ChunkedLocalAttentionManager, pool, CHUNK_8, 16) == ([NULL] * 4,)


def test_chunked_local_looks_up_blocks_inside_the_current_chunk():
    """Chunk 8, max_length 15: token 15 is in chunk 8..15, so blocks 0-1 are
    NULL and block 2 is looked up::

        cached    5   6   7             cached    _   _   _
        hit     [NULL, NULL, 7]         hit     [NULL, NULL]
    """
    pool = make_pool()
    assert lookup(ChunkedLocalAttentionManager, pool, CHUNK_8, 15) == ([NULL, NULL],)
    cache(pool, [5, 6, 7])
    assert lookup(ChunkedLocalAttentionManager, pool, CHUNK_8, 15) == ([NULL, NULL, 7],)


def test_chunked_local_in_chunk_lookup_stops_at_the_first_miss():
    """Chunk 16, max_length 31: blocks 0-3 are NULL, 4-6 are looked up::

        cached    _   _   _   _   9  10   _
        hit     [NULL, NULL, NULL, NULL, 9, 10]
    """
    pool = make_pool()
    cache(pool, [_, _, _, _, 9, 10, _])
    spec = ChunkedLocalAttentionSpec(BLOCK_SIZE, attention_chunk_size=16)
    assert lookup(ChunkedLocalAttentionManager, pool, spec, 31) == \
        ([NULL, NULL, NULL, NULL, 9, 10],)


def test_chunked_local_rejects_eagle_and_mixed_block_sizes():
    pool = make_pool()
    with pytest.raises(ValueError, match="EAGLE"):
        lookup(ChunkedLocalAttentionManager, pool, CHUNK_8, 16, eagle=True)
    with pytest.raises(ValueError, match="block size"):
        lookup(ChunkedLocalAttentionManager, pool, CHUNK_8, 16, alignment=8)


# -- MambaManager.find_longest_cache_hit ----------------------------------------------


def test_mamba_hit_is_the_rightmost_cached_state_with_nulls_before_it():
    """One state block holds the whole prefix; older states are not needed::

        cached    5   _   7   _
        hit     [NULL, NULL, 7]      12 tokens, 1 real block
    """
    pool = make_pool()
    cache(pool, [5, _, 7, _])
    assert lookup(MambaManager, pool, MAMBA, 16) == ([NULL, NULL, 7],)
    assert lookup(MambaManager, pool, MAMBA, 15) == ([NULL, NULL, 7],)
    # max_length 11 only allows blocks 0-1: the state after block 0.
    assert lookup(MambaManager, pool, MAMBA, 11) == ([5],)


def test_mamba_no_cached_state_is_no_hit():
    pool = make_pool()
    assert lookup(MambaManager, pool, MAMBA, 16) == ([],)


def test_mamba_state_must_end_on_an_aligned_boundary():
    """Alignment 8: the state after block 2 ends at token 12 and is skipped::

        cached      5   6   7   _
        align 4   [NULL, NULL, 7]
        align 8   [NULL, 6]
    """
    pool = make_pool()
    cache(pool, [5, 6, 7, _])
    assert lookup(MambaManager, pool, MAMBA, 16) == ([NULL, NULL, 7],)
    assert lookup(MambaManager, pool, MAMBA, 16, alignment=8) == ([NULL, 6],)


def test_mamba_hit_ignores_the_eagle_drop():
    """Draft models have no Mamba layers: the state is kept::

        cached    5   6
        eagle   [NULL, 6]
    """
    pool = make_pool()
    cache(pool, [5, 6])
    assert lookup(MambaManager, pool, MAMBA, 8, eagle=True) == ([NULL, 6],)


# -- CrossAttentionManager -------------------------------------------------------------


def test_cross_attention_is_never_a_prefix_hit():
    pool = make_pool()
    cache(pool, [5, 6])
    with pytest.raises(ValueError, match="prefix caching"):
        lookup(CrossAttentionManager, pool, CrossAttentionSpec(BLOCK_SIZE), 8)


# -- get_num_skipped_tokens ---------------------------------------------------------------


def test_sliding_window_skips_tokens_left_of_the_window():
    """Window 4, 7 computed: the next token (7) reads 4..7, so 0..3 are skipped."""
    manager = make_manager(SlidingWindowSpec(BLOCK_SIZE, sliding_window=4), make_pool())
    assert manager.get_num_skipped_tokens(7) == 4
    assert manager.get_num_skipped_tokens(3) == 0
    assert manager.get_num_skipped_tokens(0) == 0


def test_chunked_local_skips_every_chunk_before_the_current_one():
    """Chunk 8: 13 computed -> next token 13 is in chunk 8..15 -> 8 skipped;
    8 computed -> token 8 opens a chunk -> 8 skipped; 7 computed -> 0."""
    manager = make_manager(CHUNK_8, make_pool())
    assert [manager.get_num_skipped_tokens(n) for n in (13, 8, 7)] == [8, 8, 0]


def test_mamba_skips_everything_but_the_last_token():
    manager = make_manager(MAMBA, make_pool())
    assert [manager.get_num_skipped_tokens(n) for n in (1, 5, 9)] == [0, 4, 8]


def test_full_attention_never_skips_tokens():
    manager = make_manager(FULL, make_pool())
    assert manager.get_num_skipped_tokens(1000) == 0


# -- remove_skipped_blocks -----------------------------------------------------------------


def test_remove_skipped_blocks_nulls_blocks_left_of_the_window_and_frees_them():
    """Window 8, 20 computed: 13 tokens skipped -> blocks 0-2 leave::

        before   [1, 2, 3, 4, 5]             free queue [6, 7]
        after    [NULL, NULL, NULL, 4, 5]    free queue [3, 2, 1, 6, 7]

    Freed right to left; uncached blocks go to the head of the queue.
    """
    pool = make_pool(num_blocks=8)
    manager = make_manager(WINDOW_8, pool)
    manager.allocate_new_blocks("r", 20, 20)
    assert draw(manager.req_to_blocks["r"]) == [1, 2, 3, 4, 5]
    assert queue_ids(pool) == [6, 7]

    manager.remove_skipped_blocks("r", 20)

    assert draw(manager.req_to_blocks["r"]) == [NULL, NULL, NULL, 4, 5]
    assert queue_ids(pool) == [3, 2, 1, 6, 7]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 1]


def test_remove_skipped_blocks_stops_at_an_existing_null_block():
    """Everything left of a NULL was removed by an earlier call, so the
    right-to-left walk stops there (block 1 is not looked at)::

        before   [1, NULL, 3, 4, 5]     16 tokens skipped -> blocks 0-3
        after    [1, NULL, NULL, NULL, 5]
    """
    pool = make_pool(num_blocks=8)
    manager = make_manager(WINDOW_8, pool)
    manager.allocate_new_blocks("r", 20, 20)
    table = manager.req_to_blocks["r"]
    table[1] = pool.null_block
    manager.remove_skipped_blocks("r", 16 + 8 - 1)  # window 8: skips 16 tokens

    assert draw(table) == [1, NULL, NULL, NULL, 5]
    assert queue_ids(pool) == [4, 3, 6, 7]


def test_remove_skipped_blocks_keeps_cached_blocks_reusable_at_the_tail():
    """A freed block that is cached goes to the tail of the queue (evicted last)."""
    pool = make_pool(num_blocks=8)
    manager = make_manager(WINDOW_8, pool)
    request = make_request("r", 20)
    manager.allocate_new_blocks("r", 20, 20)
    manager.cache_blocks(request, 20)
    manager.remove_skipped_blocks("r", 20)
    assert queue_ids(pool) == [6, 7, 3, 2, 1]


def test_remove_skipped_blocks_does_nothing_for_full_attention():
    pool = make_pool(num_blocks=8)
    manager = make_manager(FULL, pool)
    manager.allocate_new_blocks("r", 20, 20)
    manager.remove_skipped_blocks("r", 20)
    assert draw(manager.req_to_blocks["r"]) == [1, 2, 3, 4, 5]
    assert queue_ids(pool) == [6, 7]


def test_remove_skipped_blocks_only_reaches_allocated_blocks():
    """Skipped tokens may run past the table (external tokens): only held
    blocks are nulled."""
    pool = make_pool(num_blocks=8)
    manager = make_manager(WINDOW_8, pool)
    manager.allocate_new_blocks("r", 8, 8)
    manager.remove_skipped_blocks("r", 40)  # 33 skipped tokens = 8 blocks
    assert draw(manager.req_to_blocks["r"]) == [NULL, NULL]
    assert queue_ids(pool) == [2, 1, 3, 4, 5, 6, 7]


# -- get_num_common_prefix_blocks ----------------------------------------------------------


def _share_prefix(manager, num_shared: int) -> None:
    """Request "a" holds [1, 2, 3]; "b" takes a's first ``num_shared`` blocks
    as prefix hits, then one block of its own."""
    manager.allocate_new_blocks("a", 12, 12)
    shared = manager.req_to_blocks["a"][:num_shared]
    manager.add_local_computed_blocks("b", shared, num_shared * BLOCK_SIZE, 0)
    manager.allocate_new_blocks("b", (num_shared + 1) * BLOCK_SIZE, (num_shared + 1) * BLOCK_SIZE)


def test_full_attention_common_prefix_counts_leading_blocks_every_request_holds():
    """::

        a   [1, 2, 3]          ref_cnt  2  2  1
        b   [1, 2, 4]
        common prefix: 2 blocks (ref_cnt == 2 requests holding blocks)
    """
    manager = make_manager(FULL, make_pool())
    _share_prefix(manager, 2)
    assert draw(manager.req_to_blocks["b"]) == [1, 2, 4]
    assert manager.get_num_common_prefix_blocks("a") == 2
    assert manager.get_num_common_prefix_blocks("b") == 2


def test_full_attention_common_prefix_is_zero_when_another_request_holds_other_blocks():
    """A third request holding blocks raises the bar to ref_cnt == 3::

        a   [1, 2, 3]
        b   [1, 2, 4]
        c   [5]           -> 0 common blocks
    """
    manager = make_manager(FULL, make_pool())
    _share_prefix(manager, 2)
    manager.allocate_new_blocks("c", 4, 4)
    assert manager.get_num_common_prefix_blocks("a") == 0


@pytest.mark.parametrize("spec", [WINDOW_8, CHUNK_8, MAMBA], ids=["window", "chunked", "mamba"])
def test_common_prefix_is_zero_for_attention_types_other_than_full(spec):
    manager = make_manager(spec, make_pool())
    _share_prefix(manager, 2)
    assert manager.get_num_common_prefix_blocks("a") == 0


# -- reachable_block_mask ------------------------------------------------------------------


def test_sliding_window_caches_only_blocks_a_hit_can_end_on():
    """Alignment 32, block 8 -> a hit ends every 4 blocks; window 16 needs 2
    blocks (cdiv(15, 8)) before the end::

        block       0  1  2  3  4  5  6  7
        reachable   .  .  x  x  .  .  x  x
    """
    spec = SlidingWindowSpec(8, sliding_window=16)
    mask = SlidingWindowManager.reachable_block_mask(0, 8, 32, spec, False)
    assert mask == [False, False, True, True, False, False, True, True]
    # A range that starts mid-way reads the same positions.
    assert SlidingWindowManager.reachable_block_mask(4, 8, 32, spec, False) == \
        [False, False, True, True]


def test_sliding_window_mask_with_eagle_is_one_block_further_right():
    """EAGLE looks one block past the boundary (and needs 3 blocks, one dropped)::

        block       0  1  2  3  4  5  6  7  8  9
        reachable   .  .  x  x  x  .  x  x  x  .
    """
    spec = SlidingWindowSpec(8, sliding_window=16)
    mask = SlidingWindowManager.reachable_block_mask(0, 10, 32, spec, True)
    assert [i for i, keep in enumerate(mask) if keep] == [2, 3, 4, 6, 7, 8]


def test_mask_is_none_when_every_block_is_reachable():
    # Alignment equal to the block size: every block ends on a boundary.
    assert SlidingWindowManager.reachable_block_mask(
        0, 8, 8, SlidingWindowSpec(8, sliding_window=16), False) is None
    # Full attention caches every block.
    assert FullAttentionManager.reachable_block_mask(0, 8, 32, FullAttentionSpec(8), False) is None


def test_sliding_window_cache_blocks_hashes_only_reachable_blocks():
    pool = make_pool(num_blocks=16, hash_block_size=8)
    manager = make_manager(SlidingWindowSpec(8, sliding_window=16), pool,
                           scheduler_block_size=32)
    request = make_request("r", 64, block_size=8)
    manager.allocate_new_blocks("r", 64, 64)
    manager.cache_blocks(request, 64)
    hashed = [i for i, b in enumerate(manager.req_to_blocks["r"]) if b.block_hash is not None]
    assert hashed == [2, 3, 6, 7]


# -- admission caps ------------------------------------------------------------------------


def test_sliding_window_admission_cap_is_window_minus_one_plus_a_batch_plus_one_block():
    spec = SlidingWindowSpec(BLOCK_SIZE, sliding_window=8)
    # cdiv(7 + 16, 4) + 1 = 6 + 1
    assert spec.max_admission_blocks_per_request(16, 1000) == 7
    # Capped by max_model_len: cdiv(10, 4) + 1
    assert spec.max_admission_blocks_per_request(16, 10) == 4


def test_chunked_local_admission_cap_is_one_chunk_plus_a_batch():
    spec = ChunkedLocalAttentionSpec(BLOCK_SIZE, attention_chunk_size=8)
    assert spec.max_admission_blocks_per_request(16, 1000) == 6  # cdiv(8 + 16, 4)
    assert spec.max_admission_blocks_per_request(16, 10) == 3    # cdiv(10, 4)


def test_admission_cap_applies_only_when_asked():
    manager = make_manager(WINDOW_8, make_pool(), max_num_batched_tokens=16)
    args = dict(request_id="r", num_tokens=100, new_computed_blocks=[],
                total_computed_tokens=0, num_tokens_main_model=100)
    assert manager.get_num_blocks_to_allocate(**args) == 25
    assert manager.get_num_blocks_to_allocate(**args, apply_admission_cap=True) == 7
    # Full attention has no cap: it keeps every block.
    full = make_manager(FULL, make_pool(), max_num_batched_tokens=16)
    assert full.get_num_blocks_to_allocate(**args, apply_admission_cap=True) == 25


# -- Mamba align mode ----------------------------------------------------------------------


def test_mamba_align_mode_keeps_one_real_block_after_nulls():
    """Align mode, 10 tokens: only the running state needs a block::

        table   [NULL, NULL, 1]
    """
    pool = make_pool(num_blocks=8)
    manager = make_manager(MambaSpec(BLOCK_SIZE, mamba_cache_mode="align"), pool)
    assert manager.get_num_blocks_to_allocate("r", 10, [], 0, 10) == 1
    new = manager.allocate_new_blocks("r", 10, 10)
    assert draw(new) == [NULL, NULL, 1]
    assert draw(manager.req_to_blocks["r"]) == [NULL, NULL, 1]


def test_mamba_align_mode_takes_at_most_one_new_block_per_step():
    """A 14-token chunk after 10 tokens grows the table by 3 entries, but
    only one is a real block::

        step 1 (10 tokens)   [NULL, NULL, 1]
        step 2 (24 tokens)   [NULL, NULL, 1, NULL, NULL, 2]
    """
    pool = make_pool(num_blocks=8)
    manager = make_manager(MambaSpec(BLOCK_SIZE, mamba_cache_mode="align"), pool)
    manager.allocate_new_blocks("r", 10, 10)
    manager.remove_skipped_blocks("r", 10)
    assert draw(manager.req_to_blocks["r"]) == [NULL, NULL, 1]

    assert manager.get_num_blocks_to_allocate("r", 24, [], 10, 24) == 1
    new = manager.allocate_new_blocks("r", 24, 24)
    assert draw(new) == [NULL, NULL, 2]
    assert draw(manager.req_to_blocks["r"]) == [NULL, NULL, 1, NULL, NULL, 2]


def test_mamba_align_mode_frees_the_previous_state_block_once_a_newer_one_exists():
    """Step 3 starts with 24 computed tokens: the state at token 8 (block 1)
    is no longer needed; the walk from the right stops at the NULL at index
    4, so it is the remembered state index that frees it::

        before   [NULL, NULL, 1, NULL, NULL, 2]
        after    [NULL, NULL, NULL, NULL, NULL, 2]     block 1 back in the queue
    """
    pool = make_pool(num_blocks=8)
    manager = make_manager(MambaSpec(BLOCK_SIZE, mamba_cache_mode="align"), pool)
    manager.allocate_new_blocks("r", 10, 10)
    manager.remove_skipped_blocks("r", 10)
    manager.allocate_new_blocks("r", 24, 24)

    manager.remove_skipped_blocks("r", 24)

    assert draw(manager.req_to_blocks["r"]) == [NULL] * 5 + [2]
    assert queue_ids(pool) == [1, 3, 4, 5, 6, 7]


def test_mamba_all_mode_allocates_extra_blocks_for_speculative_states():
    pool = make_pool(num_blocks=8)
    manager = make_manager(MambaSpec(BLOCK_SIZE, mamba_cache_mode="all",
                                     num_speculative_blocks=2), pool)
    # 10 tokens -> 3 blocks, plus 2 speculative ones
    assert manager.get_num_blocks_to_allocate("r", 10, [], 0, 10) == 5
    assert draw(manager.allocate_new_blocks("r", 10, 10)) == [1, 2, 3, 4, 5]


def test_mamba_hit_on_a_state_cached_this_step_waits_for_the_next_step():
    """Request a caches its states this step; b's hit on them may read a state
    not written yet, so b is told "more blocks than the pool has" until
    ``new_step_starts()``."""
    pool = make_pool(num_blocks=8)
    manager = make_manager(MAMBA, pool)
    a = make_request("a", 8)
    manager.allocate_new_blocks("a", 8, 8)
    manager.cache_blocks(a, 8)

    b = make_request("b", 9)
    hit = MambaManager.find_longest_cache_hit(b.block_hashes, 8, [0], pool, MAMBA, False,
                                              BLOCK_SIZE)[0]
    assert draw(hit) == [NULL, 2]
    args = dict(request_id="b", num_tokens=9, new_computed_blocks=hit,
                total_computed_tokens=8, num_tokens_main_model=9)
    assert manager.get_num_blocks_to_allocate(**args) == pool.num_gpu_blocks + 1

    manager.new_step_starts()
    # 3 blocks for 9 tokens, 2 covered by the hit: one new block.
    assert manager.get_num_blocks_to_allocate(**args) == 1
