"""Async scheduling, vLLM's full-sequence gate and its 1 + k padding, deferred frees.

The recorded vLLM traces (test_vllm_scheduler_traces.py) pin these down step by
step; the tests here check what the traces cannot show: that the async loop
really overlaps the runner with the scheduler, that a real model's greedy
tokens are unchanged under async scheduling (with transformers as the
reference), the LLM's defaults, and the deferred frees of a KV consumer, which
need a connector on vLLM's side.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
from kvref.engine import (AsyncEngineCore, AsyncScheduler, EngineCore, ModelFreeRunner,
                          NgramProposer, SamplingParams, Scheduler)
from kvref.entrypoints.llm import LLM, default_batch_limits
from kvref.verify.invariants import check_kv_cache_manager

from .hf_models import DEVICES, assert_matches_transformers, llama
from . import test_llm
from .test_llm import StepWatcher, make_llm, shared_prefix_prompts

VOCAB = 50


def manager(num_blocks: int, max_model_len: int = 64) -> KVCacheManager:
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=4,
                          hash_block_size=4, log_stats=True)


def run(core, requests, check=None):
    """Add (id, prompt, max_tokens) requests, step until done; check after each step."""
    made = {rid: core.scheduler.new_request(rid, prompt, SamplingParams(
        max_tokens=n, ignore_eos=True)) for rid, prompt, n in requests}
    while core.has_work():
        core.step()
        scheduler = core.scheduler
        check_kv_cache_manager(scheduler.kv_cache_manager,
                               popped_blocks=scheduler.deferred_blocks())
        if check:
            check(core)
    core.shutdown()
    return made


REQUESTS = [("a", list(range(1, 15)), 9), ("b", list(range(1, 9)) + [40, 41], 12),
            ("c", list(range(20, 27)), 5), ("d", list(range(1, 15)), 7)]


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("num_blocks", [10, 40])
def test_async_tokens_equal_the_sync_engine_and_the_reference(num_blocks, k):
    outputs = {}
    for cls, core_cls in [(Scheduler, EngineCore), (AsyncScheduler, AsyncEngineCore)]:
        drafter = NgramProposer(1, 3, k, 64) if k else None
        runner = ModelFreeRunner(VOCAB, drafter=drafter,
                                 async_scheduling=cls is AsyncScheduler)
        scheduler = cls(manager(num_blocks), max_num_batched_tokens=8, num_speculative_tokens=k)
        made = run(core_cls(scheduler, runner), REQUESTS)
        outputs[cls] = {rid: r.output_token_ids for rid, r in made.items()}
        for rid, prompt, n in REQUESTS:
            assert made[rid].output_token_ids == runner.reference_output(prompt, n)
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
        if num_blocks == 10:
            assert scheduler.stats.num_preemptions > 0          # the pool is tight
    assert outputs[Scheduler] == outputs[AsyncScheduler]


def test_the_async_loop_plans_the_next_step_while_the_runner_works():
    """Step 0's forward pass cannot finish until the scheduler has planned step 1:
    a loop that ran the two one after the other would never see the event (the
    wait would time out and the test fail)."""
    planned_step_1 = threading.Event()
    overlapped = []

    class SlowRunner(ModelFreeRunner):
        def execute_model(self, scheduler_output):
            if not overlapped:
                overlapped.append(planned_step_1.wait(timeout=30))
                overlapped.append(threading.current_thread() is not threading.main_thread())
            return super().execute_model(scheduler_output)

    scheduler = AsyncScheduler(manager(40), max_num_batched_tokens=8)
    schedule = scheduler.schedule

    def schedule_and_tell():
        output = schedule()
        if len(scheduler.step_records) == 2:
            planned_step_1.set()
        return output
    scheduler.schedule = schedule_and_tell
    made = run(AsyncEngineCore(scheduler, SlowRunner(VOCAB, async_scheduling=True)),
               [("a", [1, 2, 3], 4)])
    assert overlapped == [True, True]
    assert made["a"].output_token_ids == ModelFreeRunner(VOCAB).reference_output([1, 2, 3], 4)


def test_placeholders_count_the_token_in_flight_and_caching_waits_for_it():
    """One request, block size 4, prompt of 7: what the manager sees step by step."""
    scheduler = AsyncScheduler(manager(40), max_num_batched_tokens=16)
    core = AsyncEngineCore(scheduler, ModelFreeRunner(VOCAB, async_scheduling=True))
    req = scheduler.new_request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=4,
                                                                          ignore_eos=True))
    pool = scheduler.kv_cache_manager.block_pool

    def num_hashed():
        return sum(b.block_hash is not None
                   for b in scheduler.kv_cache_manager.get_blocks("a").blocks[0])
    seen = []
    while core.has_work():
        step = core.step()
        seen.append((step is None, req.num_computed_tokens, req.num_output_placeholders,
                     len(req.output_token_ids), num_hashed() if not req.is_finished() else None))
    core.shutdown()
    assert seen[:4] == [
        (True, 7, 1, 0, 1),      # prefill of 7 in flight: block 0 (tokens 0-3) cached
        (False, 8, 1, 1, 1),     # token 7 planned before it is known; then step 0 lands:
                                 # tokens 0-7 known, but 8 - 1 placeholder = 7: no block 1 yet
        (False, 9, 1, 2, 2),     # step 1 lands: 9 - 1 = 8 tokens known: block 1 cached
        (False, 10, 1, 3, 2),
    ]
    # max_tokens 4: the step that would make a 5th token is never scheduled.
    assert sum(len(r.num_scheduled_tokens) for r in scheduler.step_records) == 4
    assert pool.get_num_free_blocks() == 39


def test_a_kv_consumer_defers_the_frees_of_a_request_still_in_flight():
    """With two batches in flight a request preempted (or finished) while a step
    that writes its blocks runs gives them up at once (pop_blocks_for_free) but
    they return to the pool only when that step's output is processed."""
    sched = AsyncScheduler(manager(40), max_num_batched_tokens=16, kv_consumer=True)
    assert sched.defer_block_free
    assert not Scheduler(manager(40), 16, kv_consumer=True).defer_block_free   # one in flight
    runner = ModelFreeRunner(VOCAB, async_scheduling=True)
    core = AsyncEngineCore(sched, runner)
    req = sched.new_request("a", list(range(1, 10)), SamplingParams(max_tokens=6,
                                                                   ignore_eos=True))
    pool = sched.kv_cache_manager.block_pool
    assert core.step() is None                   # step 1 in flight (fence 1)
    held = [b.block_id for b in sched.kv_cache_manager.get_blocks("a").blocks[0]]
    free_before = pool.get_num_free_blocks()
    sched.finish_requests("a")                   # aborted while step 1 runs
    assert req.last_sched_seq == 1 > sched.processed_step_seq == 0
    assert [[b.block_id for b in blocks] for blocks in sched.deferred_blocks()] == [held]
    assert pool.get_num_free_blocks() == free_before          # not back yet
    check_kv_cache_manager(sched.kv_cache_manager, popped_blocks=sched.deferred_blocks())
    while core.has_work():
        core.step()
        check_kv_cache_manager(sched.kv_cache_manager, popped_blocks=sched.deferred_blocks())
    core.shutdown()
    assert sched.deferred_blocks() == [] and pool.get_num_free_blocks() == 39
    # Freed in reverse, as free() does: the cached full blocks join the tail last
    # block first, the partial (unhashed) last block goes to the head.
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    cached = [b for b in held if pool.blocks[b].block_hash is not None]
    assert cached == held[:2] and queue[-2:] == cached[::-1] and queue[0] == held[2]


