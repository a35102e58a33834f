"""A small engine that runs on kvref's KV cache manager (mirrors vLLM's offline path).

    kvref/engine/         vllm/
    llm.py                entrypoints/llm.py                 LLM, RequestOutput
    core.py               v1/engine/core.py                  EngineCore.step: the step loop;
                                                             AsyncEngineCore (batch queue)
    scheduler.py          v1/core/sched/scheduler.py         Scheduler, StepRecord, stats
    async_scheduler.py    v1/core/sched/async_scheduler.py   AsyncScheduler (placeholders)
    sched_output.py       v1/core/sched/output.py            SchedulerOutput, New/CachedRequestData
    outputs.py            v1/outputs.py                      ModelRunnerOutput
    model_runner.py       v1/worker/gpu_model_runner.py      GPUModelRunner, KV cache layout
    gpu_input_batch.py    v1/worker/gpu_input_batch.py       CachedRequestState, the runners'
                          (+ GPUModelRunner._update_states)  shared request bookkeeping
    model_free_runner.py  (none)                             a runner with no model, no torch
    model.py              model_executor/models/llama.py     plain-torch Llama, Qwen2, Qwen3
                          (qwen2.py, qwen3.py)
    model_config.py       config/model.py                    ModelConfig (from a transformers
                          (+ transformers_utils/config.py)   config), no torch
    loader.py             model_executor/model_loader/       default_loader, weight_utils
    ngram_proposer.py     v1/spec_decode/ngram_proposer.py   speculative drafts
    request.py            v1/request.py                      EngineRequest, check_stop
    sampling_params.py    sampling_params.py                 SamplingParams

One step, whoever drives it (``LLM.step``, the visualizer, the tests)::

    EngineCore.step:  Scheduler.schedule -> SchedulerOutput
                      runner.execute_model -> ModelRunnerOutput
                      Scheduler.update_from_output, Scheduler.update_draft_token_ids

``Scheduler``, ``EngineCore``, ``ModelFreeRunner`` and the rest of the
scheduling side import without torch; ``LLM`` and ``RequestOutput`` load
torch (and the model code) on first use.
"""

from kvref.engine.async_scheduler import AsyncScheduler
from kvref.engine.core import AsyncEngineCore, EngineCore, EngineCoreStep, engine_step
from kvref.engine.model_free_runner import ModelFreeRunner
from kvref.engine.ngram_proposer import NgramProposer
from kvref.engine.outputs import ModelRunnerOutput
from kvref.engine.request import EngineRequest
from kvref.engine.sampling_params import SamplingParams
from kvref.engine.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvref.engine.scheduler import Scheduler, SchedulerStats, StepRecord


def __getattr__(name: str):
    # The model side needs torch; import it only when asked for.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from kvref.engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'kvref.engine' has no attribute {name!r}")


__all__ = ["AsyncEngineCore", "AsyncScheduler", "CachedRequestData", "CompletionOutput",
           "EngineCore", "EngineCoreStep",
           "EngineRequest", "LLM", "ModelFreeRunner", "ModelRunnerOutput", "NewRequestData",
           "NgramProposer", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerOutput",
           "SchedulerStats", "StepRecord", "engine_step"]
