"""The scheduler's connector paths, one at a time, on a model-free engine.

Each test drives kvref's scheduler through the scripted connector
(``scripted_connector.py``: loads that land late or fail, producers that hold
their blocks) and checks one rule of vLLM 0.25.1's connector path as the
scheduler applies it (``vllm/v1/core/sched/scheduler.py``): a load is not
cached before it lands, it is admitted only beside what prefills in flight
still need, a whole-prompt load recomputes one token, a failed block sends the
request back to it or fails the request, a producer's blocks stay until sent,
an abort during a load waits for the load, and a consumer's frees wait for the
steps in flight. Greedy tokens are checked against the model-free runner's
own answer (``reference_output``), and every block is free at the end.
"""

from __future__ import annotations

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, RequestStatus
from kvref.engine import AsyncScheduler, ModelFreeRunner, SamplingParams
from kvref.outputs import ModelRunnerOutput
from kvref.verify.invariants import check_kv_cache_manager

from .scripted_connector import BLOCK, Script, engine, step_until_idle

RUNNER = ModelFreeRunner(vocab_size=90)


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def hashed_blocks(scheduler, req_id: str) -> list[bool]:
    blocks = scheduler.kv_cache_manager.get_blocks(req_id).blocks[0]
    return [b.block_hash is not None for b in blocks]


def assert_all_free(scheduler, num_blocks: int) -> None:
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    assert not scheduler.deferred_frees


def step(scheduler, core, n: int = 1) -> None:
    for _ in range(n):
        core.step()
        check_kv_cache_manager(scheduler.kv_cache_manager,
                               popped_blocks=scheduler.deferred_blocks())


def test_an_async_load_is_not_cached_before_it_lands():
    script = Script(answers={"d": [(16, True)]}, delay={"d": 3})
    scheduler, core = engine(script, num_blocks=16)
    d = scheduler.new_request("d", prompt(10, 16), params())
    for _ in range(3):
        step(scheduler, core)
        assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert hashed_blocks(scheduler, "d") == [False] * 4      # in flight: no hash
    step(scheduler, core)
    assert d.status == RequestStatus.RUNNING and hashed_blocks(scheduler, "d") == [True] * 4
    step_until_idle(scheduler, core)
    assert d.output_token_ids == RUNNER.reference_output(prompt(10, 16), 3)
    assert_all_free(scheduler, 16)


def test_a_whole_prompt_load_recomputes_only_the_last_prompt_token():
    script = Script(answers={"d": [(16, True)]})
    scheduler, core = engine(script, num_blocks=16)
    scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    admitted = next(r for r in scheduler.step_records if "d" in r.num_scheduled_tokens)
    assert admitted.num_scheduled_tokens == {"d": 1}
    assert scheduler.stats.prompt_tokens_computed == 1
    assert scheduler.stats.prompt_tokens_external == 15
    assert_all_free(scheduler, 16)


def test_a_load_waits_while_the_prefill_in_flight_needs_the_room():
    """P's 40-token prompt is prefilled 8 tokens a step into a 12-block pool;
    d's 4-block load would fit the free blocks but not beside the 8 more P will
    take (reserved_blocks), so d's load starts only after P's prefill ends, and
    nobody is preempted."""
    script = Script(answers={"d": [(16, True)]})
    scheduler, core = engine(script, num_blocks=13, budget=16, chunk=8)
    p = scheduler.new_request("p", prompt(100, 40), params(2))
    scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    load_started = next(r.step for r in scheduler.step_records if "d" in r.prefix_hit_tokens)
    prefill_done = next(r.step for r in scheduler.step_records
                        if sum(x.num_scheduled_tokens.get("p", 0)
                               for x in scheduler.step_records[:r.step + 1]) >= 40)
    assert load_started > prefill_done
    assert scheduler.stats.num_preemptions == 0 and p.status.name == "FINISHED_LENGTH_CAPPED"
    assert_all_free(scheduler, 13)


def test_a_producer_holds_its_blocks_until_they_are_sent():
    script = Script(hold={"a": 3})
    scheduler, core = engine(script, num_blocks=16, role="kv_producer")
    a = scheduler.new_request("a", prompt(10, 12), params(1))
    pool = scheduler.kv_cache_manager.block_pool
    step(scheduler, core)
    assert a.is_finished() and a.kv_transfer_params_out is not None
    held = scheduler.kv_cache_manager.get_blocks("a").blocks[0]
    assert len(held) == 3 and pool.get_num_free_blocks() == 15 - 3   # still held
    steps = 0
    while core.has_work():
        assert scheduler.has_requests()              # the engine keeps stepping for it
        step(scheduler, core)
        steps += 1
    assert steps >= 2 and "a" not in scheduler.requests
    assert_all_free(scheduler, 16)


