"""Every computed prompt token has one cause (specs/simulate.md, S1-S4): hand-made cases.

Each test builds a few prompts that produce one cause, runs them through
``simulate`` and checks that cause's count to the token, and that the causes sum
to the prompt tokens computed (rule S1; ``simulate`` asserts it too).
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

from kvref.simulate import (CAUSES, ModelShape, TraceRequest, pool_from_tokens, simulate)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def req(i, tokens, out=2, t=0.0):
    return TraceRequest(f"r{i}", len(tokens), out, t, tokens=list(tokens))


def run(reqs, num_blocks=200, **kw):
    result = simulate(reqs, kw.pop("pool", None) or pool_from_tokens(num_blocks), **kw)
    assert sum(result.misses_by_cause.values()) == result.prompt_tokens_computed
    assert set(result.misses_by_cause) == set(CAUSES)
    return result


def only(result, **expected):
    """The causes named have these counts; every other cause is 0."""
    got = {c: n for c, n in result.misses_by_cause.items() if n}
    assert got == {c: n for c, n in expected.items() if n}, got


def test_distinct_prompts_are_all_first_occurrence():
    r = run([req(0, range(1000, 1050)), req(1, range(2000, 2040))])
    only(r, first_occurrence=90)
    assert r.prompt_tokens_cached_once == 0 and r.prompt_tokens_computed == 90


def test_a_shared_prefix_ending_inside_a_block_hits_only_its_full_blocks():
    """24 shared tokens, block 16: one block hits, the other 8 are computed again."""
    system = list(range(1000, 1024))
    r = run([req(0, system + list(range(2000, 2010))), req(1, system + list(range(3000, 3010)))])
    assert r.per_request_hits == {"r0": 0, "r1": 16}
    only(r, first_occurrence=34 + 10, shared_prefix_ends_inside_block=8)


def test_a_prompt_shorter_than_the_block_never_hits():
    """The 0 % report: every prompt shares 12 tokens, the block holds 16."""
    system = list(range(1000, 1012))
    r = run([req(i, system + [5000 + i]) for i in range(4)])
    assert r.prompt_tokens_cached_once == 0 and r.prefix_cache_hits == 0
    only(r, first_occurrence=13 + 3, shared_prefix_ends_inside_block=3 * 12)


def test_a_repeated_block_aligned_prompt_recomputes_its_last_block():
    """32 tokens twice, block 16: the cap at num_tokens - 1 leaves one block to compute."""
    prompt = list(range(1000, 1032))
    r = run([req(0, prompt), req(1, prompt)])
    assert r.per_request_hits == {"r0": 0, "r1": 16}
    only(r, first_occurrence=32, last_token_cap=16)


def test_a_repeated_unaligned_prompt_recomputes_its_partial_block():
    prompt = list(range(1000, 1040))                  # 2.5 blocks
    r = run([req(0, prompt), req(1, prompt)])
    assert r.per_request_hits["r1"] == 32
    only(r, first_occurrence=40, shared_prefix_ends_inside_block=8)


def test_blocks_evicted_before_reuse():
    """A 7-block pool (6 usable): the filler takes all six, evicting the first prompt's
    two; a filler of five blocks would leave the first one (tails are evicted first)."""
    first = list(range(1000, 1032))
    for filler_len, hit in ((94, 0), (80, 16)):
        filler = list(range(5000, 5000 + filler_len))
        r = run([req(0, first, out=1), req(1, filler, out=1), req(2, first + [7, 8], out=1)],
                num_blocks=7, max_model_len=96)
        assert r.per_request_hits["r2"] == hit
        only(r, first_occurrence=32 + filler_len + 2, evicted_before_reuse=32 - hit)


def test_prefix_caching_off():
    prompt = list(range(1000, 1040))
    r = run([req(0, prompt), req(1, prompt)], enable_prefix_caching=False)
    assert r.prefix_cache_queries == 0                # vLLM records no lookup at all
    only(r, first_occurrence=40, prefix_caching_disabled=40)


def test_a_mamba_hybrid_in_align_mode_hits_nothing_at_concurrency_one():
    """Full attention has the blocks; the Mamba group kept no state at a block boundary,
    because "align" keeps a state only where a step ends on one (100 is not)."""
    tiny = ModelShape("tiny-mamba", 1e6, 1, 1, 8, num_mamba_layers=1, mamba_num_heads=1,
                      mamba_head_dim=1, mamba_state_size=1, mamba_n_groups=1)
    pool = pool_from_tokens(200, shape=tiny, mamba_cache_mode="align")
    assert pool.block_size == 16
    a = list(range(1000, 1100))
    r = run([req(0, a), req(1, a + list(range(5000, 5040)))], pool=pool)
    assert r.per_request_hits == {"r0": 0, "r1": 0}
    only(r, first_occurrence=140, window_or_mamba_limit=96, shared_prefix_ends_inside_block=4)
    # The same requests on full attention alone hit the 96 tokens.
    plain = run([req(0, a), req(1, a + list(range(5000, 5040)))])
    assert plain.per_request_hits["r1"] == 96


def test_recompute_after_preemption_is_its_own_cause_and_vllm_counts_it_apart():
    """Six requests at once in a 17-block pool: decodes run out of blocks, the
    last-admitted request is preempted and computes its prompt again."""
    reqs = [req(i, range(1000 * (i + 1), 1000 * (i + 1) + 30), out=30) for i in range(6)]
    r = run(reqs, num_blocks=17, arrivals="timestamps", max_model_len=64)
    assert r.num_preemptions > 0
    assert r.misses_by_cause["recompute_after_preemption"] > 0
    assert r.misses_by_cause["first_occurrence"] == 6 * 30
    assert r.prompt_tokens_computed == 180 + r.misses_by_cause["recompute_after_preemption"]
    assert r.preempted_prefix_cache_queries > 0
    # vLLM's own counters leave the preempted lookups out.
    assert r.prefix_cache_queries + r.preempted_prefix_cache_queries >= r.prompt_tokens


def test_vllm_counts_a_query_per_admission_attempt():
    """Two 40-token prompts at once in a pool that holds one: the second is looked up
    (and counted) every step it waits, so queries exceed the prompt tokens."""
    reqs = [req(0, range(1000, 1040), out=8), req(1, range(2000, 2040), out=8)]
    r = run(reqs, num_blocks=5, arrivals="timestamps", max_model_len=60,
            max_num_batched_tokens=64, max_num_seqs=8)
    assert r.prefix_cache_queries > r.prompt_tokens
    assert r.hit_ratio_once == 0.0 and r.prompt_tokens == 80


@pytest.mark.parametrize("module", ["kvref.simulate.engine", "kvref.simulate.sizing",
                                    "kvref.simulate.traces", "kvref.data"])
def test_module_examples_hold(module):
    result = doctest.testmod(importlib.import_module(module),
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
