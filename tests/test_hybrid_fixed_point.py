"""The hybrid coordinator's prefix hit: one length every attention type accepts.

The first tests replay the worked example of
``kvref/core/kv_cache_coordinator.py`` on a real coordinator (made by
``KVCacheManager``): block size 4, groups full attention / sliding window 8 /
Mamba, a 33-token prompt, and this cache::

    block            0  1  2  3  4  5  6  7
    full attention   x  x  x  x  x  x  x  x
    sliding window   x  .  x  x  x  .  .  .
    mamba state      x  .  x  .  .  .  .  .

The hit shrinks 32 -> 20 -> 12 -> 4 and pass 3 confirms 4.
"""

from __future__ import annotations

import pytest

from kvref import (
    BlockHashListWithBlockSize,
    FullAttentionManager,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaManager,
    MambaSpec,
    Request,
    SlidingWindowManager,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)
from kvref.core.kv_cache_coordinator import SpecGroup

NULL = "NULL"
FULL = FullAttentionSpec(4)
WINDOW_8 = SlidingWindowSpec(4, sliding_window=8)
MAMBA = MambaSpec(4, mamba_cache_mode="all")


@pytest.fixture(autouse=True)
def _seed_hash_chain():
    init_none_hash(sha256)


def make_manager(*specs, num_blocks: int = 40, scheduler_block_size: int = 4,
                 hash_block_size: int = 4, **kwargs) -> KVCacheManager:
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([f"layer.{i}"], spec)
                                        for i, spec in enumerate(specs)])
    return KVCacheManager(config, max_model_len=1024,
                          scheduler_block_size=scheduler_block_size,
                          hash_block_size=hash_block_size, **kwargs)


def make_request(request_id: str, num_tokens: int, hash_block_size: int = 4) -> Request:
    return Request(request_id, list(range(num_tokens)),
                   block_hasher=get_request_block_hasher(hash_block_size, sha256))


def draw(blocks) -> list:
    return [NULL if b.is_null else b.block_id for b in blocks]


def ids(kv_cache_blocks) -> tuple[list, ...]:
    return tuple(draw(group) for group in kv_cache_blocks.blocks)


def record_lookups(monkeypatch, *manager_classes) -> list[tuple]:
    """Record each ``find_longest_cache_hit`` call as
    ``(manager, group ids, max_length, hit length, hash list type)``."""
    calls: list[tuple] = []
    for cls in manager_classes:
        original = cls.__dict__["find_longest_cache_hit"].__func__

        def recording(klass, block_hashes, max_length, kv_cache_group_ids, block_pool,
                      kv_cache_spec, drop_eagle_block, alignment_tokens, _original=original):
            hit = _original(klass, block_hashes, max_length, kv_cache_group_ids, block_pool,
                            kv_cache_spec, drop_eagle_block, alignment_tokens)
            calls.append((klass.__name__, list(kv_cache_group_ids), max_length,
                          len(hit[0]) * kv_cache_spec.block_size, type(block_hashes).__name__))
            return hit

        monkeypatch.setattr(cls, "find_longest_cache_hit", classmethod(recording))
    return calls


# -- the worked example ---------------------------------------------------------------------


def build_worked_example(mamba_evicted=(1, 3, 4, 5, 6, 7)) -> KVCacheManager:
    """Cache all 8 full blocks of a 33-token prompt in every group, then evict
    the blocks marked ``.`` in the module docstring.

    One 33-token step allocates 9 blocks per group, in group order::

        full attention   [ 1,  2, ...,  9]
        sliding window   [10, 11, ..., 18]
        mamba            [19, 20, ..., 27]
    """
    manager = make_manager(FULL, WINDOW_8, MAMBA)
    seed = make_request("seed", 33)
    manager.allocate_slots(seed, 33)
    assert manager.get_block_ids("seed") == (list(range(1, 10)), list(range(10, 19)),
                                             list(range(19, 28)))
    window_blocks, mamba_blocks = manager.get_block_ids("seed")[1:]
    manager.evict_blocks({window_blocks[i] for i in (1, 5, 6, 7)}
                         | {mamba_blocks[i] for i in mamba_evicted})
    manager.free(seed)
    return manager


