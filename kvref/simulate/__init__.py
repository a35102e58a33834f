"""``kvref simulate``: a request trace through vLLM 0.25.1's scheduler and KV cache.

No vLLM counterpart. kvref's scheduler and KV cache manager (the ones vLLM's
own recorded decisions replay on) run a trace with no model: Mooncake's
production traces (vendored in ``kvref/data/mooncake/``), a plain JSONL of
prompts, or kvref's workloads. The pool is sized as vLLM sizes it for a model
shape and a GPU (``sizing.py``); every prompt token computed rather than served
from the cache gets a cause (``attribution.py``, ``specs/simulate.md``);
``kv_offloading_size`` puts kvref's CPU offload tier behind the pool::

    from kvref.simulate import load_trace, pool_from_tokens, simulate
    result = simulate(load_trace("conversation", max_requests=200),
                      pool_from_tokens(100_000), arrivals="order")
    print(result.hit_ratio_once, result.misses_by_cause)
"""

from kvref.simulate.attribution import CAUSES, MissLedger, PrefixHistory
from kvref.simulate.engine import (OUTPUT_TOKEN_BASE, HostTierWorker, SimulationResult,
                                   SimulationRunner, StepTime, host_tier_config, simulate)
from kvref.simulate.sizing import (NAMED_SHAPES, ModelShape, PoolSize, mamba_hybrid_block_size,
                                   model_shape_from_hf_config, pool_from_memory,
                                   pool_from_tokens)
from kvref.simulate.traces import (TraceError, TraceRequest, load_trace, mooncake_prompt,
                                   resolve_trace_path)

__all__ = ["CAUSES", "HostTierWorker", "MissLedger", "ModelShape", "NAMED_SHAPES", "OUTPUT_TOKEN_BASE",
           "PoolSize", "PrefixHistory", "SimulationResult", "SimulationRunner", "StepTime",
           "TraceError", "TraceRequest", "host_tier_config", "load_trace", "mamba_hybrid_block_size",
           "model_shape_from_hf_config", "mooncake_prompt", "pool_from_memory",
           "pool_from_tokens", "resolve_trace_path", "simulate"]