def test_recompute_goes_back_to_the_first_failed_block():
    script = Script(answers={"d": [(16, True)]}, fail_from={"d": 2})
    scheduler, core = engine(script, num_blocks=16)
    d = scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    admitted = next(r for r in scheduler.step_records if "d" in r.num_scheduled_tokens)
    assert admitted.num_scheduled_tokens == {"d": 8}             # blocks 2-3 computed here
    assert scheduler.stats.prompt_tokens_external == 8 and scheduler.stats.num_kv_load_failures == 1
    assert d.output_token_ids == RUNNER.reference_output(prompt(10, 16), 3)
    assert_all_free(scheduler, 16)


def test_fail_finishes_the_request_with_an_error_and_no_token():
    script = Script(answers={"d": [(16, True)]}, fail_from={"d": 2})
    scheduler, core = engine(script, num_blocks=16, policy="fail")
    d = scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    assert d.status == RequestStatus.FINISHED_ERROR and d.output_token_ids == []
    assert_all_free(scheduler, 16)


def test_a_failed_sync_load_under_fail_leaves_nothing_to_hit_after_the_failed_block():
    """A synchronous load's blocks are cached when allocated; under "fail" the
    failed block and those after it are evicted, so a later identical prompt
    hits only block 0."""
    script = Script(answers={"d": [(12, False)], "e": [(0, False)]}, fail_from={"d": 1})
    scheduler, core = engine(script, num_blocks=16, policy="fail")
    d = scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    assert d.status == RequestStatus.FINISHED_ERROR
    scheduler.new_request("e", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    assert next(r.prefix_hit_tokens["e"] for r in scheduler.step_records
                if "e" in r.prefix_hit_tokens) == 4
    assert_all_free(scheduler, 16)


def test_a_failed_sync_load_is_recomputed_from_the_failed_block():
    script = Script(answers={"d": [(12, False)]}, fail_from={"d": 1})
    scheduler, core = engine(script, num_blocks=16)
    d = scheduler.new_request("d", prompt(10, 16), params())
    step_until_idle(scheduler, core)
    assert scheduler.stats.num_kv_load_failures == 1
    assert [r.num_scheduled_tokens.get("d") for r in scheduler.step_records[:2]] == [4, 12]
    assert d.output_token_ids == RUNNER.reference_output(prompt(10, 16), 3)
    assert_all_free(scheduler, 16)


def test_an_abort_during_a_load_frees_the_blocks_when_the_load_ends():
    script = Script(answers={"d": [(16, True)]}, delay={"d": 4})
    scheduler, core = engine(script, num_blocks=16)
    scheduler.new_request("d", prompt(10, 16), params())
    pool = scheduler.kv_cache_manager.block_pool
    step(scheduler, core)
    scheduler.finish_requests("d")
    for _ in range(2):                           # the load still writes into them
        assert pool.get_num_free_blocks() == 15 - 4 and scheduler.has_requests()
        step(scheduler, core)
    step_until_idle(scheduler, core)
    assert_all_free(scheduler, 16)


def test_a_consumer_free_waits_for_its_step_even_across_empty_steps():
    """Async scheduling, a consumer: a is aborted while a step writing it runs,
    and the steps that follow schedule nothing (d's load is in flight); a's
    blocks come back once that step is processed, and every block at the end."""
    script = Script(answers={"a": [(0, False)], "d": [(16, True)]}, delay={"d": 6})
    scheduler, core = engine(script, num_blocks=24, async_scheduling=True,
                             model_free_runner=True)
    a = scheduler.new_request("a", prompt(200, 10), params(20))
    scheduler.new_request("d", prompt(10, 16), params())
    pool = scheduler.kv_cache_manager.block_pool
    while not (a.status == RequestStatus.RUNNING and core.batch_queue):
        step(scheduler, core)
    in_flight = [out for _, out in core.batch_queue if "a" in out.num_scheduled_tokens]
    held = len(scheduler.kv_cache_manager.get_blocks("a").blocks[0])
    free_before = pool.get_num_free_blocks()
    scheduler.finish_requests("a")
    assert in_flight and pool.get_num_free_blocks() == free_before
    while any(out is o for _, o in core.batch_queue for out in in_flight):
        assert pool.get_num_free_blocks() <= free_before          # not back while in flight
        step(scheduler, core)
    for _ in range(3):
        step(scheduler, core)
    assert not scheduler.deferred_frees and pool.get_num_free_blocks() >= free_before + held - 4
    step_until_idle(scheduler, core)
    core.shutdown()
    assert_all_free(scheduler, 24)


def test_async_scheduling_caches_only_tokens_it_knows():
    """Under async scheduling a block is hashed only once all its token ids are
    known, after every step, with n-gram-free decoding of 14 tokens."""
    scheduler, core = engine(Script(), num_blocks=24, async_scheduling=True,
                             model_free_runner=True)
    r = scheduler.new_request("r", prompt(30, 6), params(14))
    while core.has_work():
        step(scheduler, core)
        if not r.is_finished():
            assert sum(hashed_blocks(scheduler, "r")) * 4 <= r.num_tokens
    core.shutdown()
    assert r.output_token_ids == RUNNER.reference_output(prompt(30, 6), 14)
    assert_all_free(scheduler, 24)


def test_async_scheduling_with_chunked_prompts_keeps_the_tokens():
    scheduler, core = engine(Script(), num_blocks=24, async_scheduling=True,
                             model_free_runner=True, chunk=4, budget=8)
    made = {i: scheduler.new_request(str(i), prompt(40 * i, 9 + i), params(5)) for i in range(3)}
    step_until_idle(scheduler, core)
    core.shutdown()
    for i, r in made.items():
        assert r.output_token_ids == RUNNER.reference_output(prompt(40 * i, 9 + i), 5)
        assert r.num_output_placeholders == 0
    assert_all_free(scheduler, 24)


def test_a_deferred_free_waits_for_the_last_step_that_wrote_the_blocks():
    """The fence is the last step scheduled when the request was freed, whatever
    the number of steps in flight: planned twice (steps 1 and 2 both write a's
    blocks), aborted, a's blocks stay parked after step 1's output and return
    only after step 2's (vLLM's ``_drain_deferred_frees``: fence <= processed).
    Driven by hand, as a loop with a deeper batch queue would drive it."""
    config = KVCacheConfig(24, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK)
    scheduler = AsyncScheduler(manager, max_num_batched_tokens=64, kv_consumer=True)
    runner = ModelFreeRunner(vocab_size=90, async_scheduling=True)
    scheduler.new_request("a", prompt(10, 10), params(8))
    first = scheduler.schedule()
    first_output = runner.execute_model(first)
    second = scheduler.schedule()
    second_output = runner.execute_model(second)
    assert "a" in first.num_scheduled_tokens and "a" in second.num_scheduled_tokens
    pool = manager.block_pool
    free_before = pool.get_num_free_blocks()
    held = len(manager.get_blocks("a").blocks[0])
    scheduler.finish_requests("a")
    scheduler.update_from_output(first, first_output)
    assert pool.get_num_free_blocks() == free_before      # step 2 still writes them
    assert [len(b) for b in scheduler.deferred_blocks()] == [held]
    scheduler.update_from_output(second, second_output)
    assert pool.get_num_free_blocks() == free_before + held and not scheduler.deferred_frees


def test_async_placeholders_follow_the_tokens_each_step_keeps():
    """Async scheduling with 2 drafts a step, every draft accepted: each step in
    flight holds 1 + 2 placeholders, and a step's output gives back one per
    token kept, so after every update the placeholders are exactly those of the
    steps still in flight. Driven by hand with two steps in flight and a worker
    that accepts every draft (the model-free runner's tokens almost never match
    an n-gram draft)."""
    config = KVCacheConfig(24, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK)
    scheduler = AsyncScheduler(manager, max_num_batched_tokens=64, num_speculative_tokens=2)
    r = scheduler.new_request("r", prompt(10, 6), params(12))

    def accept_all(out):
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[i].is_prefill_chunk else
                   [7] * (1 + len(out.scheduled_spec_decode_tokens.get(i, ()))) for i in ids]
        return ModelRunnerOutput(ids, {i: n for n, i in enumerate(ids)}, sampled)

    in_flight: list = []
    updates = 0
    for _ in range(40):
        if not (scheduler.has_requests() or in_flight):
            break
        if scheduler.has_requests():
            out = scheduler.schedule()
            in_flight.insert(0, (out, accept_all(out)))
            if len(in_flight) < 2:
                continue
        out, model_output = in_flight.pop()
        scheduler.update_from_output(out, model_output)
        updates += 1
        if not r.is_finished():
            expected = sum(len(mo.sampled_token_ids[mo.req_id_to_index["r"]])
                           for _, mo in in_flight if "r" in mo.req_id_to_index)
            assert r.num_output_placeholders == expected, updates
    assert r.is_finished() and len(r.output_token_ids) == 12
    assert scheduler.stats.num_accepted_tokens > 0
