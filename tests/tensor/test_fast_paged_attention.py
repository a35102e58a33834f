"""The engine's batched paged attention equals the per-request reference and dense SDPA.

Every step of the scenarios of ``test_paged_attention`` (prefix hits, windows,
chunks, hybrid groups, kernel-split blocks, preemption, reordered rows) runs
``fast_paged_attention`` on the same query, cache and block table as the
reference ``paged_attention``; both must give dense SDPA's answer (float32,
1e-5), and the fast path must not change when every slot no query may read
is NaN, through the worker's table and through the manager's.
"""

from __future__ import annotations

import pytest
import torch

from kvref import FullAttentionSpec, SlidingWindowSpec
from kvref.attention import (
    KVGatherBuffer,
    fast_paged_attention,
    make_kv_cache,
    paged_attention,
)
from kvref.attention.fast_paged_attention import DEFAULT_CHUNK_BYTES
from kvref.attention.paged_attention import visible_key_range
from kvref.math_utils import cdiv

from .driver import DEVICES, Run, chunk_of, nan_outside, window_of
from .test_paged_attention import CONFIGS, mixed_run


def check_fast_step(run: Run, step, buffer: KVGatherBuffer, atol: float = 1e-5,
                    rtol: float = 0.0) -> None:
    num_rows = step.query_start_loc[-1]
    for gb in step.groups:
        spec = run.specs[gb.group]
        common = dict(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
                      scale=run.scale, sliding_window=window_of(spec),
                      attention_chunk_size=chunk_of(spec), buffer=buffer)
        fast = fast_paged_attention(gb.query, run.caches[gb.group], block_table=gb.block_table,
                                    **common)
        assert fast.dtype == gb.output.dtype and fast.shape == gb.output.shape
        assert torch.isfinite(fast[:num_rows]).all()
        torch.testing.assert_close(fast.float(), run.reference(step, gb.group), atol=atol,
                                   rtol=rtol)
        torch.testing.assert_close(fast, gb.output, atol=atol, rtol=rtol)   # the reference
        poisoned = nan_outside(run.caches[gb.group], run.readable_slots(step, gb.group))
        for table in (gb.block_table, gb.manager_table):
            assert torch.equal(fast_paged_attention(gb.query, poisoned, block_table=table,
                                                    **common), fast)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_fast_path_equals_the_reference_and_sdpa_on_every_step(config, device):
    run = Run(num_blocks=48, device=device, **CONFIGS[config])
    buffer = KVGatherBuffer()                 # one buffer for every step, as in the engine
    for step in mixed_run(run):
        check_fast_step(run, step, buffer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", ["full", "sliding_window", "chunked_local",
                                    "hybrid_full_swa", "kernel_split_swa"])
def test_fast_path_in_half_precision_is_the_float32_answer_rounded(config, dtype, device):
    run = Run(num_blocks=48, device=device, dtype=dtype, **CONFIGS[config])
    buffer = KVGatherBuffer()
    for step in mixed_run(run):
        check_fast_step(run, step, buffer, rtol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_gathering_one_request_at_a_time_gives_the_same_answer(config):
    """The default chunk holds these small batches whole; ``max_bytes=1`` makes every
    request its own chunk (its own gather, zeroed slots, mask rows and SDPA call)."""
    run = Run(num_blocks=48, **CONFIGS[config])
    buffer = KVGatherBuffer(max_bytes=1)
    for step in mixed_run(run):
        check_fast_step(run, step, buffer)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_fast_path_grouped_query_heads(num_heads, num_kv_heads):
    specs = [FullAttentionSpec(4, num_kv_heads=num_kv_heads, head_size=8),
             SlidingWindowSpec(4, num_kv_heads=num_kv_heads, head_size=8, sliding_window=5)]
    run = Run(specs, num_blocks=48, num_heads=num_heads, num_kv_heads=num_kv_heads)
    for _, step in zip(range(5), mixed_run(run)):
        for max_bytes in (DEFAULT_CHUNK_BYTES, 1):         # the batch whole; one request
            check_fast_step(run, step, KVGatherBuffer(max_bytes=max_bytes))


def _random_batch(seed: int, query_lens: list[int], seq_lens: list[int], block_size: int = 4):
    gen = torch.Generator().manual_seed(seed)
    blocks = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(num_blocks, 2, block_size, 2, 8, generator=gen)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for r, n in enumerate(blocks):
        table[r, :n] = torch.tensor([perm.pop() for _ in range(n)])
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1] + 2, 4, 8, generator=gen)        # + 2 padding rows
    return query, cache, dict(query_start_loc=starts, seq_lens=seq_lens, block_table=table,
                              scale=8 ** -0.5)