def test_without_a_consumer_nothing_is_deferred():
    sched = AsyncScheduler(manager(40), max_num_batched_tokens=16)
    made = run(AsyncEngineCore(sched, ModelFreeRunner(VOCAB, async_scheduling=True)),
               REQUESTS)
    assert sched.sched_step_seq == 0 and not sched.deferred_frees
    assert all(r.is_finished() for r in made.values())


def test_the_gate_keeps_a_long_prompt_waiting_until_it_fits():
    """The issue's smallest case on the model-free engine: with the gate b waits for
    a; without it, b is prefilled 28 tokens over four steps and then preempted."""
    runs = {}
    for gate in (True, False):
        scheduler = Scheduler(manager(13, max_model_len=48), max_num_batched_tokens=8,
                              scheduler_reserve_full_isl=gate)
        run(EngineCore(scheduler, ModelFreeRunner(VOCAB)),
            [("a", list(range(100, 108)), 16), ("b", list(range(200, 240)), 2)])
        runs[gate] = scheduler
    with_gate, without = runs[True], runs[False]
    assert with_gate.stats.num_preemptions == 0
    assert with_gate.step_records[1].num_scheduled_tokens == {"a": 1}
    assert without.step_records[1].num_scheduled_tokens == {"a": 1, "b": 7}
    assert [r.step for r in without.step_records if r.preempted == ["b"]] == [5]
    assert sum(r.num_scheduled_tokens.get("b", 0) for r in without.step_records[:5]) == 28
    assert without.stats.prompt_tokens_computed > with_gate.stats.prompt_tokens_computed


