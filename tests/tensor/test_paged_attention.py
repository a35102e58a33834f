"""Paged attention over tables from the real KVCacheManager equals dense SDPA.

Every step of every scenario goes through ``check_step``: SDPA agreement
(float32, 1e-5), NaN in every unreadable slot changes nothing, the worker's
and the manager's tables agree, and null blocks sit exactly left of the window.
"""

from __future__ import annotations

import pytest
import torch

from kvref import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from kvref.attention import make_kv_cache, paged_attention, visible_key_range, write_kv
from kvref.verify.invariants import check_kv_cache_manager

from .driver import DEVICES, Run, check_step


def full(bs=4):
    return FullAttentionSpec(bs, num_kv_heads=2, head_size=8)


def swa(bs=4, w=7):
    return SlidingWindowSpec(bs, num_kv_heads=2, head_size=8, sliding_window=w)


def chunked(bs=4, c=8):
    return ChunkedLocalAttentionSpec(bs, num_kv_heads=2, head_size=8, attention_chunk_size=c)


CONFIGS = {
    "full": dict(specs=[full()]),
    "sliding_window": dict(specs=[swa()]),
    "sliding_window_block_aligned": dict(specs=[swa(w=8)]),
    "chunked_local": dict(specs=[chunked()]),
    "hybrid_full_swa": dict(specs=[full(), swa(w=6)]),
    "hybrid_full_chunked": dict(specs=[full(), chunked(c=8)]),
    "hybrid_diff_block_sizes": dict(specs=[full(8), swa(4, w=5)]),
    "kernel_split_full": dict(specs=[full(8)], kernel_block_sizes=[4]),
    "kernel_split_swa": dict(specs=[swa(8, w=10)], kernel_block_sizes=[2]),
}

PROMPT_A = [(7 * i + 3) % 50 for i in range(21)]
PROMPT_B = PROMPT_A[:17] + [1, 2, 3, 4, 5, 6]          # shares a 17-token prefix with A
PROMPT_C = [11, 12, 13, 14, 15]