@pytest.mark.parametrize("options", [dict(), dict(causal=False), dict(sliding_window=3),
                                     dict(attention_chunk_size=4),
                                     dict(causal=False, attention_chunk_size=8),
                                     dict(sliding_window=6, attention_chunk_size=8)])
@pytest.mark.parametrize("max_bytes", [None, 1, 4000])
def test_mixed_query_lengths_match_the_reference(options, max_bytes):
    """Decodes, chunks and an idle row in one batch: three SDPA calls, one answer,
    however many requests are gathered at a time."""
    query, cache, batch = _random_batch(1, [1, 5, 0, 1, 5, 9], [13, 7, 4, 2, 21, 9])
    want = paged_attention(query, cache, **batch, **options)
    got = fast_paged_attention(query, cache, **batch, **options,
                               buffer=KVGatherBuffer(max_bytes=max_bytes))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got[-2:].abs().sum() == 0                                # padding rows stay 0


def test_a_batch_is_gathered_as_many_requests_at_a_time_as_fit_in_max_bytes():
    """Five decodes of 4 blocks of 4 keys, 2 KV heads x 8, float32: 2 * 16 * 2 * 8 * 4
    = 2048 bytes of keys and values each; 4096 bytes hold two, so chunks of 2, 2, 1.
    The slots past each sequence are NaN, in every chunk: each chunk zeroes its own."""
    seq_lens = [13, 16, 9, 14, 15]
    query, cache, batch = _random_batch(2, [1] * 5, seq_lens)
    for r, n in enumerate(seq_lens):
        row = batch["block_table"][r]
        for pos in range(n, 16):
            cache[row[pos // 4], :, pos % 4] = float("nan")
    buffer = KVGatherBuffer(max_bytes=4096)
    assert buffer.requests_per_chunk(5, 16, cache) == 2
    assert KVGatherBuffer(max_bytes=1).requests_per_chunk(5, 16, cache) == 1   # at least one
    assert KVGatherBuffer(max_bytes=None).requests_per_chunk(5, 16, cache) == 5
    got = fast_paged_attention(query, cache, **batch, buffer=buffer)
    assert torch.isfinite(got[:5]).all()
    torch.testing.assert_close(got, paged_attention(query, cache, **batch), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_bytes must be a positive int or None, got 0"):
        KVGatherBuffer(max_bytes=0)


@pytest.mark.parametrize("options", [dict(), dict(sliding_window=3),
                                     dict(attention_chunk_size=4)])
@pytest.mark.parametrize("max_bytes", [None, 1])
def test_requests_of_one_length_share_a_mask_and_still_see_only_their_slots(options,
                                                                              max_bytes):
    """Three chunks of 5 queries over the same 14 tokens share one planned mask; a
    fourth of 5 queries over 11 tokens in the same batch gets its own. Every slot
    no query may read is NaN, so a wrong shared row or a missed zeroing shows."""
    seq_lens = [14, 14, 11, 14]
    query, cache, batch = _random_batch(4, [5] * 4, seq_lens)
    want = paged_attention(query, cache, **batch, **options)
    for r, n in enumerate(seq_lens):
        row = batch["block_table"][r]
        for pos in range(16):
            readable = any(pos in visible_key_range(q, n, True, **options)
                           for q in range(n - 5, n))
            if not readable:
                cache[row[pos // 4], :, pos % 4] = float("nan")
    got = fast_paged_attention(query, cache, **batch, **options,
                               buffer=KVGatherBuffer(max_bytes=max_bytes))
    assert torch.isfinite(got[:20]).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_one_buffer_serves_batches_of_any_size():
    buffer = KVGatherBuffer()
    for seed, (q_lens, s_lens) in enumerate([([1, 1], [30, 3]), ([1] * 6, [5] * 6),
                                             ([3], [3]), ([1, 1], [30, 3])]):
        query, cache, batch = _random_batch(seed, q_lens, s_lens)
        torch.testing.assert_close(fast_paged_attention(query, cache, **batch, buffer=buffer),
                                   paged_attention(query, cache, **batch), atol=1e-5, rtol=0)


def test_float64_stays_float64():
    query, cache, batch = _random_batch(3, [2, 1], [6, 9])
    query, cache = query.double(), cache.double()
    got = fast_paged_attention(query, cache, **batch)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, paged_attention(query, cache, **batch), atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad,match", [
    (dict(query=torch.zeros(3, 3, 4)), "multiple of num_kv_heads"),
    (dict(query_start_loc=[0, 3, 4]), "num_reqs \\+ 1"),
    (dict(seq_lens=[2]), "query_len 3"),
    (dict(block_table=torch.tensor([[1]])), "needs 2 blocks"),
    (dict(kv_cache=torch.zeros(4, 2, 2, 4)), "kv_cache must be"),
    (dict(attention_chunk_size=-2), "attention_chunk_size must be a positive int"),
])
def test_fast_path_shape_errors_name_the_shapes(bad, match):
    args = dict(query=torch.zeros(3, 2, 4), kv_cache=make_kv_cache(4, 2, 2, 4),
                query_start_loc=[0, 3], seq_lens=[4], block_table=torch.tensor([[1, 2]]),
                scale=1.0)
    args.update(bad)
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        fast_paged_attention(query, kv_cache, **args)


def test_a_plan_writes_where_write_kv_writes_and_checks_the_slots_once():
    from kvref.attention import PagedAttentionPlan, write_kv
    key = torch.arange(12.0).reshape(4, 1, 3)
    slots = torch.tensor([5, -1, 0, 3])                       # a padding token in the middle
    want, got = make_kv_cache(3, 2, 1, 3, fill=-1.0), make_kv_cache(3, 2, 1, 3, fill=-1.0)
    write_kv(want, key, key + 100, slots)
    plan = PagedAttentionPlan([0, 4], [4], torch.tensor([[0, 1, 2]]), block_size=2,
                              num_blocks=3, slot_mapping=slots)
    plan.write_kv(got, key, key + 100)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="outside 0..5"):
        PagedAttentionPlan([0, 1], [1], torch.tensor([[0]]), block_size=2, num_blocks=3,
                           slot_mapping=torch.tensor([6]))
    with pytest.raises(ValueError, match="3 blocks of 2"):
        plan.write_kv(make_kv_cache(4, 2, 1, 3), key, key)
    with pytest.raises(ValueError, match="without a slot_mapping"):
        PagedAttentionPlan([0, 1], [1], torch.tensor([[0]]), block_size=2).write_kv(got, key, key)


@pytest.mark.parametrize("query_lens", [[1, 1], [7, 7], [1, 7, 16]])
def test_whole_prompts_read_only_their_own_slots(query_lens):
    """Prompts with no context take SDPA's causal path (or the decode path for one
    token): every slot past each prompt is NaN, and the answer is the reference's."""
    query, cache, batch = _random_batch(5, query_lens, list(query_lens))
    for r, n in enumerate(query_lens):
        blocks = batch["block_table"][r, :cdiv(n, 4)].tolist()
        last = blocks[-1]
        cache[last, :, n - (len(blocks) - 1) * 4:] = float("nan")   # the last block's tail
    cache[0] = float("nan")                                          # the null block
    got = fast_paged_attention(query, cache, **batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, paged_attention(query, cache, **batch), atol=1e-5, rtol=0)
