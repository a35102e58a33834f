"""Prefix-cache retention intervals: which window and Mamba blocks stay cached.

vLLM's ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (kvref reads the same variable,
or takes ``retention_interval=`` explicitly). Every case here caches one
256-token prompt in one step, block size 16 in each group, and asks the pool
which of the 16 block hashes a group holds::

    interval    window 16 (need 1) / Mamba states    full attention
    unset       0 .. 15                              0 .. 15
    64          3, 7, 11, 15 (segments) + 14 (replay) 0 .. 15
    0           14 (the replay boundary only)        0 .. 15

The replay boundary is 240 = (256 - 1) // 16 * 16: a request repeating the
prompt hits at most 255 tokens, cut to the last aligned boundary.
"""

from __future__ import annotations

import pytest

from kvref import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    MambaManager,
    Request,
    SlidingWindowManager,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from kvref.core.kv_cache_coordinator import RETENTION_INTERVAL_ENV, retention_interval_from_env

BLOCK = 16
PROMPT = [t for t in range(16) for _ in range(BLOCK)]  # 256 tokens, 16 distinct blocks
ALL = set(range(16))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    init_none_hash(sha256)
    monkeypatch.delenv(RETENTION_INTERVAL_ENV, raising=False)


def window(block_size: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, sliding_window=block_size)


def mamba() -> MambaSpec:
    return MambaSpec(BLOCK, mamba_cache_mode="all")


def make_manager(*specs, scheduler_block_size: int = BLOCK, use_eagle: bool = False,
                 enable_caching: bool = True, **kwargs) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheManager(KVCacheConfig(200, groups), max_model_len=4096,
                          scheduler_block_size=scheduler_block_size, hash_block_size=BLOCK,
                          use_eagle=use_eagle, enable_caching=enable_caching, **kwargs)


def request(rid: str, tokens: list[int] = PROMPT) -> Request:
    return Request(rid, tokens, block_hasher=get_request_block_hasher(BLOCK, sha256))


def cached_after_prefill(manager: KVCacheManager, group: int,
                         tokens: list[int] = PROMPT) -> set[int]:
    """Prefill ``tokens`` in one step; the hash indices ``group`` holds in the pool."""
    req = request("r0", tokens)
    assert manager.allocate_slots(req, len(tokens)) is not None
    return {i for i, h in enumerate(req.block_hashes)
            if manager.block_pool.get_cached_block(h, [group]) is not None}


# -- reading and checking the interval -----------------------------------------------


def test_the_variable_is_read_as_an_int_and_unset_means_none(monkeypatch):
    assert retention_interval_from_env() is None
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, "64")
    assert retention_interval_from_env() == 64
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, "sixty-four")
    with pytest.raises(ValueError, match="must be an integer number of tokens.*sixty-four"):
        retention_interval_from_env()


@pytest.mark.parametrize("interval, message", [
    ("33", r"\(33\) must be non-negative and a multiple of scheduler_block_size \(32\)"),
    ("-32", r"\(-32\) must be non-negative"),
])
def test_a_bad_variable_fails_at_construction_naming_it(monkeypatch, interval, message):
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, interval)
    with pytest.raises(ValueError, match=RETENTION_INTERVAL_ENV + " " + message):
        make_manager(FullAttentionSpec(32), window(8), scheduler_block_size=32)


def test_a_bad_keyword_fails_naming_the_keyword():
    with pytest.raises(ValueError, match=r"retention_interval \(24\) must be non-negative "
                                         r"and a multiple of scheduler_block_size \(16\)"):
        make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=24)
    with pytest.raises(ValueError, match="retention_interval must be an int or None"):
        make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=64.0)
    with pytest.raises(ValueError, match="retention_interval must be an int or None"):
        make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=True)


def test_an_interval_without_window_or_mamba_group_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="no KV cache group is sliding-window or Mamba"):
        make_manager(FullAttentionSpec(BLOCK), retention_interval=64)
    # As in vLLM, the check runs for every coordinator, caching on or off.
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, "64")
    with pytest.raises(ValueError, match=RETENTION_INTERVAL_ENV + " is set"):
        make_manager(FullAttentionSpec(BLOCK), enable_caching=False)


def test_the_keyword_overrides_the_variable(monkeypatch):
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, "0")
    assert make_manager(window()).coordinator.retention_interval == 0
    manager = make_manager(window(), retention_interval=None)
    assert manager.coordinator.retention_interval is None
    assert cached_after_prefill(manager, 0) == ALL


