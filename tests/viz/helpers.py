"""Small managers and a text console for the renderer tests."""

from __future__ import annotations

import io

from rich.console import Console

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, Request,
                   RequestStatus, SlidingWindowSpec, get_request_block_hasher, init_none_hash,
                   sha256)


def text_of(renderable, width: int = 80) -> str:
    """What a renderable prints on a plain 80-column terminal."""
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def widest_line(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def full_manager(num_blocks: int = 12, block_size: int = 4) -> KVCacheManager:
    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size))])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=block_size,
                          hash_block_size=block_size)


def hybrid_manager(num_blocks: int = 40) -> KVCacheManager:
    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["full"], FullAttentionSpec(4)),
                                        KVCacheGroupSpec(["swa"], SlidingWindowSpec(4, 8))])
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=4, hash_block_size=4)


def admit(manager: KVCacheManager, rid: str, tokens: list[int], block_size: int = 4) -> Request:
    """Look up, allocate the whole prompt, mark it computed."""
    req = Request(rid, tokens, block_hasher=get_request_block_hasher(block_size, sha256))
    hit, num_hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens
    return req


def long_pressure_trace() -> dict:
    """Over 1,000 ops (1,112 today): 14 long requests on a 24-block pool, the
    ``pressure`` preset's kind of load for longer (evictions, preemptions)."""
    import random
    from unittest import mock

    from kvref.viz import workloads as w

    def preset():
        rng = random.Random(7)
        arrivals = [w.Arrival(f"r{i}", w._tokens(rng, rng.randrange(18, 30)), 14, step=i // 2)
                    for i in range(14)]
        return w.Preset("long-pressure", "14 long requests on a 24-block pool", w._full(25),
                        4, 64, 32, arrivals, max_num_seqs=6, watermark=0.04)

    with mock.patch.dict(w.PRESETS, {"long-pressure": preset}):
        return w.record_workload("long-pressure")