def test_worked_example_cache_matches_the_picture():
    manager = build_worked_example()
    hashes = make_request("probe", 33).block_hashes
    rows = ["".join("x" if manager.block_pool.get_cached_block(h, [group]) else "."
                    for h in hashes[:8])
            for group in range(3)]
    assert rows == ["xxxxxxxx", "x.xxx...", "x.x....."]


def test_worked_example_agreed_hit_is_one_block_per_group():
    """Every group serves 4 tokens: ``[[1], [10], [19]]``. Full attention had
    32 tokens cached, so 28 tokens of this prefix are cached somewhere but
    not usable."""
    manager = build_worked_example()
    hit, num_hit = manager.get_computed_blocks(make_request("b", 33))
    assert num_hit == 4
    assert hit.get_block_ids() == ([1], [10], [19])
    assert manager.coordinator.num_uncached_common_prefix_tokens == 28


def test_worked_example_shrinks_32_20_12_4_and_pass_3_confirms(monkeypatch):
    """Full attention is looked up once (pass 1) and only trimmed after that.

    pass 1: full 32 -> 32, window 32 -> 20, mamba 20 -> 12
    pass 2:                window 12 ->  4, mamba  4 ->  4
    pass 3:                window  4 ->  4, mamba  4 ->  4   (nobody shrinks)
    """
    manager = build_worked_example()
    calls = record_lookups(monkeypatch, FullAttentionManager, SlidingWindowManager,
                           MambaManager)
    manager.coordinator.find_longest_cache_hit(make_request("b", 33).block_hashes, 32)
    assert [(name, max_length, found) for name, _, max_length, found, _ in calls] == [
        ("FullAttentionManager", 32, 32),
        ("SlidingWindowManager", 32, 20),
        ("MambaManager", 20, 12),
        ("SlidingWindowManager", 12, 4),
        ("MambaManager", 4, 4),
        ("SlidingWindowManager", 4, 4),
        ("MambaManager", 4, 4),
    ]


def test_worked_example_with_the_mamba_state_at_block_4_kept_settles_at_20():
    """The same cache, but Mamba keeps its state after block 4::

        mamba state      x  .  x  .  x  .  .  .

    pass 1: full 32, window 20, mamba 20 (block 4); pass 2 confirms 20.
    """
    manager = build_worked_example(mamba_evicted=(1, 3, 5, 6, 7))
    hit, num_hit = manager.get_computed_blocks(make_request("b", 33))
    assert num_hit == 20
    assert ids(hit) == ([1, 2, 3, 4, 5],
                        [NULL, NULL, NULL, 13, 14],
                        [NULL, NULL, NULL, NULL, 23])
    assert manager.coordinator.num_uncached_common_prefix_tokens == 12


# -- how groups are looked up -------------------------------------------------------------------


def test_groups_with_equal_specs_are_one_spec_group_looked_up_together(monkeypatch):
    """Groups 0 and 2 are both full attention with equal specs: one lookup
    serves both, and a block counts only if both groups have it."""
    manager = make_manager(FULL, WINDOW_8, FullAttentionSpec(4))
    assert manager.coordinator.attention_groups == [
        SpecGroup(FULL, [0, 2], FullAttentionManager, False),
        SpecGroup(WINDOW_8, [1], SlidingWindowManager, False),
    ]
    seed = make_request("seed", 12)
    manager.allocate_slots(seed, 12)
    assert manager.get_block_ids("seed") == ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    manager.evict_blocks({9})          # group 2 loses its third block only

    calls = record_lookups(monkeypatch, FullAttentionManager, SlidingWindowManager)
    hit, num_hit = manager.get_computed_blocks(make_request("b", 13))
    assert num_hit == 8
    assert ids(hit) == ([1, 2], [4, 5], [7, 8])
    assert [(name, groups) for name, groups, *_ in calls] == [
        ("FullAttentionManager", [0, 2]),
        ("SlidingWindowManager", [1]),
    ]