# -- which blocks stay cached ---------------------------------------------------------


@pytest.mark.parametrize("interval, expected", [
    (None, ALL),
    (64, {3, 7, 11, 14, 15}),
    (0, {14}),
    (16, ALL),        # one block per segment: every block is a tail
])
def test_pure_window_keeps_segment_tails_and_the_replay_tail(interval, expected):
    manager = make_manager(window(), retention_interval=interval)
    assert cached_after_prefill(manager, 0) == expected


@pytest.mark.parametrize("interval, expected", [
    (None, ALL),
    (64, {3, 7, 11, 14, 15}),
    (0, {14}),
])
def test_hybrid_window_is_thinned_and_full_attention_is_not(interval, expected):
    manager = make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=interval)
    assert cached_after_prefill(manager, 1) == expected
    assert {i for i in range(16) if manager.block_pool.get_cached_block(
        request("x").block_hashes[i], [0]) is not None} == ALL


@pytest.mark.parametrize("interval, expected", [
    (None, ALL),
    (64, {3, 7, 11, 14, 15}),
    (0, {14}),
])
def test_hybrid_mamba_keeps_one_state_per_interval_and_the_replay_state(interval, expected):
    manager = make_manager(FullAttentionSpec(BLOCK), mamba(), retention_interval=interval)
    assert cached_after_prefill(manager, 1) == expected
    mamba_manager = manager.coordinator.single_type_managers[1]
    # Only hashed states count as "cached this step" (the rest carry no hash).
    assert len(mamba_manager.cached_blocks_this_step) == len(expected)


def test_the_variable_is_what_the_managers_see(monkeypatch):
    monkeypatch.setenv(RETENTION_INTERVAL_ENV, "64")
    manager = make_manager(FullAttentionSpec(BLOCK), window())
    assert cached_after_prefill(manager, 1) == {3, 7, 11, 14, 15}


def test_latest_only_retention_serves_the_replay_and_nothing_shorter():
    manager = make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=0)
    first = request("first")
    manager.allocate_slots(first, len(PROMPT))
    manager.free(first)
    _, num_hit = manager.get_computed_blocks(request("replay"))
    assert num_hit == 240
    # A prompt ending at 240 would hit at 224 at most, whose tail was never kept.
    _, num_hit = manager.get_computed_blocks(request("shorter", PROMPT[:240]))
    assert num_hit == 0


def test_eagle_window_keeps_the_extra_proof_block_at_the_replay_boundary():
    """EAGLE reads one block past the boundary and drops it: with interval 0 and
    window 16 the replay tail is blocks 14 and 15 (the run ending at 256)."""
    spec = window()
    mask = SlidingWindowManager.reachable_block_mask(
        start_block=0, end_block=16, alignment_tokens=BLOCK, kv_cache_spec=spec,
        use_eagle=True, retention_interval=0, num_prompt_tokens=256)
    assert [i for i, keep in enumerate(mask) if keep] == [14, 15]


def test_masks_of_a_later_range_read_the_same_positions():
    """``cache_blocks`` asks for ``[num_cached, num_full)`` each step; a range
    that starts later must mark the same absolute blocks."""
    spec = window()
    whole = SlidingWindowManager.reachable_block_mask(0, 16, BLOCK, spec, False, 64, 256)
    assert SlidingWindowManager.reachable_block_mask(5, 16, BLOCK, spec, False, 64, 256) \
        == whole[5:]
    states = MambaManager.reachable_block_mask(0, 16, BLOCK, mamba(), False, 64, 256)
    assert MambaManager.reachable_block_mask(5, 16, BLOCK, mamba(), False, 64, 256) \
        == states[5:]
    assert [i for i, keep in enumerate(states) if keep] == [3, 7, 11, 14, 15]


def test_a_chunked_prefill_keeps_the_same_blocks_as_one_step():
    manager = make_manager(FullAttentionSpec(BLOCK), window(), retention_interval=64)
    req = request("chunked")
    for _ in range(4):
        assert manager.allocate_slots(req, 64) is not None
        req.num_computed_tokens += 64
    assert {i for i, h in enumerate(req.block_hashes)
            if manager.block_pool.get_cached_block(h, [1]) is not None} == {3, 7, 11, 14, 15}