def mixed_run(run: Run):
    """Prefill chunks next to decodes, a finished request whose blocks a later
    one hits, a preemption and a re-admission, a reordered batch. Yields each
    step as soon as it ran (check it before the next one changes the cache)."""
    run.add_request("a", PROMPT_A)
    run.add_request("c", PROMPT_C)
    yield (run.step({"a": 8, "c": 5}))                 # two prefill chunks
    run.append_token("c", 40)
    yield (run.step({"a": 13, "c": 1}))                # chunk + decode
    run.append_token("a", 41)
    run.append_token("c", 42)
    yield (run.step({"a": 1, "c": 1}))                 # two decodes
    run.finish("a")                                          # its full blocks stay cached
    run.add_request("b", PROMPT_B)
    run.append_token("c", 43)
    yield (run.step({"b": 5, "c": 1}))                 # b starts after a prefix hit
    run.preempt("c")
    yield (run.step({"b": 64}))                        # rest of b alone
    run.append_token("b", 44)
    yield (run.step({"c": 64, "b": 1}))                # c re-admitted, b decodes
    run.swap(0, 1)
    run.append_token("b", 45)
    run.append_token("c", 46)
    yield (run.step({"b": 1, "c": 1}))                 # after a reorder
    for _ in range(6):                                       # decodes slide the window on
        for req_id in ("b", "c"):
            run.append_token(req_id, (len(run.requests[req_id].all_token_ids) * 5) % 50)
        yield (run.step({"b": 1, "c": 1}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_manager_tables_give_sdpa_outputs(config, device):
    run = Run(num_blocks=48, device=device, **CONFIGS[config])
    for step in mixed_run(run):
        check_step(run, step)
    check_kv_cache_manager(run.manager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", ["full", "sliding_window", "chunked_local",
                                    "hybrid_full_swa", "kernel_split_swa"])
def test_half_precision_output_is_the_float32_answer_rounded(config, dtype, device):
    """Half-precision caches: scores and softmax run in float32, so the only
    error left is rounding the output to the dtype (relative eps of the dtype:
    measured on CPU up to 1.5e-3 absolute for float16, 1.1e-2 for bfloat16,
    on outputs of magnitude up to ~3)."""
    run = Run(num_blocks=48, device=device, dtype=dtype, **CONFIGS[config])
    for step in mixed_run(run):
        assert step.groups[0].output.dtype == dtype
        check_step(run, step, atol=1e-5, rtol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_grouped_query_heads(num_heads, num_kv_heads):
    specs = [FullAttentionSpec(4, num_kv_heads=num_kv_heads, head_size=8),
             SlidingWindowSpec(4, num_kv_heads=num_kv_heads, head_size=8, sliding_window=5)]
    run = Run(specs, num_blocks=48, num_heads=num_heads, num_kv_heads=num_kv_heads)
    for _, step in zip(range(5), mixed_run(run)):
        check_step(run, step)


def test_prefix_hit_reads_the_first_requests_blocks():
    """b's hit blocks are a's: the same physical slots serve both requests."""
    run = Run([full()], num_blocks=48)
    steps = list(mixed_run(run))
    a_blocks = steps[2].groups[0].block_table[steps[2].req_ids.index("a")][:4].tolist()
    b_row = steps[3].groups[0].block_table[steps[3].req_ids.index("b")][:4].tolist()
    assert a_blocks == b_row                       # 16 tokens = 4 full blocks hit
    assert steps[3].seq_lens[steps[3].req_ids.index("b")] == 16 + 5


def test_sliding_window_nulls_blocks_and_attention_never_reads_them():
    run = Run([swa(w=7)], num_blocks=48)
    run.add_request("r", list(range(30)))
    step = run.step({"r": 30})
    check_step(run, step)
    run.append_token("r", 1)
    step = run.step({"r": 1})                      # query at 30 sees 24..30
    check_step(run, step)
    assert run.manager.get_block_ids("r")[0][:6] == [0] * 6
    assert 0 not in run.manager.get_block_ids("r")[0][6:]


def test_write_kv_skips_padding_slots_and_only_writes_the_mapped_tokens():
    cache = make_kv_cache(3, 2, 1, 1, fill=-1.0)
    key = torch.arange(4.0).reshape(4, 1, 1)
    write_kv(cache, key, key + 10, torch.tensor([5, -1, 0]))   # token 3 is padding too
    flat_k = cache[:, 0].reshape(-1).tolist()
    flat_v = cache[:, 1].reshape(-1).tolist()
    assert flat_k == [2.0, -1.0, -1.0, -1.0, -1.0, 0.0]
    assert flat_v == [12.0, -1.0, -1.0, -1.0, -1.0, 10.0]


def test_padding_rows_of_the_query_stay_zero():
    cache = make_kv_cache(4, 2, 1, 2)
    cache.normal_()
    q = torch.randn(5, 2, 2)
    out = paged_attention(q, cache, query_start_loc=[0, 3], seq_lens=[3],
                          block_table=torch.tensor([[1, 2]]), scale=0.5)
    assert out[3:].abs().sum() == 0 and out[:3].abs().sum() > 0


def test_non_causal_attention_sees_the_whole_request():
    cache = make_kv_cache(4, 2, 1, 2)
    cache.normal_()
    q = torch.randn(3, 1, 2)
    table = torch.tensor([[3, 1]])
    out = paged_attention(q, cache, query_start_loc=[0, 3], seq_lens=[3], block_table=table,
                          scale=1.0, causal=False)
    k = torch.stack([cache[3, 0, 0], cache[3, 0, 1], cache[1, 0, 0]])     # [3, 1, 2]
    v = torch.stack([cache[3, 1, 0], cache[3, 1, 1], cache[1, 1, 0]])
    expected = torch.softmax(q[:, 0] @ k[:, 0].T, dim=-1) @ v[:, 0]
    torch.testing.assert_close(out[:, 0], expected, atol=1e-6, rtol=0)


def test_visible_key_range_follows_the_definitions():
    assert visible_key_range(5, 9) == range(0, 6)
    assert visible_key_range(5, 9, causal=False) == range(0, 9)
    assert visible_key_range(5, 9, sliding_window=1) == range(5, 6)
    assert visible_key_range(5, 9, sliding_window=3) == range(3, 6)
    assert visible_key_range(5, 9, attention_chunk_size=4) == range(4, 6)
    assert visible_key_range(5, 9, causal=False, attention_chunk_size=4) == range(4, 8)


@pytest.mark.parametrize("bad,match", [
    (dict(query=torch.zeros(3, 3, 4)), "multiple of num_kv_heads"),
    (dict(query_start_loc=[0, 3, 4]), "num_reqs \\+ 1"),
    (dict(seq_lens=[2]), "query_len 3"),
    (dict(block_table=torch.tensor([[1]])), "needs 2 blocks"),
    (dict(kv_cache=torch.zeros(4, 2, 2, 4)), "kv_cache must be"),
    (dict(sliding_window=0), "sliding_window must be a positive int"),
])
def test_shape_errors_name_the_shapes(bad, match):
    args = dict(query=torch.zeros(3, 2, 4), kv_cache=make_kv_cache(4, 2, 2, 4),
                query_start_loc=[0, 3], seq_lens=[4], block_table=torch.tensor([[1, 2]]),
                scale=1.0)
    args.update(bad)
    query, kv_cache = args.pop("query"), args.pop("kv_cache")
    with pytest.raises(ValueError, match=match):
        paged_attention(query, kv_cache, **args)
