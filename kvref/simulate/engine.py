"""Run a request trace through kvref's vLLM 0.25.1 scheduler and KV cache, with no model.

No vLLM counterpart. The engine is kvref's own (``kvref.sched.scheduler.Scheduler``,
``KVCacheManager``, ``EngineCore``: the scheduler vLLM's recorded decisions
replay on with 0 divergent steps, ``tests/engine/test_vllm_scheduler_traces.py``);
what is added here is the clock, the runner and the bookkeeping:

* ``SimulationRunner``: a "model" that emits, when a step's tokens reach a
  request's last token, the next token of the reply the trace gives for it
  (``output_token_ids``), or else the stand-in ``OUTPUT_TOKEN_BASE +
  position``, a token no prompt contains. Outputs depend on the request and
  on nothing the scheduler does, like a greedy model's; cheap, unlike
  ``ModelFreeRunner``'s hash of the whole sequence per token.
* Arrivals: ``"order"`` adds the next request only when the engine is empty
  (one request after another, as Mooncake's Figure 9 replays its traces);
  ``"timestamps"`` adds each request when the clock passes its arrival. The
  clock advances each step by ``StepTime``: ``base_ms + ms_per_token x
  tokens scheduled`` (a linear step-time model; its defaults are round figures
  for an 8B model on one H100-class GPU, not a measurement). An idle engine
  jumps to the next arrival.
* The ``MissLedger`` (``attribution.py``, ``specs/simulate.md``): each prompt
  token computed, with its cause.
* A host tier (``kv_offloading_size``, vLLM's ``--kv-offloading-size`` in
  GiB): kvref's ``SimpleCPUOffloadConnector``, its scheduler half in the
  scheduler and its worker half (``HostTierWorker``, no tensors) in the runner.

    >>> from kvref.simulate import TraceRequest, pool_from_tokens, simulate
    >>> shared = list(range(1000, 1040))                     # 40 tokens, 2.5 blocks of 16
    >>> reqs = [TraceRequest(f"r{i}", 50, 4, 0.0, tokens=shared + [2000 + 10 * i + j
    ...         for j in range(10)]) for i in range(3)]
    >>> result = simulate(reqs, pool_from_tokens(64))
    >>> result.prompt_tokens, result.prompt_tokens_cached_once    # 2 x 32 tokens hit
    (150, 64)
    >>> result.misses_by_cause["shared_prefix_ends_inside_block"]   # 2 x 8 shared, not cached
    16

A pool of 6 usable blocks, requests of 5 (50 + 30 tokens): ``b`` evicts the
second of the two blocks ``a0`` and ``a1`` share; a host tier serves it:

    >>> two = shared[:32]
    >>> reqs = [TraceRequest("a0", 50, 30, 0.0, tokens=two + list(range(2000, 2018))),
    ...         TraceRequest("b", 50, 30, 0.0, tokens=list(range(3000, 3050))),
    ...         TraceRequest("a1", 50, 30, 0.0, tokens=two + list(range(4000, 4018)))]
    >>> alone = simulate(reqs, pool_from_tokens(7))
    >>> tiered = simulate(reqs, pool_from_tokens(7), kv_offloading_size=0.001)
    >>> alone.misses_by_cause["evicted_before_reuse"], tiered.prompt_tokens_from_host
    (16, 16)
    >>> alone.prompt_tokens_computed - tiered.prompt_tokens_computed
    16
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from kvref.core.single_type_kv_cache_manager import FullAttentionManager
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvref.worker.kv_connector_model_runner_mixin import execute_with_connector
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector)
from kvref.engine.core import EngineCore
from kvref.outputs import ModelRunnerOutput
from kvref.request import EngineRequest
from kvref.sampling_params import SamplingParams
from kvref.sched.output import SchedulerOutput
from kvref.sched.scheduler import Scheduler
from kvref.kv_cache_interface import FullAttentionSpec
from kvref.math_utils import cdiv
from kvref.simulate.attribution import CAUSES, MissLedger, PrefixHistory
from kvref.simulate.lazy_pool import lazy_block_pools
from kvref.simulate.sizing import PoolSize
from kvref.simulate.traces import TraceRequest

__all__ = ["OUTPUT_TOKEN_BASE", "HostTierWorker", "SimulationResult", "SimulationRunner",
           "StepTime", "host_tier_config", "simulate"]

# Generated tokens: above every prompt token a Mooncake trace makes (ids < 2**27).
OUTPUT_TOKEN_BASE = 1 << 30


@dataclass(frozen=True)
class StepTime:
    """Seconds one engine step takes: ``(base_ms + ms_per_token * tokens) / 1000``."""

    base_ms: float = 10.0
    ms_per_token: float = 0.04

    def seconds(self, num_scheduled_tokens: int) -> float:
        return (self.base_ms + self.ms_per_token * num_scheduled_tokens) / 1000.0


class SimulationRunner:
    """The model's place in the loop: a sampled token per request that reached its
    end, and the simulation's observation of each step (the scheduler's requests
    are still all alive between ``schedule`` and ``update_from_output``).
    ``kv_connector``: a connector's WORKER half, driven around each step as the
    runners drive one (``execute_with_connector``)."""

    def __init__(self, requests: dict[str, EngineRequest],
                 on_step: Callable[[SchedulerOutput], None] | None = None,
                 kv_connector=None, replies: dict[str, list[int]] | None = None) -> None:
        self.requests = requests
        self.on_step = on_step
        self.kv_connector = kv_connector
        # request id -> the reply to generate (the trace's output_token_ids)
        self.replies = replies if replies is not None else {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return execute_with_connector(self.kv_connector, scheduler_output, self._execute)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.on_step is not None:
            self.on_step(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.requests[rid]
            # The scheduler has already counted this step's tokens as computed.
            if request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            reply = self.replies.get(rid)
            position = request.num_tokens - request.num_prompt_tokens   # outputs so far
            if reply is not None and position < len(reply):
                sampled.append([reply[position]])
            else:
                sampled.append([OUTPUT_TOKEN_BASE + request.num_tokens])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        return {}


class HostTierWorker(SimpleCPUOffloadConnector):
    """The CPU offload tier's own WORKER half with no tensors: it is registered no
    KV caches, so a copy moves nothing, and a copy launched at one step's poll is
    found done ``copy_steps`` polls (engine steps) later (kvref's worker: 1, the
    next poll). The plans, the host pool and every hold are the tier's own."""

    copy_steps = 1

    def _copy_latency(self, kind: str, event: int) -> int:
        return self.copy_steps


