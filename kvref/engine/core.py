"""The engine's step loop: schedule, run, update. The one loop every caller uses.

Mirrors ``EngineCore.step`` and ``EngineCore.post_step`` of
``vllm/v1/engine/core.py``. ``LLM.step`` (a real model), the visualizer's
workloads and the tests (``ModelFreeRunner``, no torch) all step through
``EngineCore.step``::

    scheduler.schedule()                      -> SchedulerOutput     (kvref/sched/output.py)
    model_runner.execute_model(that)          -> ModelRunnerOutput   (kvref/outputs.py)
    scheduler.update_from_output(both)        -> the requests that finished
    scheduler.update_draft_token_ids(model_runner.take_draft_token_ids())

    >>> from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
    >>> from kvref.engine import ModelFreeRunner, SamplingParams, Scheduler
    >>> config = KVCacheConfig(8, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    >>> manager = KVCacheManager(config, max_model_len=32, scheduler_block_size=4,
    ...                          hash_block_size=4)
    >>> scheduler = Scheduler(manager, max_num_batched_tokens=4)
    >>> _ = scheduler.new_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    >>> core = EngineCore(scheduler, ModelFreeRunner(vocab_size=50))
    >>> step = core.step()                   # 4 of the 5 prompt tokens: nothing sampled
    >>> step.scheduler_output.num_scheduled_tokens, step.model_runner_output.sampled_token_ids
    ({'a': 4}, [[]])
    >>> [len(core.step().finished) for _ in range(2)]    # the last prompt token, one decode
    [0, 1]

Async scheduling is the same loop with a queue between its halves
(``AsyncEngineCore``, vLLM's ``step_with_batch_queue``): a step has two
halves, ``schedule`` + ``execute_model``, then ``update_from_output``. The
async core runs the runner on a worker thread, keeps up to two
scheduled-but-unfinished batches, and calls ``update_from_output`` on the
oldest only when the queue is full (or nothing more can be scheduled), so
the scheduler plans step N+1 while the runner works on step N. Its ``step``
returns ``None`` for a call that only queued a batch. Use it with an
``AsyncScheduler`` and a runner made with ``async_scheduling=True``::

    >>> from kvref.sched.async_scheduler import AsyncScheduler
    >>> manager = KVCacheManager(config, max_model_len=32, scheduler_block_size=4,
    ...                          hash_block_size=4)
    >>> scheduler = AsyncScheduler(manager, max_num_batched_tokens=8)
    >>> req = scheduler.new_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    >>> runner = ModelFreeRunner(vocab_size=50, async_scheduling=True)
    >>> core = AsyncEngineCore(scheduler, runner)
    >>> core.step() is None                   # step 0 queued, nothing back yet
    True
    >>> req.num_computed_tokens, req.num_output_placeholders   # its first token in flight
    (3, 1)
    >>> step = core.step()                    # plans step 1, then applies step 0
    >>> step.scheduler_output.num_scheduled_tokens, len(req.output_token_ids)
    ({'a': 3}, 1)
    >>> req.num_computed_tokens, req.num_output_placeholders   # step 1's token in flight
    (4, 1)
    >>> while core.has_work():
    ...     _ = core.step()
    >>> req.output_token_ids == runner.reference_output([1, 2, 3], 3)
    True
    >>> core.shutdown()

What else joins this loop, without a second one:

- A KV connector lives, as in vLLM, inside the scheduler (which asks it
  for external hits and builds its metadata in ``schedule``, and reads its
  results in ``update_from_output``) and inside the runner (loads and saves
  around the forward pass). Its metadata rides in ``SchedulerOutput`` and its
  results in ``ModelRunnerOutput``, so this loop does not change.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from kvref.outputs import ModelRunnerOutput
from kvref.request import EngineRequest
from kvref.sched.output import SchedulerOutput
from kvref.sched.scheduler import Scheduler

__all__ = ["AsyncEngineCore", "EngineCore", "EngineCoreStep", "ModelRunner", "engine_step",
           "make_engine_core"]


class ModelRunner(Protocol):
    """What the loop needs of a runner (``GPUModelRunner``, ``ModelFreeRunner``)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def take_draft_token_ids(self) -> dict[str, list[int]]: ...


@dataclass(slots=True)
class EngineCoreStep:
    """One finished step: its plan, what the runner returned, who finished.

    (vLLM's ``step`` returns the finished requests' outputs as
    ``EngineCoreOutputs``; kvref hands back the requests themselves.)
    """

    scheduler_output: SchedulerOutput
    model_runner_output: ModelRunnerOutput
    finished: list[EngineRequest]


