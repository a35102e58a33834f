"""``reset_prefix_cache`` on the engine, as vLLM 0.25.1's scheduler does it
(``vllm/v1/core/sched/scheduler.py:2196-2266``, ``async_scheduler.py:54-58``).

With requests running, a plain reset is refused (they hold blocks). With
``reset_running_requests=True`` every running request is preempted first, the
cache is emptied, and the requests recompute their KV from scratch: greedy
tokens equal a run with no reset, under synchronous and asynchronous scheduling
(where the outputs of the steps in flight are dropped when they arrive).
"""

from __future__ import annotations

import pytest

from kvref import AllBlocksCleared
from kvref.engine import LLM, SamplingParams
from kvref.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from .hf_models import assert_matches_transformers, llama
from .test_llm import shared_prefix_prompts

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
OPTIONS = dict(block_size=4, max_model_len=64, max_num_batched_tokens=24, num_gpu_blocks=60,
               enable_kv_cache_events=True, keep_logits=True, device="cpu")


@pytest.fixture(scope="module")
def model():
    return llama(seed=5)


def run(model, prompts, *, async_scheduling: bool, reset_after: int | None):
    """Generate with ``LLM.step``; after ``reset_after`` steps, reset with the
    running requests preempted. Returns the LLM, the outputs and the reset's answer."""
    llm = LLM(model, async_scheduling=async_scheduling, **OPTIONS)
    order = [llm.add_request(p, PARAMS).request_id for p in prompts]
    done, steps, answer = {}, 0, None
    while llm.engine_core.has_work():
        for output in llm.step():
            done[output.request_id] = output
        steps += 1
        if steps == reset_after:
            assert llm.scheduler.running, "the reset must find requests running"
            assert llm.reset_prefix_cache() is False           # they hold blocks
            answer = llm.reset_prefix_cache(reset_running_requests=True)
            # Async: the batch in flight was scheduled before the reset.
            in_flight = sum(r.async_tokens_to_discard for r in llm.scheduler.requests.values())
            assert (in_flight > 0) == async_scheduling
    return llm, [done[r] for r in order], answer


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_reset_that_preempts_the_running_requests_changes_no_token(model, async_scheduling):
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=5)[:6]
    _, plain, _ = run(model, prompts, async_scheduling=async_scheduling, reset_after=None)
    llm, reset, answer = run(model, prompts, async_scheduling=async_scheduling,
                             reset_after=4)
    assert answer is True
    assert [o.outputs[0].token_ids for o in reset] == [o.outputs[0].token_ids for o in plain]
    assert_matches_transformers(model, prompts, reset, PARAMS.max_tokens)
    assert llm.stats.num_preemptions > 0
    events = llm.scheduler.take_events()               # every step's, none taken before
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1
    manager = llm.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_gpu_blocks - 1


def test_the_preempted_requests_come_back_in_order_and_recompute(model):
    prompts = shared_prefix_prompts(model.config.vocab_size, seed=5)[:4]
    llm = LLM(model, **OPTIONS)
    for p in prompts:
        llm.add_request(p, PARAMS)
    for _ in range(3):
        llm.step()
    scheduler = llm.scheduler
    running = [r.request_id for r in scheduler.running]
    assert running
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert scheduler.running == []
    assert [r.request_id for r in list(scheduler.waiting)[:len(running)]] == running
    assert all(scheduler.requests[r].num_computed_tokens == 0 for r in running)
    assert len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0
    output = scheduler.schedule()
    # All preempted by the reset; the first ones resumed in this very output (as many
    # as the token budget takes), with their whole token lists for the runner.
    cached = output.scheduled_cached_reqs
    assert output.preempted_req_ids == set(running)
    assert cached.req_ids == running[:len(cached.req_ids)] and cached.req_ids
    assert set(cached.req_ids) == cached.resumed_req_ids == set(cached.all_token_ids)
    # The cache was emptied: the first one resumed hits nothing (the next may hit the
    # shared prefix it caches again in this step, as any admission would).
    assert scheduler.step_records[-1].prefix_hit_tokens[running[0]] == 0


def connector(**methods) -> KVConnectorBase_V1:
    """A connector with every abstract method a no-op, and ``methods`` (not built:
    only its ``reset_cache`` is asked)."""
    body = dict.fromkeys(KVConnectorBase_V1.__abstractmethods__, lambda *a, **k: None)
    cls = type("TestConnector", (KVConnectorBase_V1,), {**body, **methods})
    return object.__new__(cls)


def test_reset_connector_asks_the_connector_and_a_connector_without_one_counts_as_done(model):
    llm = LLM(model, **OPTIONS)
    scheduler = llm.scheduler
    assert scheduler.connector is None
    assert llm.reset_prefix_cache(reset_connector=True) is True
    scheduler.connector = connector(reset_cache=lambda self: False)     # cannot reset
    assert scheduler.reset_connector_cache() is False
    assert llm.reset_prefix_cache(reset_connector=True) is False
    assert llm.reset_prefix_cache() is True                             # not asked
    scheduler.connector = connector()        # vLLM's base: None, which counts as done
    assert llm.reset_prefix_cache(reset_connector=True) is True
