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

from collections import deque
from dataclasses import dataclass, field

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, RequestStatus
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole,
                                                                execute_with_connector)
from kvref.engine import AsyncScheduler, ModelFreeRunner, SamplingParams, Scheduler
from kvref.engine.core import make_engine_core
from kvref.engine.outputs import ModelRunnerOutput

BLOCK = 4


@dataclass
class Script:
    """What the connector answers and does, shared by its two halves.

    ``answers[req_id]``: the answers of ``get_num_new_matched_tokens``, one per
    call, the last one repeated: ``(n, load_async)``, ``n`` None for "ask again".
    ``fail_from[req_id]``: the load's blocks from that index on fail.
    ``delay[req_id]``: an asynchronous load lands after that many steps (1: the
    step after it starts).
    """

    answers: dict[str, list] = field(default_factory=dict)
    fail_from: dict[str, int] = field(default_factory=dict)
    delay: dict[str, int] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)       # every request asked, in order


class ScriptedMetadata(KVConnectorMetadata):
    def __init__(self, loads: dict[str, tuple[list[int], bool]]) -> None:
        self.loads = loads                  # req id -> (its blocks loaded into, async)


class ScriptedConnector(KVConnectorBase_V1):
    """Both halves of a connector that moves no tensors and follows a ``Script``."""

    def __init__(self, kv_transfer_config, role, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        self.script: Script = kv_transfer_config.get_from_extra_config("script", Script())
        self._pending: dict[str, tuple[list[int], bool]] = {}
        self._async_asked: dict[str, bool] = {}
        self._in_flight: dict[str, list] = {}          # worker: req -> [steps left, blocks]
        self._landed: set[str] = set()
        self._errors: set[int] = set()

    # -- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.script.asked.append(request.request_id)
        answers = self.script.answers.get(request.request_id, [(0, False)])
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        self._async_asked[request.request_id] = answer[1]
        return answer

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens == 0:
            return
        (block_ids,) = blocks.get_block_ids()
        first = self._num_local(request, num_external_tokens)
        self._pending[request.request_id] = (
            list(block_ids[first:first + num_external_tokens // BLOCK]),
            self._async_asked[request.request_id])

    @staticmethod
    def _num_local(request, num_external_tokens):
        # The external tokens follow the local hit, which these scripts keep at 0.
        return 0

    def build_connector_meta(self, scheduler_output):
        meta, self._pending = ScriptedMetadata(self._pending), {}
        return meta

    # -- worker side
    def start_load_kv(self, **kwargs):
        for req_id, (block_ids, load_async) in self._get_connector_metadata().loads.items():
            fail_from = self.script.fail_from.get(req_id)
            if fail_from is not None:
                self._errors.update(block_ids[fail_from:])
            if load_async:
                self._in_flight[req_id] = [self.script.delay.get(req_id, 1), block_ids]

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        landed = set()
        for req_id, flight in list(self._in_flight.items()):
            flight[0] -= 1
            if flight[0] <= 0:
                del self._in_flight[req_id]
                landed.add(req_id)
        return None, landed or None

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors


KVConnectorFactory.register_connector("ScriptedStallConnector", ScriptedConnector.__module__,
                                      "ScriptedConnector")


class TwoInFlight:
    """vLLM's batch queue (two batches in flight: step N+1 is planned before step
    N's output is applied), with a worker that finishes each batch at once and
    samples token 7 for every request that is not mid-prefill. (kvref's
    model-free runner is not used here: under async scheduling it refuses a
    num_computed_tokens that goes back, which a failed load does.)"""

    def __init__(self, scheduler, worker) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.queue: deque = deque()

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.queue)

    def _sample(self, scheduler_output) -> ModelRunnerOutput:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [[] if self.scheduler.requests[r].is_prefill_chunk else [7] for r in req_ids]
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def step(self) -> None:
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            self.queue.appendleft((out, execute_with_connector(self.worker, out, self._sample)))
            if len(self.queue) < 2 and (out.total_num_scheduled_tokens > 0
                                        or self.scheduler.has_requests()):
                return
        elif not self.queue:
            return
        out, model_output = self.queue.pop()
        self.scheduler.update_from_output(out, model_output)


def engine(script: Script, num_blocks: int, *, async_scheduling: bool = False,
           policy: str = "recompute", max_model_len: int = 64, budget: int = 64):
    """A model-free engine with the scripted connector: (scheduler, engine core)."""
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK)
    transfer = KVTransferConfig(kv_connector="ScriptedStallConnector", kv_role="kv_consumer",
                                kv_load_failure_policy=policy,
                                kv_connector_extra_config={"script": script})
    cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(manager, max_num_batched_tokens=budget, kv_transfer_config=transfer)
    worker = KVConnectorFactory.create_connector(transfer, KVConnectorRole.WORKER, config)
    if async_scheduling:
        return scheduler, TwoInFlight(scheduler, worker)
    return scheduler, make_engine_core(scheduler, ModelFreeRunner(vocab_size=90,
                                                                  kv_connector=worker))


def step_until_idle(scheduler, core, max_steps: int = 60) -> int:
    """Step while there is work; return the steps taken before 8 idle ones in a row
    (an engine that schedules nothing for 8 steps with requests queued is stuck)."""
    idle = 0
    for n in range(max_steps):
        if not core.has_work():
            return n
        core.step()
        idle = idle + 1 if scheduler.step_records[-1].num_scheduled_tokens == {} else 0
        if idle == 8:
            return n + 1 - idle
    raise AssertionError(f"still scheduling tokens after {max_steps} steps")


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
