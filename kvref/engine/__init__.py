"""A small engine that runs on kvref's KV cache manager (mirrors vLLM's offline path).

    llm.py                vllm/entrypoints/llm.py + vllm/v1/engine/core.py (the step loop)
    scheduler.py          vllm/v1/core/sched/scheduler.py
    model_runner.py       vllm/v1/worker/gpu_model_runner.py
    model.py              vllm/model_executor/models/llama.py (qwen2.py, qwen3.py)
    loader.py             vllm/model_executor/model_loader/ (default_loader, weight_utils)
    model_free_runner.py  a runner with no model (deterministic tokens), no torch needed
    ngram_proposer.py     vllm/v1/spec_decode/ngram_proposer.py (speculative drafts)
    request.py            vllm/v1/request.py (generation fields), check_stop
    sampling_params.py    vllm/sampling_params.py

``Scheduler``, ``ModelFreeRunner`` and the rest of the scheduling side import
without torch; ``LLM`` and ``RequestOutput`` load torch (and the model code)
on first use.
"""

from kvref.engine.model_free_runner import ModelFreeRunner, engine_step
from kvref.engine.ngram_proposer import NgramProposer
from kvref.engine.request import EngineRequest
from kvref.engine.sampling_params import SamplingParams
from kvref.engine.scheduler import (
    ModelRunnerOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    StepRecord,
)


def __getattr__(name: str):
    # The model side needs torch; import it only when asked for.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from kvref.engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'kvref.engine' has no attribute {name!r}")


__all__ = ["CompletionOutput", "EngineRequest", "LLM", "ModelFreeRunner", "ModelRunnerOutput",
           "NgramProposer", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerOutput",
           "SchedulerStats", "StepRecord", "engine_step"]