def test_a_one_token_admission_is_padded_to_1_plus_k_with_minus_one_drafts():
    k = 3
    scheduler = Scheduler(manager(40), max_num_batched_tokens=16, num_speculative_tokens=k)
    runner = ModelFreeRunner(VOCAB, drafter=NgramProposer(1, 3, k, 64))
    core = EngineCore(scheduler, runner)
    scheduler.new_request("a", list(range(1, 10)), SamplingParams(max_tokens=8,
                                                                 ignore_eos=True))
    core.step()
    core.step()                                  # "a" decodes: the batch is all decodes
    # "b" repeats "a"'s prompt: 8 of its 9 tokens hit, one is left to compute.
    scheduler.new_request("b", list(range(1, 10)), SamplingParams(max_tokens=2,
                                                                 ignore_eos=True))
    step = core.step()
    out = step.scheduler_output
    assert out.num_scheduled_tokens["b"] == 1 + k
    assert out.scheduled_spec_decode_tokens["b"] == [-1] * k
    assert step.model_runner_output.sampled_token_ids[
        step.model_runner_output.req_id_to_index["b"]] == \
        runner.reference_output(list(range(1, 10)), 1)          # every -1 is rejected
    assert scheduler.requests["b"].num_computed_tokens == 9


def test_padding_that_does_not_fit_stops_admission():
    """1 + k over the remaining budget: vLLM does not admit the request unpadded."""
    k = 3
    scheduler = Scheduler(manager(40), max_num_batched_tokens=4, num_speculative_tokens=k)
    core = EngineCore(scheduler, ModelFreeRunner(VOCAB, drafter=NgramProposer(3, 3, k, 64)))
    scheduler.new_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    core.step()                                  # 4 of a's 5 prompt tokens
    core.step()                                  # the last one: a samples, no draft matched
    scheduler.new_request("b", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    step = core.step()
    # a decodes 1 token: 3 of the budget are left, enough for b's one token
    # (a hit of 4), not for 1 + k.
    assert step.scheduler_output.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_llm_defaults_are_vllms_cpu_ones():
    assert default_batch_limits("cpu") == (4096, 256)
    llm = LLM(llama(layers=1, heads=2, kv_heads=1, hidden_size=16, vocab_size=40),
              block_size=4, num_gpu_blocks=64, max_model_len=64)
    assert (llm.max_num_batched_tokens, llm.max_num_seqs) == (4096, 256)
    assert llm.scheduler.scheduler_reserve_full_isl and not llm.async_scheduling
    assert type(llm.engine_core) is EngineCore
    # A value left at its default is capped as vLLM caps it.
    llm = LLM(llama(layers=1, heads=2, kv_heads=1, hidden_size=16, vocab_size=40),
              block_size=4, num_gpu_blocks=64, max_model_len=64, max_num_seqs=2)
    assert llm.max_num_batched_tokens == 2 * 64


NGRAM_2 = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
           "prompt_lookup_max": 2}


def test_llm_refuses_async_scheduling_with_ngram_drafts_as_vllm_does():
    """vLLM 0.25.1's config refuses the pairing (``vllm/config/vllm.py:961-981``);
    left unset, async scheduling is off with n-gram drafts."""
    model = llama(layers=1, heads=2, kv_heads=1, hidden_size=32, vocab_size=40)
    with pytest.raises(ValueError, match="async_scheduling=True with speculative method "
                                         "'ngram': vLLM 0.25.1"):
        LLM(model, block_size=4, num_gpu_blocks=32, max_model_len=64,
            async_scheduling=True, speculative_config=NGRAM_2)
    llm = LLM(model, block_size=4, num_gpu_blocks=32, max_model_len=64,
              speculative_config=NGRAM_2)
    assert not llm.async_scheduling and type(llm.engine_core) is EngineCore


class DraftsUnderAsyncLLM(LLM):
    """An ``LLM`` without the config check above: the runner fills the async
    scheduler's ``-1`` draft placeholders as vLLM's GPU drafters do (EAGLE,
    ``ngram_gpu``), here with the CPU n-gram proposer's drafts. Only the tensors
    of that path are under test; vLLM would not be configured this way."""

    def _refuse_async_speculation(self, speculative_config: dict) -> None:
        return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("speculative", [False, True])
def test_llm_async_scheduling_matches_transformers_and_the_sync_engine(device, speculative,
                                                                      monkeypatch):
    model = llama(layers=2, heads=4, kv_heads=2, hidden_size=32, vocab_size=96)
    prompts = shared_prefix_prompts(model.config.vocab_size)
    spec = NGRAM_2 if speculative else None
    monkeypatch.setattr(test_llm, "LLM", DraftsUnderAsyncLLM)     # make_llm builds this one
    results = {}
    for async_scheduling in (False, True):
        llm, watcher = make_llm(model, device, num_gpu_blocks=30,
                                async_scheduling=async_scheduling, speculative_config=spec)
        assert isinstance(watcher, StepWatcher)             # invariants after every step
        assert type(llm.engine_core) is (AsyncEngineCore if async_scheduling else EngineCore)
        outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        llm.engine_core.shutdown()
        assert_matches_transformers(model, prompts, outputs, 8)
        assert llm.stats.num_preemptions > 0 and llm.stats.prompt_tokens_cached > 0
        results[async_scheduling] = [o.outputs[0].token_ids for o in outputs]
        if speculative:
            assert llm.stats.num_accepted_tokens > 0
    assert results[False] == results[True]
    assert torch.get_num_threads() == 1
