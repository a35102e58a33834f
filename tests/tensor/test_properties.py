"""Hypothesis properties of paged attention over the real KVCacheManager.

- random schedules (admissions with prefix hits, chunks of any size, decodes,
  preemptions, finishes): every step passes ``check_step`` (SDPA, NaN in every
  unreadable slot, worker table == manager table, nulls exactly left of the
  window), FlashInfer's form gives the same output, and cascade attention over
  the manager's common prefix equals plain attention;
- permuting the physical block ids (cache and table together) changes nothing;
- chunked prefill in any chunk sizes equals one prefill;
- a prefill that reuses prefix-hit blocks equals a full prefill without caching.

Examples are few and derandomized (the ``ci`` profile of tests/conftest.py).
"""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvref import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.attention import (
    cascade_attention,
    compute_cascade_attn_prefix_len,
    flashinfer_paged_attention,
    paged_attention,
    to_flashinfer,
)
from kvref.verify.invariants import check_kv_cache_manager

from .driver import Run, check_step, chunk_of, window_of


def _full(bs=4):
    return FullAttentionSpec(bs, num_kv_heads=2, head_size=8)


def _swa(w, bs=4):
    return SlidingWindowSpec(bs, num_kv_heads=2, head_size=8, sliding_window=w)


CONFIGS = {
    "full": ([_full()], None),
    "sliding_window_5": ([_swa(5)], None),
    "sliding_window_9": ([_swa(9)], None),
    "chunked_local_8": ([ChunkedLocalAttentionSpec(4, num_kv_heads=2, head_size=8,
                                                   attention_chunk_size=8)], None),
    "hybrid_full_swa": ([_full(), _swa(6)], None),
    "hybrid_full_chunked_8": ([_full(), ChunkedLocalAttentionSpec(
        4, num_kv_heads=2, head_size=8, attention_chunk_size=8)], None),
    "hybrid_full_mamba_all": ([_full(), MambaSpec(4, mamba_cache_mode="all")], None),
    "kernel_split_full_swa": ([_full(8), _swa(7, bs=8)], [4, 2]),
}
config_names = st.sampled_from(sorted(CONFIGS))
BASE = [(11 * i + 5) % 50 for i in range(40)]


def make_run(name: str, **kwargs) -> Run:
    specs, kernel_block_sizes = CONFIGS[name]
    return Run(specs, kernel_block_sizes=kernel_block_sizes, **kwargs)


def prompts():
    """Prompts that share prefixes of random lengths with a common base."""
    return st.lists(st.tuples(st.integers(0, 24), st.integers(1, 14)), min_size=1, max_size=4)


def check_other_forms(run: Run, step) -> None:
    """FlashInfer's form and cascade attention agree with the step's output."""
    num_tokens = step.query_start_loc[-1]
    for gb in step.groups:
        spec = run.specs[gb.group]
        if isinstance(spec, (MambaSpec, ChunkedLocalAttentionSpec)):
            continue
        page = run.kernel_block_sizes[gb.group]
        live = [r for r in range(len(step.req_ids)) if step.seq_lens[r] > 0]
        table = to_flashinfer(gb.block_table[live], [step.seq_lens[r] for r in live], page)
        w = window_of(spec)
        fi = flashinfer_paged_attention(
            gb.query, run.caches[gb.group], qo_indptr=[step.query_start_loc[r] for r in live]
            + [num_tokens], kv_indptr=table.kv_indptr, kv_indices=table.kv_indices,
            kv_last_page_len=table.kv_last_page_len, scale=run.scale,
            window_left=-1 if w is None else w - 1).output
        torch.testing.assert_close(fi, gb.output, atol=1e-5, rtol=0)
        if w is not None:
            continue
        num_common = run.manager.get_num_common_prefix_blocks(step.req_ids[0])[gb.group]
        context_lens = [s - step.query_len(r) for r, s in enumerate(step.seq_lens)]
        prefix_len = compute_cascade_attn_prefix_len(num_common, spec.block_size,
                                                     context_lens)
        event(f"cascade prefix > 0: {prefix_len > 0}")
        if prefix_len:
            out = cascade_attention(gb.query, run.caches[gb.group],
                                    query_start_loc=step.query_start_loc,
                                    seq_lens=step.seq_lens, block_table=gb.block_table,
                                    scale=run.scale, common_prefix_len=prefix_len)
            torch.testing.assert_close(out, gb.output, atol=1e-5, rtol=0)


