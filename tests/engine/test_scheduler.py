"""The scheduler, driven by the model-free runner (no torch, no model).

The model-free runner's next token is a hash of a request's tokens so far, so a
request must produce ``runner.reference_output(prompt)`` however the scheduler
batches, chunks, caches and preempts it. Every test checks the manager's
invariants after every step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RequestStatus,
    SlidingWindowSpec,
)
from kvref.engine import EngineRequest, ModelFreeRunner, SamplingParams, Scheduler, engine_step
from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.verify.invariants import check_kv_cache_manager

from .limits import Limits, watch_limits

VOCAB = 97


def make_manager(num_blocks: int, block_size: int = 4, max_model_len: int = 64,
                 watermark: float = 0.0, sliding_window: int | None = None,
                 enable_caching: bool = True, max_num_batched_tokens: int | None = None
                 ) -> KVCacheManager:
    groups = [KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size))]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(block_size, sliding_window)))
    config = KVCacheConfig(num_blocks, groups)
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_caching=enable_caching,
                          watermark=watermark, max_num_batched_tokens=max_num_batched_tokens,
                          log_stats=True)


def run_to_completion(scheduler: Scheduler, runner: ModelFreeRunner,
                      arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = None,
                      max_steps: int = 500) -> dict[str, EngineRequest]:
    """Step until done, adding ``arrivals[step]`` before each step; check invariants.
    Returns the requests that arrived, by id."""
    arrivals = arrivals or {}
    arrived: dict[str, EngineRequest] = {}
    step = 0
    while scheduler.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            arrived[request_id] = scheduler.new_request(request_id, prompt, params)
        if scheduler.has_unfinished_requests():
            engine_step(scheduler, runner)
        check_kv_cache_manager(scheduler.kv_cache_manager)   # every invariant of specs/
        step += 1
        assert step < max_steps, "the scheduler made no progress"
    return arrived


def test_chunked_prefill_splits_a_prompt_over_the_token_budget():
    scheduler = Scheduler(make_manager(32), max_num_batched_tokens=6)
    runner = ModelFreeRunner(VOCAB)
    req = scheduler.new_request("a", list(range(14)), SamplingParams(max_tokens=2))
    run_to_completion(scheduler, runner)
    assert [r.num_scheduled_tokens["a"] for r in scheduler.step_records] == [6, 6, 2, 1]
    assert req.output_token_ids == runner.reference_output(list(range(14)), 2)


def test_running_requests_go_first_and_new_ones_fill_the_budget():
    scheduler = Scheduler(make_manager(64), max_num_batched_tokens=10)
    runner = ModelFreeRunner(VOCAB)
    scheduler.new_request("a", list(range(8)), SamplingParams(max_tokens=4))
    engine_step(scheduler, runner)
    scheduler.new_request("b", list(range(20, 40)), SamplingParams(max_tokens=4))
    engine_step(scheduler, runner)
    # "a" decodes one token, "b" gets the remaining 9 of the budget.
    assert scheduler.step_records[1].num_scheduled_tokens == {"a": 1, "b": 9}
    assert scheduler.step_records[1].admitted == ["b"]


def test_long_prefill_token_threshold_caps_each_request():
    scheduler = Scheduler(make_manager(64), max_num_batched_tokens=32,
                          long_prefill_token_threshold=5)
    runner = ModelFreeRunner(VOCAB)
    scheduler.new_request("a", list(range(12)), SamplingParams(max_tokens=1))
    scheduler.new_request("b", list(range(12)), SamplingParams(max_tokens=1))
    engine_step(scheduler, runner)
    # allocate_slots caches a's full blocks as soon as they are scheduled, so
    # "b", admitted right after in the same step, already hits a's first block.
    first = scheduler.step_records[0]
    assert first.num_scheduled_tokens["a"] == 5
    assert first.num_scheduled_tokens["b"] == 5
    assert first.prefix_hit_tokens == {"a": 0, "b": 4}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    scheduler = Scheduler(make_manager(64), max_num_batched_tokens=10,
                          enable_chunked_prefill=False)
    runner = ModelFreeRunner(VOCAB)
    scheduler.new_request("a", list(range(6)), SamplingParams(max_tokens=3))
    scheduler.new_request("b", list(range(30, 38)), SamplingParams(max_tokens=1))
    engine_step(scheduler, runner)
    assert scheduler.step_records[0].num_scheduled_tokens == {"a": 6}
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_max_num_seqs_bounds_the_running_requests():
    scheduler = Scheduler(make_manager(64), max_num_batched_tokens=64, max_num_seqs=2)
    runner = ModelFreeRunner(VOCAB)
    for i in range(4):
        scheduler.new_request(f"r{i}", [i + 1] * 3, SamplingParams(max_tokens=3))
    engine_step(scheduler, runner)
    assert scheduler.step_records[0].admitted == ["r0", "r1"]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    run_to_completion(scheduler, runner)
    assert max(r.num_running for r in scheduler.step_records) == 2


def test_shared_prefix_is_served_from_the_cache():
    scheduler = Scheduler(make_manager(64), max_num_batched_tokens=64)
    runner = ModelFreeRunner(VOCAB)
    prefix = list(range(1, 13))                       # 3 full blocks of 4
    scheduler.new_request("a", prefix + [50, 51], SamplingParams(max_tokens=2))
    engine_step(scheduler, runner)
    b = scheduler.new_request("b", prefix + [60, 61, 62], SamplingParams(max_tokens=2))
    run_to_completion(scheduler, runner)
    assert scheduler.step_records[1].prefix_hit_tokens == {"b": 12}
    assert b.num_cached_tokens == 12
    assert b.output_token_ids == runner.reference_output(prefix + [60, 61, 62], 2)
    assert scheduler.stats.prompt_tokens_cached == 12
    assert scheduler.stats.prompt_tokens_computed == 14 + 15 - 12


def test_num_cached_tokens_is_the_last_admission_before_the_first_token():
    # vLLM reports the hit of the request's PrefillStats, which every admission
    # overwrites until the first output token is out. "a" (16 tokens, prefilled
    # 4 at a time) is preempted by "b"'s decodes twice before it samples. (That
    # takes admitting "a" before its whole sequence fits: the gate is off.)
    scheduler = Scheduler(make_manager(7), max_num_batched_tokens=4,
                          scheduler_reserve_full_isl=False)
    runner = ModelFreeRunner(VOCAB)
    scheduler.new_request("b", list(range(1, 8)), SamplingParams(max_tokens=12,
                                                                 ignore_eos=True))
    a = scheduler.new_request("a", list(range(20, 36)), SamplingParams(max_tokens=2,
                                                                       ignore_eos=True))
    admissions = []                      # (hit, output tokens a had when admitted)
    while scheduler.has_unfinished_requests():
        num_outputs = len(a.output_token_ids)
        engine_step(scheduler, runner)
        check_kv_cache_manager(scheduler.kv_cache_manager)
        if "a" in scheduler.step_records[-1].prefix_hit_tokens:
            admissions.append((scheduler.step_records[-1].prefix_hit_tokens["a"], num_outputs))
    assert admissions == [(0, 0), (8, 0), (4, 0)]
    assert a.num_cached_tokens == 4
    assert a.output_token_ids == runner.reference_output(list(range(20, 36)), 2)


def test_a_full_pool_preempts_the_last_admitted_request_back_to_the_front_of_the_queue():
    # 5 usable blocks of 4 tokens (block 0 is the null block).
    scheduler = Scheduler(make_manager(6), max_num_batched_tokens=64)
    runner = ModelFreeRunner(VOCAB)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = scheduler.new_request("a", list(range(1, 9)), params)       # 2 blocks
    b = scheduler.new_request("b", list(range(20, 28)), params)     # 2 blocks
    c = scheduler.new_request("c", list(range(40, 44)), params)     # 1 block
    engine_step(scheduler, runner)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    engine_step(scheduler, runner)
    # "a" needs a 3rd block: the last-admitted, "c", goes; then "b" needs one and
    # is itself the last-admitted left, so it goes too. "a" keeps running.
    record = scheduler.step_records[1]
    assert record.preempted == ["c", "b"]
    assert record.num_scheduled_tokens == {"a": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert list(scheduler.waiting) == [b, c]        # each went to the front
    assert record.admitted == [] and record.resumed == []   # nothing admitted this step
    run_to_completion(scheduler, runner)
    for req, prompt in ((a, range(1, 9)), (b, range(20, 28)), (c, range(40, 44))):
        assert req.output_token_ids == runner.reference_output(list(prompt), 8)
    assert scheduler.stats.num_preemptions >= 1
    assert any(r.resumed == ["c"] for r in scheduler.step_records)


def test_a_request_that_is_itself_the_last_admitted_preempts_itself():
    scheduler = Scheduler(make_manager(5), max_num_batched_tokens=64)
    runner = ModelFreeRunner(VOCAB)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    scheduler.new_request("a", list(range(1, 7)), params)     # 2 blocks, room to grow
    b = scheduler.new_request("b", list(range(20, 28)), params)  # 2 blocks, full
    engine_step(scheduler, runner)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    engine_step(scheduler, runner)
    # "a" decodes inside its second block; "b" needs a new one and is the last admitted.
    assert scheduler.step_records[1].num_scheduled_tokens == {"a": 1}
    assert scheduler.step_records[1].preempted == ["b"]
    assert b.status == RequestStatus.PREEMPTED
    run_to_completion(scheduler, runner)
    assert b.output_token_ids == runner.reference_output(list(range(20, 28)), 6)


def test_the_watermark_keeps_new_requests_out_of_the_last_free_blocks():
    def admitted_second(watermark: float) -> bool:
        scheduler = Scheduler(make_manager(10, watermark=watermark), max_num_batched_tokens=64)
        runner = ModelFreeRunner(VOCAB)
        scheduler.new_request("a", list(range(1, 13)), SamplingParams(max_tokens=1))  # 3 blocks
        scheduler.new_request("b", list(range(20, 36)), SamplingParams(max_tokens=1))  # 4 blocks
        engine_step(scheduler, runner)
        return "b" in scheduler.step_records[0].admitted

    assert admitted_second(0.0)          # 9 free: 3 + 4 fit
    assert not admitted_second(0.3)      # 3 watermark blocks: 6 - 4 < 3


def test_eos_stops_a_request_unless_ignore_eos():
    runner = ModelFreeRunner(VOCAB)
    prompt = [5, 6, 7]
    expected = runner.reference_output(prompt, 6)
    eos = expected[2]
    for ignore_eos, length in ((False, expected.index(eos) + 1), (True, 6)):
        scheduler = Scheduler(make_manager(16), max_num_batched_tokens=16, eos_token_id=eos)
        req = scheduler.new_request("a", prompt, SamplingParams(max_tokens=6,
                                                                ignore_eos=ignore_eos))
        run_to_completion(scheduler, ModelFreeRunner(VOCAB))
        assert req.output_token_ids == expected[:length]
        assert req.get_finished_reason() == ("length" if ignore_eos else "stop")


def test_finished_and_aborted_requests_free_their_blocks():
    manager = make_manager(16)
    scheduler = Scheduler(manager, max_num_batched_tokens=16)
    runner = ModelFreeRunner(VOCAB)
    scheduler.new_request("a", list(range(10)), SamplingParams(max_tokens=2))
    scheduler.new_request("b", list(range(30, 40)), SamplingParams(max_tokens=50))
    engine_step(scheduler, runner)
    scheduler.finish_requests("b")
    assert "b" not in scheduler.requests
    run_to_completion(scheduler, runner)
    assert manager.block_pool.get_num_free_blocks() == 15       # all but the null block
    check_kv_cache_manager(manager)


def test_sliding_window_blocks_become_null_blocks_as_the_window_moves():
    manager = make_manager(32, sliding_window=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=8)
    runner = ModelFreeRunner(VOCAB)
    req = scheduler.new_request("a", list(range(1, 17)), SamplingParams(max_tokens=3))
    engine_step(scheduler, runner)
    engine_step(scheduler, runner)
    full, window = manager.get_blocks("a").blocks
    assert not any(b.is_null for b in full)
    assert any(b.is_null for b in window)
    run_to_completion(scheduler, runner)
    assert req.output_token_ids == runner.reference_output(list(range(1, 17)), 3)


def test_ngram_drafts_are_verified_and_rejected_ones_rolled_back():
    # A 3-token vocabulary makes the hash "model" repeat itself, so drafts often hit.
    manager = make_manager(40, max_model_len=64)
    scheduler = Scheduler(manager, max_num_batched_tokens=16)
    runner = ModelFreeRunner(vocab_size=3, drafter=NgramProposer(2, 3, 4, max_model_len=64))
    prompts = {f"r{i}": [(i * 7 + j) % 3 for j in range(5 + i)] for i in range(4)}
    arrivals = {0: [(rid, p, SamplingParams(max_tokens=24, ignore_eos=True))
                    for rid, p in prompts.items()]}
    requests = run_to_completion(scheduler, runner, arrivals)
    for rid, prompt in prompts.items():
        assert requests[rid].output_token_ids == ModelFreeRunner(3).reference_output(prompt, 24)
    stats = scheduler.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens    # some of each
    # Steps that decoded more than one token per request: accepted drafts at work.
    assert stats.num_steps < 24 + 1


def test_a_draft_is_cut_to_the_token_budget():
    manager = make_manager(40)
    scheduler = Scheduler(manager, max_num_batched_tokens=3)
    runner = ModelFreeRunner(VOCAB)
    req = scheduler.new_request("a", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    engine_step(scheduler, runner)
    scheduler.update_draft_token_ids({"a": [9, 9, 9, 9]})
    output = scheduler.schedule()
    # 1 real token + 2 of the 4 drafts fill the budget of 3.
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.scheduled_spec_decode_tokens == {"a": [9, 9]}
    assert req.spec_token_ids == []


EXERCISED = {"preemptions": 0, "cached": 0, "chunks": 0, "later_chunks": 0, "drafts": 0,
             "max_model_len": 0}


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(data=st.data(),
       num_blocks=st.integers(8, 24),
       block_size=st.sampled_from([2, 3, 4, 4, 5]),
       trim=st.integers(0, 3),
       budget=st.integers(4, 24),
       max_num_seqs=st.integers(1, 6),
       sliding_window=st.sampled_from([None, 3, 6]),
       threshold=st.sampled_from([0, 0, 5]),
       chunked=st.sampled_from([True, True, True, False]),
       speculate=st.booleans())
def test_any_workload_generates_what_the_model_alone_generates(
        data, num_blocks, block_size, trim, budget, max_num_seqs, sliding_window, threshold,
        chunked, speculate):
    # One request always fits; max_model_len is rarely a multiple of the block size.
    max_model_len = max(8, (num_blocks - 1) * block_size // 2 - trim)
    if not chunked:
        budget, threshold = max(budget, max_model_len), 0
    manager = make_manager(num_blocks, block_size, max_model_len=max_model_len,
                           sliding_window=sliding_window, max_num_batched_tokens=budget)
    scheduler = Scheduler(manager, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          long_prefill_token_threshold=threshold,
                          enable_chunked_prefill=chunked)
    limits = watch_limits(scheduler, Limits(
        budget=budget, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold, enable_chunked_prefill=chunked,
        num_speculative_tokens=3))
    # A 3-token vocabulary makes the hash "model" repeat itself: drafts hit.
    vocab = 3 if speculate else VOCAB
    runner = ModelFreeRunner(vocab, drafter=NgramProposer(1, 3, 3, max_model_len)
                             if speculate else None)
    prefixes = [[], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 6]
    arrivals: dict[int, list] = {}
    expected: dict[str, list[int]] = {}
    for i in range(data.draw(st.integers(1, 7), label="num_requests")):
        prefix = data.draw(st.sampled_from(prefixes), label="prefix")
        tail = data.draw(st.lists(st.integers(10, VOCAB - 1), min_size=1, max_size=12))
        prompt = (prefix + tail)[: max_model_len - 2]
        max_tokens = data.draw(st.integers(1, max_model_len - len(prompt)), label="max_tokens")
        step = data.draw(st.integers(0, 6), label="arrival_step")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        arrivals.setdefault(step, []).append((f"r{i}", prompt, params))
        expected[f"r{i}"] = runner.reference_output(prompt, max_tokens)
    requests = run_to_completion(scheduler, runner, arrivals)
    assert {rid: r.output_token_ids for rid, r in requests.items()} == expected
    assert all(r.is_finished() for r in requests.values())
    EXERCISED["preemptions"] += scheduler.stats.num_preemptions
    EXERCISED["cached"] += scheduler.stats.prompt_tokens_cached
    EXERCISED["chunks"] += sum(1 for r in scheduler.step_records
                               for rid, n in r.num_scheduled_tokens.items() if n > 1
                               and rid not in r.sampled)
    EXERCISED["later_chunks"] += limits.chunks_checked
    EXERCISED["drafts"] += scheduler.stats.num_accepted_tokens
    EXERCISED["max_model_len"] += limits.max_position_reached == max_model_len - 1
    assert manager.block_pool.get_num_free_blocks() == num_blocks - 1


def test_the_drawn_workloads_preempt_hit_the_cache_and_chunk():
    """Runs after the property above (file order): its workloads were not all easy
    (they preempted, hit the cache, cut prompts into chunks and checked the
    later ones against every limit, accepted drafts, reached max_model_len)."""
    if not all(EXERCISED.values()):
        test_any_workload_generates_what_the_model_alone_generates()
    assert all(count > 0 for count in EXERCISED.values()), EXERCISED
