"""Mamba state blocks from the real MambaManager: a prefix hit on a cached state
continues exactly as a full recomputation would (modes "all" and "align")."""

from __future__ import annotations

import pytest
import torch

from kvref import FullAttentionSpec, MambaSpec
from kvref.attention.mamba_state import make_state_cache, mamba_step, recurrence_reference
from kvref.verify.invariants import check_kv_cache_manager

from .driver import DEVICES, Run, check_step

PROMPT = [(3 * i + 1) % 50 for i in range(22)]
SHARED = PROMPT[:16] + [7, 7, 7, 9, 9, 9, 8, 8, 8, 8, 8, 8]     # same first 16 tokens


def configs():
    for mode in ("all", "align"):
        yield f"mamba_{mode}", [MambaSpec(4, mamba_cache_mode=mode)]
        yield f"hybrid_full_mamba_{mode}", [FullAttentionSpec(4, num_kv_heads=2, head_size=8),
                                            MambaSpec(4, mamba_cache_mode=mode)]


CONFIGS = dict(configs())


def run_scenario(run: Run):
    """Block-aligned prefill chunks (align mode needs them, as vLLM's scheduler
    cuts them), decodes across block boundaries, a hit on a finished request's
    cached states, a preemption and re-admission. Yields each step."""
    run.add_request("a", PROMPT)
    yield run.step({"a": 8})
    yield run.step({"a": 8})
    yield run.step({"a": 8})                                # last chunk: 6 tokens
    for t in (30, 31, 32):
        run.append_token("a", t)
        yield run.step({"a": 1})                            # 23, 24 (boundary), 25
    run.finish("a")
    run.add_request("b", SHARED)
    yield run.step({"b": 8})                                # starts after the hit
    yield run.step({"b": 4})
    run.append_token("b", 33)
    yield run.step({"b": 1})
    run.preempt("b")
    run.add_request("c", PROMPT[:9])
    yield run.step({"b": 64, "c": 8})                       # b re-admitted next to c
    run.append_token("b", 34)
    run.append_token("c", 35)
    yield run.step({"b": 1, "c": 64})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_states_in_manager_blocks_equal_full_recomputation(config, device):
    run = Run(CONFIGS[config], num_blocks=40, device=device)
    for step in run_scenario(run):
        check_step(run, step)
    check_kv_cache_manager(run.manager)
    # b's first admission continued from a's cached state at 16 tokens, and its
    # re-admission after preemption from its own state at 28
    assert run.admissions == [("a", 0), ("b", 16), ("b", 28), ("c", 8)]


def test_a_hit_reads_exactly_one_cached_state_block():
    run = Run([MambaSpec(4, mamba_cache_mode="all")], num_blocks=40)
    for i, step in enumerate(run_scenario(run)):
        if i == 1:                          # a has computed 16 tokens
            a_state_at_16 = run.manager.get_block_ids("a")[0][3]
        if i == 6:                          # b's first step, right after its hit
            break
    assert run.admissions[-1] == ("b", 16) and step.seq_lens == [16 + 8]
    # b's row: nulls for the states it never needs, a's state at 16, a new block
    row = step.groups[0].block_table[0].tolist()
    assert row[:4] == [0, 0, 0, a_state_at_16] and 0 not in row[4:6]


def test_mode_all_writes_every_boundary_state_and_align_only_the_last():
    decay = torch.tensor([0.5])
    x = torch.ones(10, 1)
    expected = recurrence_reference(x, decay)
    for mode, written in (("all", {5: 3, 9: 7, 2: 9}), ("align", {2: 9})):
        cache = make_state_cache(10, 1, fill=float("nan"))
        y = mamba_step(x, cache, decay=decay, query_start_loc=[0, 10], seq_lens=[10],
                       block_table=torch.tensor([[5, 9, 2]]), block_size=4,
                       mamba_cache_mode=mode)
        torch.testing.assert_close(y, expected)
        for block, token_idx in written.items():
            assert cache[block].item() == pytest.approx(expected[token_idx].item())
        unwritten = [b for b in range(10) if b not in written]
        assert torch.isnan(cache[unwritten]).all()


def test_unaligned_chunks_in_align_mode_leave_a_wrong_state_behind():
    """Why vLLM cuts align-mode chunks at block boundaries: a step from 6 to 11
    tokens moves the running state to a new block and leaves the state at 6 in
    the block a later hit reads as "the state at 8"."""
    decay = torch.tensor([0.5])
    x = torch.ones(11, 1)
    expected = recurrence_reference(x, decay)
    cache = make_state_cache(4, 1)
    table = torch.tensor([[0, 1, 2]])
    mamba_step(x[:6], cache, decay=decay, query_start_loc=[0, 6], seq_lens=[6],
               block_table=table, block_size=4, mamba_cache_mode="align")
    mamba_step(x[6:], cache, decay=decay, query_start_loc=[0, 5], seq_lens=[11],
               block_table=table, block_size=4, mamba_cache_mode="align")
    assert cache[1].item() == pytest.approx(expected[5].item())      # state at 6 ...
    assert cache[1].item() != pytest.approx(expected[7].item())      # ... not at 8
    assert cache[2].item() == pytest.approx(expected[10].item())


def test_bad_mode_and_shapes_are_refused():
    cache = make_state_cache(2, 3)
    args = dict(decay=torch.ones(3), query_start_loc=[0, 1], seq_lens=[1],
                block_table=torch.tensor([[1]]), block_size=4)
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        mamba_step(torch.ones(1, 3), cache, mamba_cache_mode="none", **args)
    with pytest.raises(ValueError, match=r"\[num_tokens, S\]"):
        mamba_step(torch.ones(1, 2), cache, mamba_cache_mode="all", **args)