def host_tier_config(kv_offloading_size: float) -> KVTransferConfig:
    """vLLM's ``--kv-offloading-size GIB`` with the native backend: the CPU tier,
    ``cpu_bytes_to_use = GIB * 2**30``, role ``kv_both``
    (``vllm/config/vllm.py:796-824``; vLLM picks ``SimpleCPUOffloadConnector``
    when ``VLLM_USE_SIMPLE_KV_OFFLOAD`` is set, ``:807-810``)."""
    import math

    if isinstance(kv_offloading_size, bool) or not (
            isinstance(kv_offloading_size, (int, float)) and math.isfinite(kv_offloading_size)
            and kv_offloading_size > 0):
        raise ValueError(f"kv_offloading_size is the host tier's size in GiB and must be a "
                         f"positive number, got {kv_offloading_size!r}")
    return KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": int(kv_offloading_size * (1 << 30))})


@dataclass
class SimulationResult:
    """What a run did; ``to_json()`` is ``kvref simulate --json``."""

    num_requests: int = 0
    num_rejected: int = 0                 # prompt >= max_model_len: vLLM refuses them
    # requests whose reply the trace gave (generated as given); the others got
    # stand-in tokens, so a later prompt that resends their reply misses on it
    requests_with_replies: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached_once: int = 0    # each request's first-admission hit
    prefix_cache_queries: int = 0         # vLLM's counters (requests never preempted)
    prefix_cache_hits: int = 0
    preempted_prefix_cache_queries: int = 0
    preempted_prefix_cache_hits: int = 0
    misses_by_cause: dict[str, int] = field(default_factory=dict)
    # The host tier (--kv-offloading-size); all 0 without one.
    prompt_tokens_from_host: int = 0      # loaded from the host, over all admissions
    prompt_tokens_from_host_once: int = 0  # each request's first-admission load
    kv_offloading_size: float = 0.0       # GiB
    num_cpu_blocks: int = 0
    host_blocks_stored: int = 0
    host_blocks_loaded: int = 0
    # Free blocks when the run ended (all but the null block, once everything finished).
    free_gpu_blocks_at_end: int = 0
    free_cpu_blocks_at_end: int = 0
    tier_holds_at_end: int = 0            # device blocks a host copy or load still holds
    num_preemptions: int = 0
    num_steps: int = 0
    output_tokens: int = 0
    simulated_seconds: float = 0.0
    wall_seconds: float = 0.0
    num_gpu_blocks: int = 0
    block_size: int = 0
    kv_cache_tokens: int = 0
    pool: str = ""
    arrivals: str = "order"
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    per_request_hits: dict[str, int] = field(default_factory=dict, repr=False)
    queue_delays_s: list[float] = field(default_factory=list, repr=False)
    # (simulated seconds, KV usage 0..1, running, waiting, preemptions so far), sampled
    timeline: list[tuple[float, float, int, int, int]] = field(default_factory=list,
                                                               repr=False)

    @property
    def hit_ratio_once(self) -> float:
        return self.prompt_tokens_cached_once / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """vLLM's hit rate: hits over queries (requests never preempted)."""
        return (self.prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0)

    def to_json(self, per_request: bool = False) -> dict:
        doc = {
            "num_requests": self.num_requests, "num_rejected": self.num_rejected,
            "requests_with_replies": self.requests_with_replies,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_cached_once": self.prompt_tokens_cached_once,
            "hit_ratio_once": self.hit_ratio_once,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "preempted_prefix_cache_queries": self.preempted_prefix_cache_queries,
            "preempted_prefix_cache_hits": self.preempted_prefix_cache_hits,
            "misses_by_cause": dict(self.misses_by_cause),
            "prompt_tokens_from_host": self.prompt_tokens_from_host,
            "prompt_tokens_from_host_once": self.prompt_tokens_from_host_once,
            "kv_offloading_size": self.kv_offloading_size,
            "num_cpu_blocks": self.num_cpu_blocks,
            "host_blocks_stored": self.host_blocks_stored,
            "host_blocks_loaded": self.host_blocks_loaded,
            "num_preemptions": self.num_preemptions, "num_steps": self.num_steps,
            "output_tokens": self.output_tokens,
            "simulated_seconds": round(self.simulated_seconds, 3),
            "wall_seconds": round(self.wall_seconds, 3),
            "num_gpu_blocks": self.num_gpu_blocks, "block_size": self.block_size,
            "kv_cache_tokens": self.kv_cache_tokens, "pool": self.pool,
            "arrivals": self.arrivals, "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }
        if per_request:
            doc["per_request_hits"] = dict(self.per_request_hits)
        return doc


class _Observer:
    """The bookkeeping around the engine: lookups, admissions, computed tokens."""

    def __init__(self, manager: KVCacheManager, scheduler: Scheduler) -> None:
        # A recording manager (record.py) keeps the real one as .manager; the
        # observer's own lookups must not be recorded.
        self.manager = getattr(manager, "manager", manager)
        self.scheduler = scheduler
        self.history = PrefixHistory(self.manager.block_pool.hash_block_size)
        self.ledger = MissLedger()
        self.cuts: dict[str, tuple[int, ...]] = {}
        self.blocks_added: dict[str, int] = {}
        self.admitted_at: dict[str, int] = {}         # request -> step of first admission
        coordinator = self.manager.coordinator
        # The full-attention group looked up alone (F of rule S2), in a hybrid model.
        self.full_group = None
        groups = getattr(coordinator, "attention_groups", None)
        if groups and isinstance(groups[0].spec, FullAttentionSpec):
            self.full_group = groups[0]
        # One full-attention group of one block size: the cheap uncapped lookup.
        config_groups = self.manager.kv_cache_config.kv_cache_groups
        self.plain_block_size = None
        if len(config_groups) == 1 and type(config_groups[0].kv_cache_spec) is FullAttentionSpec \
                and config_groups[0].kv_cache_spec.block_size == \
                self.manager.block_pool.hash_block_size:
            self.plain_block_size = config_groups[0].kv_cache_spec.block_size
        self._lookup = manager.get_computed_blocks
        manager.get_computed_blocks = self.get_computed_blocks

    def get_computed_blocks(self, request):
        blocks, num_hit = self._lookup(request)
        if request.num_preemptions == 0 and request.request_id not in self.admitted_at:
            self.cuts[request.request_id] = self._cuts(request, num_hit)
        return blocks, num_hit

    def _cuts(self, request, num_hit: int) -> tuple[int, int, int]:
        """(h, A, F) of rule S2, at the moment of the lookup (S and T are measured at
        admission, ``on_step``: the history changes only after a step is scheduled)."""
        n = request.num_tokens
        manager = self.manager
        coordinator = manager.coordinator
        if not manager.enable_caching:
            return num_hit, 0, 0
        if self.plain_block_size:
            # One full-attention group: without the cap the hit can only reach one
            # block further, the prompt's last, when the prompt fills it exactly.
            size = self.plain_block_size
            uncapped = num_hit
            if n % size == 0 and num_hit == n - size and coordinator.block_pool.get_cached_block(
                    request.block_hashes[num_hit // size], [0]) is not None:
                uncapped = n
            return num_hit, uncapped, uncapped
        _, uncapped = coordinator.find_longest_cache_hit(request.block_hashes, n)
        full_only = uncapped
        if self.full_group is not None:
            spec, gids = self.full_group.spec, self.full_group.group_ids
            hit = FullAttentionManager.find_longest_cache_hit(
                coordinator._hashes_for(spec, request.block_hashes), n, gids,
                coordinator.block_pool, spec, False, coordinator.scheduler_block_size)
            full_only = len(hit[0]) * spec.block_size
        return num_hit, uncapped, full_only

    def on_step(self, output: SchedulerOutput) -> None:
        requests = self.scheduler.requests
        step = self.scheduler.stats.num_steps
        for new in output.scheduled_new_reqs:
            rid = new.req_id
            request = requests[rid]
            cuts = self.cuts.pop(rid)
            # Beyond the device's hit: what the host tier loaded (rule S5).
            from_host = new.num_computed_tokens - cuts[0]
            assert from_host >= 0 and (from_host == 0 or self.scheduler.connector is not None), \
                (rid, cuts, new.num_computed_tokens)
            seen_blocks, seen_tokens = self.history.seen_prefix(request, request.num_tokens)
            self.ledger.admit(rid, request.num_prompt_tokens, (*cuts, seen_blocks, seen_tokens),
                              self.manager.enable_caching, from_host)
            self.admitted_at[rid] = step
            self.blocks_added[rid] = 0
        for rid, n in output.num_scheduled_tokens.items():
            request = requests[rid]
            end = request.num_computed_tokens
            start = end - n
            num_prompt = request.num_prompt_tokens
            if start < num_prompt:
                self.ledger.computed_tokens(rid, start, min(end, num_prompt))
            if end // self.history.hash_block_size > self.blocks_added[rid]:   # a new full block
                self.blocks_added[rid] = self.history.add(request, self.blocks_added[rid], end,
                                                          partial=False)

    def on_finished(self, request: EngineRequest) -> None:
        rid = request.request_id
        self.history.add(request, self.blocks_added.pop(rid, 0), request.num_computed_tokens,
                         partial=True)
        self.ledger.finish(rid)


def _block_sizes(pool: PoolSize, enable_prefix_caching: bool) -> tuple[int, int]:
    """(scheduler, hash) block sizes as vLLM's EngineCore resolves them."""
    from types import SimpleNamespace as NS

    from kvref.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = NS(cache_config=NS(block_size=pool.block_size, hash_block_size=None,
                                enable_prefix_caching=enable_prefix_caching),
                parallel_config=NS(decode_context_parallel_size=1,
                                   prefill_context_parallel_size=1),
                kv_transfer_config=None)
    return resolve_kv_cache_block_sizes(pool.kv_cache_config, config)


# Steps in a row that schedule no token before a run is called stalled (a load in
# flight idles a step or two; nothing legitimate idles for this long).
MAX_IDLE_STEPS = 1000


def _check_pool(pool: PoolSize, max_model_len: int, max_num_batched_tokens: int) -> None:
    for group in pool.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and \
                cdiv(max_model_len, spec.block_size) > pool.num_blocks - 1:
            raise ValueError(
                f"the KV cache ({pool.num_blocks - 1} blocks of {spec.block_size} tokens) "
                f"cannot hold one request of max_model_len {max_model_len}, so vLLM would "
                f"refuse to start; give more KV cache or a smaller --max-model-len")
    # Every group at once (a hybrid's window and Mamba groups take blocks of the same
    # pool): vLLM's startup check asks the same peak per request of all groups
    # (kvref.core.kv_cache_utils.max_memory_usage_bytes, the "maximum concurrency").
    concurrency = get_max_concurrency_for_kv_cache_config(
        pool.kv_cache_config, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens)
    if concurrency < 1:
        groups = len(pool.kv_cache_config.kv_cache_groups)
        raise ValueError(
            f"the KV cache ({pool.num_blocks} blocks shared by {groups} KV cache groups) "
            f"holds {concurrency:.2f} of a request of max_model_len {max_model_len} across "
            "its groups, so vLLM would refuse to start; give more KV cache or a smaller "
            "--max-model-len")


def simulate(requests: Sequence[TraceRequest], pool: PoolSize, *,
             max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
             max_num_seqs: int = 1024, long_prefill_token_threshold: int = 0,
             enable_prefix_caching: bool = True, scheduler_reserve_full_isl: bool = True,
             watermark: float = 0.0, arrivals: str = "order",
             step_time: StepTime = StepTime(), max_output_tokens: int | None = None,
             on_progress: Callable[[int, int], None] | None = None,
             max_timeline: int = 2000, max_steps: int | None = None,
             manager_factory: Callable[..., KVCacheManager] | None = None,
             kv_offloading_size: float | None = None, kv_offload_copy_steps: int = 1,
             lazy_pool: bool = True) -> SimulationResult:
    """Run ``requests`` through vLLM 0.25.1's scheduler and KV cache (kvref's) on ``pool``.

    Defaults are ``vllm serve``'s on a GPU of 70 GiB or more (8192 tokens and
    1024 sequences a step: ``vllm/engine/arg_utils.py:2426-2434``). With
    ``max_model_len`` None it is the longest request of the trace (prompt plus
    output); a prompt of ``max_model_len`` tokens or more is rejected, as vLLM
    rejects it, and counted in ``num_rejected``. ``max_steps`` stops early;
    ``manager_factory(kv_cache_config, **manager_arguments)`` builds the manager
    (``record.py`` passes a recording one).

    ``kv_offloading_size``: a host tier of that many GiB behind the device pool,
    as vLLM's ``--kv-offloading-size`` builds it (``host_tier_config``): the
    scheduler gets the tier's SCHEDULER half through its ``kv_transfer_config``,
    as the engine's does, and the runner a ``HostTierWorker`` whose copies are
    found done ``kv_offload_copy_steps`` steps after their launch. After the last
    request the engine steps on until the stores in flight are done.

    ``lazy_pool``: the device pool makes each block when it is first handed out
    (``lazy_pool.py``: the same blocks in the same order as the plain pool, at a
    cost that grows with the blocks used); False builds vLLM's plain pool.
    """
    if arrivals not in ("order", "timestamps"):
        raise ValueError(f"arrivals must be 'order' or 'timestamps', got {arrivals!r}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    if max_num_batched_tokens < max_num_seqs:
        # vllm/config/scheduler.py:286-291: vLLM refuses to start.
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                         f"max_num_seqs ({max_num_seqs}), or vLLM refuses to start; lower "
                         "--max-num-seqs too")

    def out_len(r: TraceRequest) -> int:
        return r.max_tokens if max_output_tokens is None else min(r.max_tokens,
                                                                   max_output_tokens)
    followups = {r.after: r for r in requests if r.after is not None}
    requests = [r for r in requests if r.after is None]
    if max_model_len is None:
        if followups:
            raise ValueError("a trace with follow-up turns needs max_model_len")
        max_model_len = max(r.input_length + out_len(r) for r in requests)
    _check_pool(pool, max_model_len, max_num_batched_tokens)
    transfer = None
    if kv_offloading_size is not None:
        transfer = host_tier_config(kv_offloading_size)
        if not enable_prefix_caching:
            raise ValueError("the host tier (kv_offloading_size) needs prefix caching: "
                             "vLLM's tier turns itself off without it "
                             "(simple_cpu_offload_connector.py:82-87)")
        if pool.kv_cache_config.has_mamba_layers:
            raise ValueError("a host tier (kv_offloading_size) with a Mamba hybrid is not "
                             "simulated yet: the scheduler's Mamba local hit bypasses the "
                             "lookup the miss attribution records")
        if isinstance(kv_offload_copy_steps, bool) or not isinstance(kv_offload_copy_steps,
                                                                     int) \
                or kv_offload_copy_steps < 1:
            raise ValueError(f"kv_offload_copy_steps must be an integer >= 1 (a copy is "
                             f"found done no earlier than the next step), got "
                             f"{kv_offload_copy_steps!r}")

    started = time.perf_counter()
    scheduler_block_size, hash_block_size = _block_sizes(pool, enable_prefix_caching)
    with lazy_block_pools() if lazy_pool else nullcontext():
        manager = (manager_factory or KVCacheManager)(
            pool.kv_cache_config, max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=enable_prefix_caching, log_stats=True, watermark=watermark,
            retention_interval=None)
    scheduler = Scheduler(manager, max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          scheduler_reserve_full_isl=scheduler_reserve_full_isl,
                          kv_transfer_config=transfer)
    worker = None
    if transfer is not None:
        worker = HostTierWorker(transfer, KVConnectorRole.WORKER, pool.kv_cache_config)
        worker.copy_steps = kv_offload_copy_steps
        worker.register_kv_caches({})                 # no tensors: nothing is copied
    # The cascade-attention hint (leading blocks every running request shares) goes
    # to the runner only and changes no KV decision; vLLM computes it each step
    # (vllm/v1/core/sched/scheduler.py:1035-1043) by walking the first running
    # request's blocks. The simulation has no attention to cascade, so it skips the walk.
    zeros = [0] * manager.num_kv_cache_groups
    manager.get_num_common_prefix_blocks = lambda request_id: list(zeros)
    observer = _Observer(manager, scheduler)
    replies: dict[str, list[int]] = {}
    core = EngineCore(scheduler, SimulationRunner(scheduler.requests, observer.on_step,
                                                  kv_connector=worker, replies=replies))

    result = SimulationResult(num_gpu_blocks=pool.num_blocks, block_size=pool.block_size,
                              kv_cache_tokens=pool.tokens, pool=pool.how, arrivals=arrivals,
                              max_model_len=max_model_len,
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs)
    if arrivals == "timestamps":
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    else:
        pending = deque(requests)
    total = len(pending)
    arrived_at: dict[str, float] = {}
    clock = 0.0
    every = 1                                 # timeline: one sample every `every` steps
    done = 0

    def add(r: TraceRequest) -> None:
        if r.input_length >= max_model_len:
            result.num_rejected += 1
            return
        scheduler.new_request(r.request_id, r.prompt_token_ids(),
                              SamplingParams(max_tokens=out_len(r), ignore_eos=True))
        if r.output_tokens is not None:
            replies[r.request_id] = r.output_tokens
            result.requests_with_replies += 1
        arrived_at[r.request_id] = clock
        result.prompt_tokens += r.input_length
        result.num_requests += 1

    idle_steps = 0
    while pending or scheduler.has_requests():
        if max_steps is not None and result.num_steps >= max_steps:
            break
        if arrivals == "order":
            while pending and not scheduler.has_unfinished_requests():
                add(pending.popleft())
                done += 1
        else:
            if pending and not scheduler.has_requests():
                clock = max(clock, pending[0].arrival_s)
            while pending and pending[0].arrival_s <= clock:
                add(pending.popleft())
                done += 1
        if not scheduler.has_requests():
            continue
        step = core.step()
        output = step.scheduler_output
        for rid in (r.req_id for r in output.scheduled_new_reqs):
            result.queue_delays_s.append(clock - arrived_at.pop(rid))
        for request in step.finished:
            observer.on_finished(request)
            replies.pop(request.request_id, None)
            result.output_tokens += len(request.output_token_ids)
            nxt = followups.pop(request.request_id, None)
            if nxt is not None:
                # The next turn: the finished one's tokens, made into a prompt, now.
                tokens = nxt.prompt_from(list(request.all_token_ids))
                pending.appendleft(TraceRequest(nxt.request_id, len(tokens), nxt.max_tokens,
                                                clock, tokens=tokens))
                total += 1
        scheduler.step_records.clear()        # kept by the scheduler for tests; not needed
        idle_steps = 0 if output.total_num_scheduled_tokens else idle_steps + 1
        if idle_steps > MAX_IDLE_STEPS:
            num_waiting = len(scheduler.waiting) + len(scheduler.skipped_waiting)
            raise ValueError(
                f"no token was scheduled for {MAX_IDLE_STEPS} steps in a row at step "
                f"{result.num_steps}, with {num_waiting} request(s) waiting and "
                f"{len(scheduler.running)} running: the scheduler "
                "is stalled (vLLM's would idle the same way); the pool or the scheduler "
                "limits cannot admit what is waiting")
        clock += step_time.seconds(output.total_num_scheduled_tokens)
        if result.num_steps % every == 0:
            result.timeline.append((clock, observer.manager.usage, len(scheduler.running),
                                    len(scheduler.waiting) + len(scheduler.skipped_waiting),
                                    scheduler.stats.num_preemptions))
            if len(result.timeline) >= max_timeline:
                result.timeline = result.timeline[::2]
                every *= 2
        result.num_steps += 1
        if on_progress is not None and result.num_steps % 256 == 0:
            on_progress(done, total)
    if on_progress is not None:
        on_progress(done, total)
    while worker is not None and scheduler.connector.has_pending_stores():
        core.step()                           # empty steps until the stores land

    inner = observer.manager
    stats = inner.prefix_cache_stats
    result.prefix_cache_queries, result.prefix_cache_hits = stats.queries, stats.hits
    result.preempted_prefix_cache_queries = stats.preempted_queries
    result.preempted_prefix_cache_hits = stats.preempted_hits
    result.prompt_tokens_computed = scheduler.stats.prompt_tokens_computed
    result.num_preemptions = scheduler.stats.num_preemptions
    result.per_request_hits = dict(observer.ledger.hit_once)
    result.prompt_tokens_cached_once = sum(observer.ledger.hit_once.values())
    result.misses_by_cause = {c: observer.ledger.by_cause.get(c, 0) for c in CAUSES}
    if worker is not None:
        result.prompt_tokens_from_host = scheduler.stats.prompt_tokens_external
        result.prompt_tokens_from_host_once = sum(observer.ledger.host_once.values())
        result.kv_offloading_size = kv_offloading_size
        result.num_cpu_blocks = scheduler.connector.num_cpu_blocks
        result.host_blocks_stored = worker.stats.num_saved_blocks
        result.host_blocks_loaded = worker.stats.num_loaded_blocks
        result.free_cpu_blocks_at_end = scheduler.connector.cpu_block_pool.get_num_free_blocks()
        result.tier_holds_at_end = sum(map(len, scheduler.connector.gpu_blocks_held()))
    result.free_gpu_blocks_at_end = inner.block_pool.get_num_free_blocks()
    # Rule S1: the causes sum to the prompt tokens computed.
    assert sum(result.misses_by_cause.values()) == result.prompt_tokens_computed, \
        (result.misses_by_cause, result.prompt_tokens_computed)
    result.simulated_seconds = clock
    result.wall_seconds = time.perf_counter() - started
    return result
