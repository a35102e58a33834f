"""Three ways vLLM 0.25.1's scheduler stalls with a KV connector, reproduced on kvref's.

kvref's scheduler mirrors vLLM 0.25.1's, defects included, so these states
are reachable in kvref exactly as in vLLM (they were found by running vLLM's
own ``Scheduler`` and ``AsyncScheduler`` on CPU with a deterministic simulated
connector, side by side with kvref's; ``specs/scheduler.md``, "Stalls with a KV
connector", has the mechanism and the upstream reports). Each test drives a
model-free engine through a ``ScriptedConnector`` that answers
``get_num_new_matched_tokens`` from a script and lands or fails loads as
scripted, and shows what a user sees: an engine that steps and steps with work
queued, schedules nothing, and never ends (``has_requests()`` stays true) until
a request is aborted. Line numbers are ``vllm/v1/core/sched/scheduler.py``.

If one of these tests fails, kvref no longer reproduces vLLM 0.25.1 there: a
fix belongs in a later vLLM first (the replay of recorded vLLM runs,
``test_vllm_scheduler_traces.py``, would then diverge too).
"""

from __future__ import annotations

from kvref import RequestStatus
from kvref.engine import SamplingParams

from .scripted_connector import Script, engine, step_until_idle


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_stall_3_head_of_line_block_in_skipped_waiting():
    """y is told "ask again" and waits in skipped_waiting ahead of x; x's load is
    admitted, takes most of the pool and lands; y's own load never fits while x
    holds it, and the waiting loop stops at y (scheduler.py:917-925) before it
    reaches x (skipped_waiting is taken first, :1869). Upstream: vllm#45388."""
    script = Script(answers={"y": [(None, False), (20, True)], "x": [(28, True)]})
    scheduler, core = engine(script, num_blocks=11)               # 10 usable blocks
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    scheduler.new_request("y", prompt(100, 20), params)           # 5 blocks
    scheduler.new_request("x", prompt(200, 28), params)           # 7 blocks
    active = step_until_idle(scheduler, core)
    records = scheduler.step_records
    x = scheduler.requests["x"]
    # What a user sees: the engine steps, nothing is scheduled, nothing ends.
    assert active == 0 and all(r.num_scheduled_tokens == {} for r in records)
    assert scheduler.has_requests() and not scheduler.running
    assert [r.request_id for r in scheduler.skipped_waiting] == ["y", "x"]
    # x's load landed long ago: it is promotable, but never looked at.
    assert x.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "x" in scheduler.finished_recving_kv_req_ids
    assert len(scheduler.kv_cache_manager.get_blocks("x").blocks[0]) == 7
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 3
    assert script.asked.count("y") == len(records) and script.asked.count("x") == 1
    # Aborting y unblocks the line: x runs (its last prompt token) and finishes.
    scheduler.finish_requests("y")
    assert step_until_idle(scheduler, core) > 0 and not scheduler.has_requests()
    assert x.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(x.output_token_ids) == 3


def test_stall_4_ghost_reservation_after_a_fully_failed_async_load():
    """A load fails in its first block under "recompute": its blocks are freed
    (scheduler.py:2426) but the request stays in _inflight_prefills. Asked again
    in the same pass, its new asynchronous load is gated by reserved_blocks
    (:901), which now counts its own whole sequence: 10 needed + 10 reserved
    against itself > 15 free, in an idle engine, every step."""
    script = Script(answers={"r": [(40, True)]}, fail_from={"r": 0})
    scheduler, core = engine(script, num_blocks=16)               # 15 usable blocks
    r = scheduler.new_request("r", prompt(300, 40), SamplingParams(max_tokens=2,
                                                                  ignore_eos=True))
    active = step_until_idle(scheduler, core)
    pool = scheduler.kv_cache_manager.block_pool
    assert active == 0 and scheduler.has_requests() and not scheduler.running
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    assert pool.get_num_free_blocks() == 15                       # it holds nothing
    assert r in scheduler._inflight_prefills                      # the ghost
    assert scheduler._inflight_prefill_reserved_blocks() == 10    # against itself
    assert scheduler.stats.num_kv_load_failures == 1
    assert script.asked.count("r") == len(scheduler.step_records)       # asked every step
    # An abort is the only way out; nothing leaks.
    scheduler.finish_requests("r")
    step_until_idle(scheduler, core)
    assert not scheduler.has_requests() and pool.get_num_free_blocks() == 15


def test_without_the_ghost_the_same_retry_fits():
    """The control for stall 4: the same request, the same retried load, but the
    first load fails from its second block (so the request keeps one block and
    is not freed): the retry is not gated, and the request finishes."""
    script = Script(answers={"r": [(40, True)]}, fail_from={"r": 1})
    scheduler, core = engine(script, num_blocks=16)
    r = scheduler.new_request("r", prompt(300, 40), SamplingParams(max_tokens=2,
                                                                  ignore_eos=True))
    step_until_idle(scheduler, core)
    assert not scheduler.has_requests() and r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stall_5_leaked_output_placeholder_after_a_failed_sync_load():
    """Async scheduling, a synchronous load that fails under "recompute":
    update_from_output skips the request (scheduler.py:1564), so the async
    scheduler never releases the placeholder of the token sampled in that step.
    One placeholder too many, num_computed_tokens one ahead: the request reaches
    num_computed_tokens = max_model_len - 1 a token early, and from then on is
    scheduled 0 tokens. Upstream: vllm#45138, #49250."""
    max_model_len = 32
    script = Script(answers={"r": [(8, False)]}, fail_from={"r": 0})
    scheduler, core = engine(script, num_blocks=16, async_scheduling=True,
                             max_model_len=max_model_len)
    r = scheduler.new_request("r", prompt(400, 12), SamplingParams(max_tokens=100,
                                                                  ignore_eos=True))
    active = step_until_idle(scheduler, core)
    assert active > 0 and scheduler.stats.num_kv_load_failures == 1
    # What a user sees: r stopped generating short of max_model_len and never ends.
    assert scheduler.has_requests() and scheduler.running == [r]
    assert r.status == RequestStatus.RUNNING
    assert r.num_tokens == max_model_len - 1                      # one token short of the cap
    assert r.num_output_placeholders == 1                         # none is in flight
    assert r.num_computed_tokens == max_model_len - 1             # one ahead of num_tokens - 1
    assert all(rec.num_scheduled_tokens == {} for rec in scheduler.step_records[-8:])
    scheduler.finish_requests("r")
    step_until_idle(scheduler, core)
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15


def test_the_synchronous_scheduler_recovers_from_the_same_failed_load():
    """The control for stall 5: the same failed synchronous load without async
    scheduling keeps no placeholder, and the request runs to max_model_len."""
    max_model_len = 32
    script = Script(answers={"r": [(8, False)]}, fail_from={"r": 0})
    scheduler, core = engine(script, num_blocks=16, max_model_len=max_model_len)
    r = scheduler.new_request("r", prompt(400, 12), SamplingParams(max_tokens=100,
                                                                  ignore_eos=True))
    step_until_idle(scheduler, core)
    assert not scheduler.has_requests() and scheduler.stats.num_kv_load_failures == 1
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == max_model_len
