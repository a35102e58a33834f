"""Cascade attention over the prefix the manager says is shared equals plain
paged attention; the log-sum-exp merge is exact on any split of the keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import FullAttentionSpec
from kvref.attention import (
    attend,
    cascade_attention,
    compute_cascade_attn_prefix_len,
    merge_attn_states,
    paged_attention,
)

from .driver import DEVICES, Run, check_step

SYSTEM = [(5 * i + 2) % 50 for i in range(13)]


def cascade_of(run: Run, step) -> tuple[int, torch.Tensor]:
    """The step's prefix length by vLLM's rule, and cascade attention's output."""
    gb = step.groups[0]
    num_common = run.manager.get_num_common_prefix_blocks(step.req_ids[0])[0]
    context_lens = [s - step.query_len(r) for r, s in enumerate(step.seq_lens)]
    prefix_len = compute_cascade_attn_prefix_len(num_common, run.specs[0].block_size,
                                                 context_lens)
    if prefix_len == 0:
        return 0, gb.output
    return prefix_len, cascade_attention(
        gb.query, run.caches[0], query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens, block_table=gb.block_table, scale=run.scale,
        common_prefix_len=prefix_len)


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_over_the_managers_common_prefix_equals_plain(device):
    run = Run([FullAttentionSpec(4, num_kv_heads=2, head_size=8)], num_blocks=48,
              device=device)
    run.add_request("s", SYSTEM + [1, 2, 3])
    check_step(run, run.step({"s": 64}))              # caches the system prompt's blocks
    for i, req_id in enumerate("abc"):
        run.add_request(req_id, SYSTEM + [10 + i] * (3 + 2 * i))
    step = run.step({"a": 64, "b": 5, "c": 64})        # hits on the system prompt
    check_step(run, step)
    prefix_lens = []
    for n in range(4):
        for req_id in ("a", "b", "c", "s"):
            if run.requests[req_id].num_computed_tokens == run.requests[req_id].num_tokens:
                run.append_token(req_id, 20 + n)
        step = run.step({"a": 1, "b": 4, "c": 1, "s": 1})   # decodes next to b's chunks
        check_step(run, step)
        prefix_len, out = cascade_of(run, step)
        prefix_lens.append(prefix_len)
        torch.testing.assert_close(out, step.groups[0].output, atol=1e-5, rtol=0)
    # 13 shared tokens = 3 full blocks, all four requests hold them
    assert prefix_lens == [12, 12, 12, 12]


def test_prefix_len_is_capped_by_the_least_context_and_whole_blocks():
    assert compute_cascade_attn_prefix_len(5, 4, [30, 13, 40]) == 12
    assert compute_cascade_attn_prefix_len(2, 4, [30, 13]) == 8
    assert compute_cascade_attn_prefix_len(0, 4, [30]) == 0
    assert compute_cascade_attn_prefix_len(3, 4, [3, 30]) == 0


def test_cascade_refuses_a_prefix_that_is_not_shared_or_reaches_a_query():
    cache = torch.randn(8, 2, 4, 1, 2)
    q = torch.randn(2, 1, 2)
    args = dict(query_start_loc=[0, 1, 2], seq_lens=[9, 9], scale=1.0)
    with pytest.raises(ValueError, match="not a shared prefix"):
        cascade_attention(q, cache, block_table=torch.tensor([[1, 2, 3], [1, 5, 6]]),
                          common_prefix_len=8, **args)
    with pytest.raises(ValueError, match="exceeds the smallest context_len"):
        cascade_attention(q, cache, block_table=torch.tensor([[1, 2, 3], [1, 2, 6]]),
                          common_prefix_len=12, **args)
    with pytest.raises(ValueError, match="multiple of the block size"):
        cascade_attention(q, cache, block_table=torch.tensor([[1, 2, 3], [1, 2, 6]]),
                          common_prefix_len=6, **args)
    out = cascade_attention(q, cache, block_table=torch.tensor([[1, 2, 3], [1, 2, 6]]),
                            common_prefix_len=8, **args)
    plain = paged_attention(q, cache, block_table=torch.tensor([[1, 2, 3], [1, 2, 6]]),
                            **args)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)


@settings(max_examples=25)
@given(num_queries=st.integers(1, 4), num_keys=st.integers(2, 12), seed=st.integers(0, 2**16),
       data=st.data())
def test_merging_two_disjoint_key_sets_equals_attending_to_both(num_queries, num_keys, seed,
                                                               data):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, 4, 8, generator=g)
    k = torch.randn(num_keys, 2, 8, generator=g)
    v = torch.randn(num_keys, 2, 8, generator=g)
    in_first = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_keys,
                                               max_size=num_keys)))
    everything = attend(q, k, v, torch.ones(num_queries, num_keys, dtype=torch.bool), 0.3)
    first = attend(q, k, v, in_first.expand(num_queries, -1), 0.3)
    second = attend(q, k, v, (~in_first).expand(num_queries, -1), 0.3)
    merged = merge_attn_states(first.output, first.lse, second.output, second.lse)
    torch.testing.assert_close(merged.output, everything.output, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged.lse, everything.lse, atol=1e-5, rtol=0)