class EngineCore:
    """Steps a ``Scheduler`` and a runner together (synchronous: plan, run, update)."""

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner

    def has_work(self) -> bool:
        """Whether ``step`` has anything to do (vLLM's ``has_work``): requests, or
        finished ones the next ``SchedulerOutput`` must still report."""
        return self.scheduler.has_requests()

    def step(self) -> EngineCoreStep:
        """Plan a step, run it, and take its tokens back.

        Called only while the scheduler has unfinished requests, or finished
        ones not yet reported (after the last request finishes vLLM's engine
        runs one more step, with nothing scheduled, to report it; ``has_work``).
        """
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.model_runner.execute_model(scheduler_output)
        return self.update_from_output(scheduler_output, model_runner_output)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """The scheduler's ``reset_prefix_cache``, between steps (vLLM's
        ``core.py:680-685``)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        """Nothing to stop for a synchronous core (the async one has a thread)."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreStep:
        """The second half of a step: the scheduler takes the sampled tokens (and
        frees what finished), then the runner's drafts for the next step (vLLM's
        ``post_step``, which vLLM skips under async scheduling: there the worker
        keeps the drafts)."""
        finished = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        self.scheduler.update_draft_token_ids(self.model_runner.take_draft_token_ids())
        return EngineCoreStep(scheduler_output, model_runner_output, finished)


class AsyncEngineCore(EngineCore):
    """Overlapped stepping (vLLM's ``EngineCore.step_with_batch_queue``).

    The runner runs on one worker thread; up to ``scheduler.max_concurrent_batches``
    (2) batches are in flight. Each ``step`` call:

    1. if the scheduler has requests, schedules a batch and submits it to
       the worker, without waiting; while the queue has room and there is
       more to schedule (or the batch was not empty), returns ``None`` right
       away, so the next call plans the next step while this one runs;
    2. otherwise waits for the oldest batch and applies its output
       (``update_from_output``), returning that step.

    The drafts stay with the runner (vLLM skips ``post_step``'s draft update
    under async scheduling); the scheduler schedules placeholders for them.
    """

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner) -> None:
        if scheduler.max_concurrent_batches < 2:
            raise ValueError("AsyncEngineCore needs an AsyncScheduler (a scheduler that "
                             "counts output placeholders), got "
                             f"{type(scheduler).__name__}")
        if not getattr(model_runner, "async_scheduling", False):
            raise ValueError("AsyncEngineCore needs a runner made with async_scheduling=True "
                             "(it keeps its own drafts and token counts)")
        super().__init__(scheduler, model_runner)
        self.batch_queue_size = scheduler.max_concurrent_batches
        # Newest on the left, oldest on the right (vLLM's order).
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] = deque()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvref-runner")

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreStep | None:
        scheduler = self.scheduler
        queue = self.batch_queue
        assert len(queue) < self.batch_queue_size
        if scheduler.has_requests():
            scheduler_output = scheduler.schedule()
            future = self._executor.submit(self.model_runner.execute_model, scheduler_output)
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            queue.appendleft((future, scheduler_output))
            if len(queue) < self.batch_queue_size and (model_executed
                                                       or scheduler.has_requests()):
                return None                   # the runner works; plan the next one first
        elif not queue:
            return None
        future, scheduler_output = queue.pop()
        model_runner_output = future.result()
        return self.update_from_output(scheduler_output, model_runner_output)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreStep:
        finished = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        return EngineCoreStep(scheduler_output, model_runner_output, finished)

    def shutdown(self) -> None:
        """Wait for the batches in flight and stop the worker thread."""
        for future, _ in self.batch_queue:
            future.result()
        self._executor.shutdown(wait=True)


def make_engine_core(scheduler: Scheduler, model_runner: ModelRunner) -> EngineCore:
    """The core that fits the scheduler: ``AsyncEngineCore`` for an ``AsyncScheduler``."""
    if scheduler.max_concurrent_batches > 1:
        return AsyncEngineCore(scheduler, model_runner)
    return EngineCore(scheduler, model_runner)


def engine_step(scheduler: Scheduler, model_runner: ModelRunner) -> EngineCoreStep:
    """One ``EngineCore.step`` for callers that keep no ``EngineCore`` (a sync core holds
    no state of its own between steps)."""
    return EngineCore(scheduler, model_runner).step()
