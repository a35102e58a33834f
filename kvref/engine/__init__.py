"""The engine's step loop, and the names a user of the engine imports in one line.

Mirrors ``vllm/v1/engine/`` (``core.py``: ``EngineCore.step``). The engine's
other parts sit in the folders vLLM keeps them in::

    kvref/                           vllm/
      entrypoints/llm.py               entrypoints/llm.py                LLM, RequestOutput
      engine/core.py                   v1/engine/core.py                 EngineCore.step
      sched/scheduler.py               v1/core/sched/scheduler.py        Scheduler, StepRecord
      sched/async_scheduler.py         v1/core/sched/async_scheduler.py  AsyncScheduler
      sched/output.py                  v1/core/sched/output.py           SchedulerOutput
      worker/gpu_model_runner.py       v1/worker/gpu_model_runner.py     GPUModelRunner
      worker/model_free_runner.py      (none)                            a runner with no model
      spec_decode/ngram_proposer.py    v1/spec_decode/ngram_proposer.py  NgramProposer
      model_executor/model.py          model_executor/models/llama.py    the transformer

One step, whoever drives it (``LLM.step``, the visualizer, the tests)::

    EngineCore.step:  Scheduler.schedule -> SchedulerOutput
                      runner.execute_model -> ModelRunnerOutput
                      Scheduler.update_from_output, Scheduler.update_draft_token_ids

``from kvref.engine import LLM, SamplingParams`` keeps working: the names
below are re-exported here. ``Scheduler``, ``EngineCore``, ``ModelFreeRunner``
and the rest of the scheduling side import without torch; ``LLM`` and
``RequestOutput`` live one floor up, in ``kvref.entrypoints.llm`` (it loads
torch and the model code), and are fetched from there on first use.
"""

from kvref.engine.core import AsyncEngineCore, EngineCore, EngineCoreStep, engine_step
from kvref.outputs import ModelRunnerOutput
from kvref.request import EngineRequest
from kvref.sampling_params import SamplingParams
from kvref.sched.async_scheduler import AsyncScheduler
from kvref.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvref.sched.scheduler import Scheduler, SchedulerStats, StepRecord
from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.worker.model_free_runner import ModelFreeRunner

# The one name this package hands out from a floor above it: the entry point.
# Fetched lazily (it needs torch), so nothing here imports it at load time.
ENTRYPOINT_NAMES = ("LLM", "RequestOutput", "CompletionOutput")


def __getattr__(name: str):
    if name in ENTRYPOINT_NAMES:
        from kvref.entrypoints import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'kvref.engine' has no attribute {name!r}")


__all__ = ["AsyncEngineCore", "AsyncScheduler", "CachedRequestData", "CompletionOutput",
           "EngineCore", "EngineCoreStep",
           "EngineRequest", "LLM", "ModelFreeRunner", "ModelRunnerOutput", "NewRequestData",
           "NgramProposer", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerOutput",
           "SchedulerStats", "StepRecord", "engine_step"]
