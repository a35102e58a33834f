"""Prefix-hit search on arbitrary cache states (a property test beside the machines).

The state machines reach gaps in the cache only through eviction pressure. Here
Hypothesis makes the gaps directly: one request fills and caches a prompt, is
freed, an arbitrary set of its blocks is evicted (``evict_blocks``), and the
same prompt comes again. Whatever survived, the hit must obey INV-HIT-1 (at
most ``num_tokens - 1``, a multiple of the scheduler block size), INV-HIT-2
(every group covers exactly the hit length) and INV-HIT-3 (every real block of
the hit is cached under this request's own hash for its position), and each
attention type must hold the blocks it reads (full attention: all; sliding
window: the last ``cdiv(window - 1, block_size)``; Mamba: the last one).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvref.math_utils import cdiv

from . import backend
from .backend import (
    BlockHashListWithBlockSize,
    Request,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)

CONFIGS = {
    "full": (FullAttentionSpec(4),),
    "sliding_window": (SlidingWindowSpec(4, sliding_window=9),),
    "hybrid_full_swa": (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=9)),
    "hybrid_full_swa_mamba": (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=9),
                              MambaSpec(4, mamba_cache_mode="all")),
    # The window's blocks are finer than the hit granularity (8 tokens).
    "hybrid_finer_window": (FullAttentionSpec(8), SlidingWindowSpec(4, sliding_window=9)),
    "hybrid_finer_mamba": (FullAttentionSpec(8), MambaSpec(4, mamba_cache_mode="all")),
}


def _manager(specs):
    sizes = [s.block_size for s in specs]
    return backend.make_manager(backend.make_kv_cache_config(64, specs), max_model_len=256,
                                scheduler_block_size=math.lcm(*sizes),
                                hash_block_size=math.gcd(*sizes))


def _blocks_read(spec, num_blocks: int) -> range:
    """Indexes of the hit blocks this attention type reads."""
    if isinstance(spec, SlidingWindowSpec):
        need = cdiv(spec.sliding_window - 1, spec.block_size)
        return range(max(0, num_blocks - need), num_blocks)
    if isinstance(spec, MambaSpec):
        return range(num_blocks - 1, num_blocks) if num_blocks else range(0)
    return range(num_blocks)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@given(num_tokens=st.integers(2, 60), evicted=st.sets(st.integers(1, 63), max_size=24))
def test_a_hit_on_a_gappy_cache_is_aligned_complete_and_correct(name, num_tokens, evicted):
    """INV-HIT-1, INV-HIT-2, INV-HIT-3 on any pattern of evicted blocks."""
    specs = CONFIGS[name]
    init_none_hash(sha256)
    manager = _manager(specs)
    hasher = get_request_block_hasher(manager.block_pool.hash_block_size, sha256)
    prompt = [(7 * i) % 50 + 10 for i in range(num_tokens)]
    first = Request("first", prompt, block_hasher=hasher)
    assert manager.allocate_slots(first, num_tokens) is not None
    manager.free(first)
    manager.evict_blocks(evicted)

    again = Request("again", prompt, block_hasher=hasher)
    hit, hit_len = manager.get_computed_blocks(again)
    alignment = manager.coordinator.scheduler_block_size
    assert hit_len <= num_tokens - 1, "INV-HIT-1: the hit covers the last prompt token"
    assert hit_len % alignment == 0, f"INV-HIT-1: hit of {hit_len} tokens, not a multiple of {alignment}"
    hash_size = manager.block_pool.hash_block_size
    for group_id, (spec, blocks) in enumerate(zip(specs, hit.blocks)):
        assert len(blocks) * spec.block_size == hit_len, \
            f"INV-HIT-2: group {group_id} covers {len(blocks) * spec.block_size} of {hit_len} tokens"
        hashes = (again.block_hashes if spec.block_size == hash_size else
                  BlockHashListWithBlockSize(again.block_hashes, hash_size, spec.block_size))
        read = _blocks_read(spec, len(blocks))
        for i, block in enumerate(blocks):
            if i in read:
                assert not block.is_null, \
                    f"INV-HIT-3: group {group_id} reads block {i} of the hit but got the null block"
            if not block.is_null:
                assert block.block_hash == make_block_hash_with_group_id(hashes[i], group_id), \
                    f"INV-HIT-3: group {group_id} block {i} holds other tokens than the prompt"
