"""A small engine that runs on kvref's KV cache manager (mirrors vLLM's offline path).

    scheduler.py          vllm/v1/core/sched/scheduler.py
    model_free_runner.py  a runner with no model (deterministic tokens)
    request.py            vllm/v1/request.py (generation fields), check_stop
    sampling_params.py    vllm/sampling_params.py
"""

from kvref.engine.model_free_runner import ModelFreeRunner, engine_step
from kvref.engine.request import EngineRequest
from kvref.engine.sampling_params import SamplingParams
from kvref.engine.scheduler import (
    ModelRunnerOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    StepRecord,
)

__all__ = ["EngineRequest", "ModelFreeRunner", "ModelRunnerOutput", "SamplingParams",
           "Scheduler", "SchedulerOutput", "SchedulerStats", "StepRecord", "engine_step"]
