"""The engine's step loop: schedule, run, update. The one loop every caller uses.

Mirrors ``EngineCore.step`` and ``EngineCore.post_step`` of
``vllm/v1/engine/core.py``. ``LLM.step`` (a real model), the visualizer's
workloads and the tests (``ModelFreeRunner``, no torch) all step through
``EngineCore.step``::

    scheduler.schedule()                      -> SchedulerOutput     (sched_output.py)
    model_runner.execute_model(that)          -> ModelRunnerOutput   (outputs.py)
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

Where later features join this loop, without a second one:

- Async scheduling (vLLM's ``step_with_batch_queue``: the scheduler plans
  step N+1 while the runner works on step N). A step has two halves:
  ``schedule`` + ``execute_model``, then ``update_from_output`` (this
  class's method of that name, which also takes the drafts). An async core
  keeps a queue of scheduled-but-unfinished batches between the halves and
  calls ``update_from_output`` on the oldest when the queue is full; its
  ``step`` returns ``None`` for a step that only queued a batch.
- A KV connector lives, as in vLLM, inside the scheduler (which asks it
  for external hits and builds its metadata in ``schedule``, and reads its
  results in ``update_from_output``) and inside the runner (loads and saves
  around the forward pass). Its metadata rides in ``SchedulerOutput`` and its
  results in ``ModelRunnerOutput``, so this loop does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvref.engine.outputs import ModelRunnerOutput
from kvref.engine.request import EngineRequest
from kvref.engine.sched_output import SchedulerOutput
from kvref.engine.scheduler import Scheduler

__all__ = ["EngineCore", "EngineCoreStep", "ModelRunner", "engine_step"]


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

    def step(self) -> EngineCoreStep:
        """Plan a step, run it, and take its tokens back."""
        scheduler_output = self.scheduler.schedule()
        model_runner_output = self.model_runner.execute_model(scheduler_output)
        return self.update_from_output(scheduler_output, model_runner_output)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreStep:
        """The second half of a step: the scheduler takes the sampled tokens (and
        frees what finished), then the runner's drafts for the next step (vLLM's
        ``post_step``, which vLLM skips under async scheduling: there the worker
        keeps the drafts)."""
        finished = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        self.scheduler.update_draft_token_ids(self.model_runner.take_draft_token_ids())
        return EngineCoreStep(scheduler_output, model_runner_output, finished)


def engine_step(scheduler: Scheduler, model_runner: ModelRunner) -> EngineCoreStep:
    """One ``EngineCore.step`` for callers that keep no ``EngineCore`` (a sync core holds
    no state of its own between steps)."""
    return EngineCore(scheduler, model_runner).step()
