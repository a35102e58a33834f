"""What the scheduler hands the runner each step: ``SchedulerOutput``.

Mirrors ``vllm/v1/core/sched/output.py`` (``NewRequestData``,
``CachedRequestData``, ``SchedulerOutput``), keeping the fields kvref's
runners read. A request appears in exactly one of the two lists: in
``scheduled_new_reqs`` the first time a runner sees it (everything it needs),
in ``scheduled_cached_reqs`` afterwards (only what changed). The scheduler
(``scheduler.py``) builds these; the runners (``kvref/worker/gpu_model_runner.py``,
``kvref/worker/model_free_runner.py``, through ``kvref/worker/gpu_input_batch.py``)
consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.sampling_params import SamplingParams

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or has forgotten): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]      # per KV cache group
    num_computed_tokens: int              # the prefix hit: tokens already in the cache


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds: only what changed since last step.

    Parallel lists, one entry per request. ``new_block_ids[i]`` is None when
    no block was added; for a resumed request it is the whole new table.
    ``all_token_ids`` holds the full token list of requests that were not
    scheduled in the previous step (vLLM sends it for the KV connector and for
    async scheduling; kvref's runners keep their own copy and do not need it).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Output tokens the scheduler kept, per request: a runner that sampled more
    # (its token was dropped after a failed KV load) cuts back to this.
    num_output_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``num_scheduled_tokens`` is in batch order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]   # draft tokens, after the real ones
    num_common_prefix_blocks: list[int]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]            # finished since the previous step
    # With a KV connector: its plan for this step (loads, saves), for the runner's half.
    kv_connector_metadata: object | None = None