def test_full_attention_spec_group_is_sorted_first():
    manager = make_manager(WINDOW_8, MAMBA, FULL)
    assert [(type(g.spec).__name__, g.group_ids)
            for g in manager.coordinator.attention_groups] == [
        ("FullAttentionSpec", [2]),
        ("SlidingWindowSpec", [0]),
        ("MambaSpec", [1]),
    ]


def test_a_bigger_block_size_reads_every_other_fine_hash(monkeypatch):
    """Hashes every 4 tokens; the window group has blocks of 8, so its block
    ``i`` is keyed by fine hash ``2i + 1`` (the hash chains over the whole
    prefix, so the hash at a block's end fingerprints it)::

        fine (4)     | h0 | h1 | h2 | h3 |
        coarse (8)   |   h1    |   h3    |
    """
    window_16 = SlidingWindowSpec(8, sliding_window=16)
    manager = make_manager(FULL, window_16, scheduler_block_size=8)
    seed = make_request("seed", 32)
    manager.allocate_slots(seed, 32)
    window_blocks = manager.coordinator.get_blocks("seed")[1]
    assert [b.block_hash for b in window_blocks] == [
        make_block_hash_with_group_id(seed.block_hashes[i], 1) for i in (1, 3, 5, 7)]

    calls = record_lookups(monkeypatch, FullAttentionManager, SlidingWindowManager)
    hit, num_hit = manager.get_computed_blocks(make_request("b", 33))
    assert num_hit == 32
    assert ids(hit) == ([1, 2, 3, 4, 5, 6, 7, 8], [NULL, NULL, 11, 12])
    assert {name: hashes for name, _, _, _, hashes in calls} == {
        "FullAttentionManager": "list", "SlidingWindowManager": "BlockHashListWithBlockSize"}


def test_block_hash_list_with_block_size_is_a_view_of_the_fine_hashes():
    fine = [b"A", b"B", b"C", b"D", b"E"]
    coarse = BlockHashListWithBlockSize(fine, 4, 8)
    assert len(coarse) == 2                 # the 5th fine hash starts an unfinished block
    assert list(coarse) == [b"B", b"D"]
    assert coarse[0:2] == [b"B", b"D"]
    with pytest.raises(IndexError):
        coarse[2]


# -- caching granularity ---------------------------------------------------------------------------


def test_hybrid_cache_blocks_caches_only_up_to_a_scheduler_block_boundary():
    """scheduler_block_size 8: after 20 tokens, hits can only end at 16, so
    full attention (block 4) caches 4 blocks, not 5; the window group (block
    8) caches 2. At 24 tokens the fifth and sixth full blocks follow."""
    manager = make_manager(FULL, SlidingWindowSpec(8, sliding_window=16),
                           scheduler_block_size=8)
    request = make_request("a", 40)
    manager.allocate_slots(request, 20)
    full_blocks, window_blocks = manager.coordinator.get_blocks("a")

    def cached(blocks):
        return [b.block_hash is not None for b in blocks]

    assert cached(full_blocks) == [True] * 4 + [False]
    assert cached(window_blocks) == [True, True, False]

    request.num_computed_tokens = 20
    manager.allocate_slots(request, 4)
    assert cached(full_blocks) == [True] * 6
    assert cached(window_blocks) == [True, True, True]


def test_hybrid_eagle_groups_cache_one_block_past_the_boundary():
    """With EAGLE, a lookup peeks one block past an aligned end and drops it,
    so that block must be cached too: 20 tokens -> 16 + one 4-token block."""
    manager = make_manager(FULL, SlidingWindowSpec(8, sliding_window=16),
                           scheduler_block_size=8, use_eagle=True)
    request = make_request("a", 40)
    manager.allocate_slots(request, 20)
    full_blocks, window_blocks = manager.coordinator.get_blocks("a")
    assert [b.block_hash is not None for b in full_blocks] == [True] * 5
    # The window group's next block (tokens 16..24) is not full yet.
    assert [b.block_hash is not None for b in window_blocks] == [True, True, False]
