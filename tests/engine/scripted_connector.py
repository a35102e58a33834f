"""A KV connector driven by a script, and engines around it, for model-free tests.

``ScriptedConnector`` moves no tensors: its scheduler half answers
``get_num_new_matched_tokens`` from a ``Script`` and holds a producer's blocks
when told to; its worker half lands asynchronous loads a set number of steps
after they start, reports failed blocks, and reports a held request as sent a
set number of steps after it finished. ``engine()`` builds a model-free
engine (sync, or async with two batches in flight) around it. Used by
``test_vllm_connector_stalls.py`` and ``test_connector_paths.py``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)
from kvref.engine import AsyncScheduler, ModelFreeRunner, Scheduler
from kvref.engine.core import make_engine_core
from kvref.outputs import ModelRunnerOutput
from kvref.worker.kv_connector_model_runner_mixin import execute_with_connector

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
    # A producer: hold[req_id] = steps after it finishes until its KV is reported sent.
    hold: dict[str, int] = field(default_factory=dict)
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
        self._sending: dict[str, int] = {}             # worker: req -> steps left
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

    def request_finished(self, request, block_ids):
        if request.request_id in self.script.hold:
            return True, {"do_remote_prefill": True, "block_ids": list(block_ids)}
        return False, None

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
        for req_id in finished_req_ids:
            if req_id in self.script.hold:
                self._sending[req_id] = self.script.hold[req_id]
        sent = set()
        for req_id in list(self._sending):
            self._sending[req_id] -= 1
            if self._sending[req_id] <= 0:
                del self._sending[req_id]
                sent.add(req_id)
        landed = set()
        for req_id, flight in list(self._in_flight.items()):
            flight[0] -= 1
            if flight[0] <= 0:
                del self._in_flight[req_id]
                landed.add(req_id)
        return sent or None, landed or None

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
           policy: str = "recompute", max_model_len: int = 64, budget: int = 64,
           role: str = "kv_consumer", chunk: int = 0, model_free_runner: bool = False):
    """A model-free engine with the scripted connector: (scheduler, engine core).

    Async scheduling steps with ``TwoInFlight``, or with ``model_free_runner``
    kvref's own ``AsyncEngineCore`` and ``ModelFreeRunner`` (whose tokens are
    checkable, but which refuses a load that fails)."""
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK)
    transfer = KVTransferConfig(kv_connector="ScriptedStallConnector", kv_role=role,
                                kv_load_failure_policy=policy,
                                kv_connector_extra_config={"script": script})
    cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(manager, max_num_batched_tokens=budget, kv_transfer_config=transfer,
                    long_prefill_token_threshold=chunk)
    worker = KVConnectorFactory.create_connector(transfer, KVConnectorRole.WORKER, config)
    if async_scheduling and not model_free_runner:
        return scheduler, TwoInFlight(scheduler, worker)
    return scheduler, make_engine_core(scheduler, ModelFreeRunner(
        vocab_size=90, kv_connector=worker, async_scheduling=async_scheduling))


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