@settings(max_examples=40)
@given(name=config_names, specs=prompts(), data=st.data())
def test_random_schedules_keep_every_step_exact(name, specs, data):
    run = make_run(name, num_blocks=120, max_num_reqs=4)
    waiting = []
    for i, (shared, own) in enumerate(specs):
        run.add_request(f"r{i}", BASE[:shared] + [(7 * i + j) % 50 for j in range(own)])
        waiting.append(f"r{i}")
    decoded = 0
    for _ in range(data.draw(st.integers(2, 7), label="steps")):
        schedule = {}
        for req_id in list(run.rows):
            req = run.requests[req_id]
            if req.num_computed_tokens == req.num_tokens:
                run.append_token(req_id, (req.num_tokens * 3) % 50)
                decoded += 1
            schedule[req_id] = data.draw(st.integers(1, 12), label=f"chunk {req_id}")
        if waiting and data.draw(st.booleans(), label="admit"):
            schedule[waiting.pop(0)] = data.draw(st.integers(1, 30), label="first chunk")
        if not schedule and not waiting:
            break                                   # everyone finished
        if not schedule:
            schedule[waiting.pop(0)] = 30
        step = run.step(schedule)
        check_step(run, step)
        check_other_forms(run, step)
        if run.rows and data.draw(st.integers(0, 4), label="preempt/finish") == 0:
            victim = data.draw(st.sampled_from(run.rows), label="victim")
            if data.draw(st.booleans(), label="preempt"):
                run.preempt(victim)
                waiting.append(victim)
            else:
                run.finish(victim)
    check_kv_cache_manager(run.manager)
    event(f"prefix hits: {sum(1 for _, n in run.admissions if n)}")


@settings(max_examples=20)
@given(name=st.sampled_from(["full", "sliding_window_5", "chunked_local_8",
                             "hybrid_full_swa", "kernel_split_full_swa"]),
       perm_seed=st.integers(0, 2**16))
def test_permuting_physical_blocks_leaves_the_output_unchanged(name, perm_seed):
    run = make_run(name, num_blocks=40)
    run.add_request("a", BASE[:21])
    run.add_request("b", BASE[:13] + [1, 2, 3])
    run.step({"a": 21})
    step = run.step({"b": 16})                              # b hits part of a
    g = torch.Generator().manual_seed(perm_seed)
    for gb in step.groups:
        spec = run.specs[gb.group]
        cache = run.caches[gb.group]
        perm = torch.randperm(cache.shape[0], generator=g)      # block b -> perm[b]
        moved = torch.empty_like(cache)
        moved[perm] = cache
        table = perm[gb.block_table.long()]
        out = paged_attention(gb.query, moved, query_start_loc=step.query_start_loc,
                              seq_lens=step.seq_lens, block_table=table, scale=run.scale,
                              sliding_window=window_of(spec),
                              attention_chunk_size=chunk_of(spec))
        assert torch.equal(out, gb.output)


@settings(max_examples=20)
@given(name=config_names, length=st.integers(1, 40),
       chunks=st.lists(st.integers(1, 13), min_size=1, max_size=8))
def test_chunked_prefill_in_any_chunk_sizes_equals_one_prefill(name, length, chunks):
    prompt = BASE[:length]
    whole = make_run(name, num_blocks=40)
    whole.add_request("r", prompt)
    expected = whole.step({"r": length})
    chunked = make_run(name, num_blocks=40)
    chunked.add_request("r", prompt)
    outputs = [[] for _ in chunked.specs]
    i = 0
    while chunked.requests["r"].num_computed_tokens < length:
        step = chunked.step({"r": chunks[i % len(chunks)]})
        check_step(chunked, step)
        for gb in step.groups:
            outputs[gb.group].append(gb.output)
        i += 1
    # chunked-local attention skips the tokens of earlier chunks on a fresh request
    # (nothing later reads them): compare the positions both runs computed
    for gb in expected.groups:
        got = torch.cat(outputs[gb.group])
        torch.testing.assert_close(got, gb.output[-got.shape[0]:], atol=1e-5, rtol=0)


@settings(max_examples=20)
@given(name=config_names, shared=st.integers(1, 30), own=st.integers(1, 10),
       first_chunk=st.integers(1, 40))
def test_prefill_reusing_prefix_hit_blocks_equals_a_full_prefill(name, shared, own,
                                                                 first_chunk):
    prompt = BASE[:shared] + [49 - j for j in range(own)]
    cached = make_run(name, num_blocks=60)
    a = cached.add_request("a", BASE[:shared] + [1])
    while a.num_computed_tokens < a.num_tokens:
        cached.step({"a": first_chunk})
    cached.finish("a")
    cached.add_request("b", prompt)
    hit_step = cached.step({"b": 64})
    check_step(cached, hit_step)
    num_hit = cached.admissions[-1][1]
    event(f"prefix hit: {num_hit > 0}")

    fresh = make_run(name, num_blocks=60, enable_caching=False)
    fresh.add_request("b", prompt)
    full_step = fresh.step({"b": 64})
    assert fresh.admissions[-1] == ("b", 0)
    for hit_gb, full_gb in zip(hit_step.groups, full_step.groups):
        num_computed = hit_gb.output.shape[0]
        assert num_computed == len(prompt) - num_hit
        torch.testing.assert_close(hit_gb.output, full_gb.output[-num_computed:],
                                   atol=1e-5, rtol=0)
