"""The scheduler: which requests run this step, and how many tokens each.

Mirrors ``vllm/v1/core/sched/scheduler.py`` (v0.25.1), FCFS policy, without
encoder inputs, LoRA and structured output; speculative decoding only with draft
tokens that need no KV lookahead slots (the n-gram proposer), with vLLM's
padding of a one-token admission to ``1 + k`` tokens. Async scheduling is the
subclass in ``async_scheduler.py``. What is left is the part that drives the
KV cache manager, in vLLM's order and with vLLM's calls; vLLM's own decisions,
recorded (``tests/engine/vllm_scheduler_traces/``), replay on it with 0
divergent steps.

There is no prefill phase and no decode phase. Each request has
``num_computed_tokens`` (tokens whose KV is in the cache, or will be once
this step runs) and ``num_tokens_with_spec`` (prompt + outputs + draft
tokens), and each step gives a request some of the difference: a whole or
cut prompt, one decode token, a decode token plus drafts, or a resumed
request's recomputation are all the same thing, the first number catching up
with the second::

    schedule()
      1. RUNNING requests, in admission order. Each wants
         num_tokens_with_spec - num_computed_tokens tokens (1 when decoding,
         1 + k with k draft tokens; a chunk
         when its prefill was cut), capped by long_prefill_token_threshold,
         the step's token budget and max_model_len - 1. (Async scheduling
         adds the in-flight tokens, num_output_placeholders.)
         allocate_slots(req, n) -> None means the pool is full: preempt the
         LAST-ADMITTED running request, the tail of the running list (free
         its blocks, num_computed_tokens = 0, back to the FRONT of the
         waiting queue) and try again. A resumed request joins the tail, so
         it is the next victim however old it is. If the victim is the
         request itself, it is preempted and the loop stops.
      2. WAITING requests, only if nobody was preempted this step, while
         there is budget and fewer than max_num_seqs are running:
         get_computed_blocks(req) finds the prefix hit (when the request
         has no computed tokens), then
         allocate_slots(req, n, num_hit, hit_blocks,
                        full_sequence_must_fit=scheduler_reserve_full_isl,
                        has_scheduled_reqs=bool(running))
         -> None stops admission: with the gate (vLLM's default) when the
         blocks for all the request's tokens (its whole prompt; for a
         resumed request prompt and outputs so far) do not fit now, so a
         long prompt is not prefilled part way and then preempted; and the
         manager's watermark keeps a share of the pool free for requests
         already running. With k-token speculation (and no per-batch-size
         draft count: vLLM pads only when its dynamic_sd_lookup is None,
         which kvref never sets), a request left with one
         token to compute while the batch is all decodes is padded to 1 + k
         tokens with -1 drafts; if 1 + k does not fit the budget or
         max_model_len, admission stops.
         Admitted: RUNNING, num_computed_tokens = num_hit.
      3. Every scheduled request's num_computed_tokens += its tokens now,
         so a cut prefill continues next step without waiting for the model.
    update_from_output(output)
      roll num_computed_tokens back over rejected draft tokens, append each
      sampled token, check_stop, and free finished requests.
    update_draft_token_ids(drafts)
      draft tokens for the next step (decoding requests only).

With a KV connector (``kv_transfer_config``; ``kvref/distributed/``) the
waiting loop asks it for external hits after the local one, and the rest is
vLLM's connector path (the methods under "KV connector" below)::

      num_ext, load_async = connector.get_num_new_matched_tokens(req, num_hit)
      num_computed = num_hit + num_ext          # external hits follow local ones
      load_async:  allocate_slots(req, 0, ..., num_ext, delay_cache_blocks=True,
                                  reserved_blocks=<what in-flight prefills still need>)
                   -> WAITING_FOR_REMOTE_KVS in skipped_waiting, no tokens this step;
                   when the worker reports it received: cache its blocks, WAITING again
                   (a full prompt recomputes its last token), admitted like any other
      otherwise:   allocate_slots(req, n, ..., num_ext); loaded before the forward
      connector.update_state_after_alloc(req, its blocks, num_ext)
    schedule() ends with output.kv_connector_metadata = connector.build_connector_meta(output)
    update_from_output: invalid (failed) blocks -> back to the first of them
      ("recompute") or FINISHED_ERROR ("fail"); finished sends free held blocks;
      then connector.get_kv_connector_stats() and connector.take_events() (published
      with the manager's events, ``take_events``)
    a finishing request: connector.request_finished(req, block_ids) may hold its blocks
      (request_finished_all_groups(req, ids per group) with SupportsHMA: hybrid models)
    also: connector.bind_gpu_block_pool(pool) once at construction,
      connector.on_new_request(req) in add_request, and
      connector.has_pending_push_work() keeps has_requests() true

Use it with any runner that turns a ``SchedulerOutput`` (``kvref/sched/output.py``)
into a ``ModelRunnerOutput`` (``kvref/outputs.py``), stepped by ``EngineCore``
(``kvref/engine/core.py``): ``kvref.worker.gpu_model_runner.GPUModelRunner`` runs a real model;
``kvref.worker.model_free_runner.ModelFreeRunner`` emits deterministic tokens
with no model at all::

    >>> from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
    ...                    KVCacheManager)
    >>> from kvref.engine.core import engine_step
    >>> from kvref.worker.model_free_runner import ModelFreeRunner
    >>> config = KVCacheConfig(16, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    >>> manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
    ...                          hash_block_size=4)
    >>> scheduler = Scheduler(manager, max_num_batched_tokens=8, max_num_seqs=4)
    >>> _ = scheduler.new_request("a", list(range(10)), SamplingParams(max_tokens=3))
    >>> runner = ModelFreeRunner(vocab_size=100)
    >>> while scheduler.has_unfinished_requests():
    ...     _ = engine_step(scheduler, runner)
    >>> [r.num_scheduled_tokens for r in scheduler.step_records]   # chunked prefill
    [{'a': 8}, {'a': 2}, {'a': 1}, {'a': 1}]

API summary (what other code relies on):
    ``Scheduler(kv_cache_manager, max_num_batched_tokens, max_num_seqs=128,
    max_model_len=None, long_prefill_token_threshold=0,
    enable_chunked_prefill=True, eos_token_id=None, *,
    scheduler_reserve_full_isl=True, num_speculative_tokens=0, kv_consumer=False,
    kv_transfer_config=None, disable_hybrid_kv_cache_manager=None)``
    (``connector``: its scheduler half, or None);
    ``new_request(request_id, prompt_token_ids, sampling_params) -> EngineRequest``
    or ``add_request(EngineRequest)``; ``schedule() -> SchedulerOutput``;
    ``update_from_output(scheduler_output, model_runner_output) -> list[EngineRequest]``
    (the requests that finished); ``update_draft_token_ids({req_id: draft})``;
    ``finish_requests(ids, status)`` (abort);
    ``has_unfinished_requests()``, ``has_requests()`` (also finished ones not yet
    reported); ``take_events()`` (the KV cache events published after each step);
    ``running``, ``waiting``, ``requests``;
    ``step_records`` (one ``StepRecord`` per step: scheduled tokens, admitted,
    resumed, preempted, finished, prefix-hit tokens, free blocks) and ``stats``
    (``SchedulerStats``: totals over the run).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvref import (HybridKVCacheCoordinator, KVCacheBlocks, KVCacheManager, RequestStatus,
                   get_request_block_hasher, init_none_hash, sha256)
from kvref.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory, KVTransferConfig, resolve_disable_hybrid_kv_cache_manager)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorOutput,
                                                                KVConnectorRole, SupportsHMA)
from kvref.outputs import ModelRunnerOutput
from kvref.request import EngineRequest
from kvref.sampling_params import SamplingParams
from kvref.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvref.sched.utils import check_stop
from kvref.math_utils import cdiv
from kvref.stats import PrefixCacheStats

__all__ = ["Scheduler", "SchedulerStats", "StepRecord"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# What happened (for tests, the visualizer and llm.stats)


@dataclass(slots=True)
class StepRecord:
    """One step as the scheduler saw it."""

    step: int
    num_scheduled_tokens: dict[str, int]
    admitted: list[str]                   # new requests that got their first tokens
    resumed: list[str]                    # preempted requests admitted again
    preempted: list[str]
    prefix_hit_tokens: dict[str, int]     # admitted/resumed: tokens served by the cache
    num_free_blocks: int                  # after scheduling
    num_running: int
    num_waiting: int
    # Filled by update_from_output: who finished, and the tokens each request took.
    finished: list[str] = field(default_factory=list)
    sampled: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class SchedulerStats:
    """Totals over the scheduler's life.

    Every prompt token is either computed, served by the prefix cache or
    brought by a KV connector, once per admission: ``prompt_tokens_computed +
    prompt_tokens_cached + prompt_tokens_external`` equals the prompt lengths
    summed, plus what preemption (or a failed KV load) made the engine do again.
    """

    num_steps: int = 0
    num_requests: int = 0
    num_prompt_tokens: int = 0            # prompt lengths of the requests added
    num_preemptions: int = 0
    num_finished: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_external: int = 0       # loaded by the KV connector
    num_kv_load_failures: int = 0         # requests whose KV load failed (either policy)
    total_tokens_scheduled: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # kvref's counts (vLLM keeps none): admissions padded to 1 + k with -1
    # drafts, and admissions stopped because 1 + k did not fit.
    num_padded_admissions: int = 0
    num_padding_refusals: int = 0


@dataclass(slots=True)
class _StepState:
    """What one ``schedule()`` has decided so far, handed from step to step of it.

    vLLM keeps these as locals of its ``schedule`` (``scheduler.py:409-427``);
    ``prefix_hit_tokens`` and ``skipped`` (vLLM's ``step_skipped_waiting``,
    ``scheduler.py:638``) are the only additions.
    """

    token_budget: int                     # tokens left to hand out this step
    scheduled_new: list[EngineRequest] = field(default_factory=list)
    scheduled_resumed: list[EngineRequest] = field(default_factory=list)
    scheduled_running: list[EngineRequest] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Whether a running request scheduled this step is still prefilling.
    prefill_scheduled: bool = False
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)   # for the StepRecord
    # Waiting requests passed over this step (loading, or told to ask again).
    skipped: list[EngineRequest] = field(default_factory=list)


class _ComputedTokens(NamedTuple):
    """A waiting request's computed tokens as the waiting loop found them."""

    new_computed_blocks: KVCacheBlocks    # the local hit's blocks
    num_new_local_computed_tokens: int    # the local hit
    num_external_computed_tokens: int     # what the connector brings after it
    num_computed_tokens: int              # the two together
    load_kv_async: bool                   # the connector loads them asynchronously


# ---------------------------------------------------------------------------


class Scheduler:
    """FCFS continuous batching over a ``KVCacheManager``.

    Args:
        kv_cache_manager: the manager whose blocks this scheduler hands out.
        max_num_batched_tokens: the token budget of one step.
        max_num_seqs: most requests RUNNING at once.
        max_model_len: longest sequence (default: the manager's).
        long_prefill_token_threshold: if > 0, a request gets at most this many
            tokens per step (so long prompts share steps with decodes).
        enable_chunked_prefill: if False, a waiting request whose prompt does
            not fit the remaining budget stops admission instead of being cut.
        eos_token_id: end-of-sequence id given to requests made by ``new_request``.
        scheduler_reserve_full_isl: admit a waiting request only if the blocks
            for all its tokens fit now (the full input sequence: the prompt,
            plus the outputs so far of a resumed request; vLLM's
            ``SchedulerConfig`` field of that name, True by default), passed to
            the manager as ``allocate_slots(..., full_sequence_must_fit=...)``.
            False admits the chunk that fits this step, and a long prompt may
            be prefilled part way, then preempted.
        num_speculative_tokens: k, the drafts per step of the engine's proposer
            (0: no speculation). A waiting request with one token left to
            compute is then scheduled as ``1 + k`` tokens with ``-1`` drafts
            (vLLM's padding to the uniform decode shape); see
            ``_num_new_tokens_waiting``.
        kv_consumer: a KV connector loads KV into this engine's blocks (vLLM's
            ``kv_transfer_config.is_kv_consumer``). With more than one batch in
            flight (``AsyncScheduler``) the blocks of a request freed while a
            step that writes them is still running go back to the pool only
            once that step's output is processed (vLLM's ``defer_block_free``).
        kv_transfer_config: a ``KVTransferConfig``: the scheduler builds the
            connector's SCHEDULER half (``self.connector``; None without); a
            consumer's config sets ``kv_consumer``.
        disable_hybrid_kv_cache_manager: vLLM's ``SchedulerConfig`` field, for
            the connector: None decides it as vLLM does
            (``resolve_disable_hybrid_kv_cache_manager``); False with a
            connector without ``SupportsHMA`` is refused. (The KV cache groups
            themselves come with ``kv_cache_manager``.)
    """

    # Batches in flight at once: 1 here, 2 for the AsyncScheduler (vLLM's
    # VllmConfig.max_concurrent_batches without pipeline parallelism).
    max_concurrent_batches = 1

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int = 128, max_model_len: int | None = None,
                 long_prefill_token_threshold: int = 0, enable_chunked_prefill: bool = True,
                 eos_token_id: int | None = None, *, scheduler_reserve_full_isl: bool = True,
                 num_speculative_tokens: int = 0, kv_consumer: bool = False,
                 kv_transfer_config: KVTransferConfig | None = None,
                 disable_hybrid_kv_cache_manager: bool | None = None) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{long_prefill_token_threshold}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got "
                             f"{num_speculative_tokens}")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_scheduled_tokens = max_num_batched_tokens
        self.max_num_running_reqs = max_num_seqs
        self.max_model_len = max_model_len or kv_cache_manager.max_model_len
        if self.max_model_len > kv_cache_manager.max_model_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the manager's "
                             f"{kv_cache_manager.max_model_len}")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_id = eos_token_id
        self.scheduler_reserve_full_isl = scheduler_reserve_full_isl
        self.num_spec_tokens = num_speculative_tokens
        # Requests hash their blocks as they grow; the manager looks hits up by them.
        if getattr(sys.modules[init_none_hash.__module__], "NONE_HASH", None) is None:
            init_none_hash(sha256)                # vLLM's engine seeds it once at start
        self.block_hasher = get_request_block_hasher(
            kv_cache_manager.block_pool.hash_block_size, sha256)

        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        # Requests blocked on something outside the scheduler (a KV load in flight);
        # FCFS looks at them before ``waiting`` (vLLM's ``skipped_waiting``).
        self.skipped_waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        # Requests admitted and still prefilling, or loading KV asynchronously: the
        # blocks they will still take are kept from a new asynchronous load
        # (``reserved_blocks``; why: ``_inflight_prefill_reserved_blocks``).
        self._inflight_prefills: set[EngineRequest] = set()

        self._init_kv_connector(kv_transfer_config, disable_hybrid_kv_cache_manager)

        self.finished_req_ids: set[str] = set()
        # Every request preempted since the last schedule(), by it or by a reset:
        # the next output's preempted_req_ids (vLLM's reset_preempted_req_ids).
        self.reset_preempted_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.step_records: list[StepRecord] = []
        self._records_in_flight: dict[int, StepRecord] = {}   # id(SchedulerOutput) -> record
        self.stats = SchedulerStats()
        # What update_from_output publishes: the KV cache events of each step
        # (``take_events``), and the connector's stats of the last step.
        self.kv_event_batches: list[list] = []
        self.kv_connector_stats = None

        # Deferred frees (vLLM's fence, scheduler.py:146-152). Why: with more than
        # one batch in flight, a step still running may write the KV blocks of a
        # request freed meanwhile (aborted, preempted, failed). Handed to another
        # request, a block is normally written only by a later step, which the
        # device runs after the earlier one; but a consumer connector fills the
        # blocks of a new request by a load outside the step stream, not ordered
        # against that write, so the stale write could land on the loaded KV.
        # vLLM defers whenever max_concurrent_batches > 1 (async scheduling, or
        # pipeline parallelism: config/vllm.py:492-502, which kvref does not model)
        # and the role consumes (kv_consumer or kv_both: config/kv_transfer.py:12).
        # Counted: steps scheduled and steps processed, over steps that schedule
        # tokens, and the blocks waiting for a step to be processed, as (step the
        # blocks wait for, blocks).
        self.kv_consumer = kv_consumer or (kv_transfer_config is not None
                                           and kv_transfer_config.is_kv_consumer)
        self.defer_block_free = self.kv_consumer and self.max_concurrent_batches > 1
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list]] = deque()

    def _init_kv_connector(self, kv_transfer_config: KVTransferConfig | None,
                           disable_hybrid_kv_cache_manager: bool | None) -> None:
        """The KV connector (vLLM's KVTransfer), scheduler side, and its state
        (vLLM's ``scheduler.py:126-144, 200, 276-280``)."""
        self.connector = None
        self.recompute_kv_load_failures = True
        if kv_transfer_config is not None:
            self.connector = KVConnectorFactory.create_connector(
                kv_transfer_config, KVConnectorRole.SCHEDULER,
                self.kv_cache_manager.kv_cache_config,
                disable_hybrid_kv_cache_manager=resolve_disable_hybrid_kv_cache_manager(
                    kv_transfer_config, disable_hybrid_kv_cache_manager))
            self.recompute_kv_load_failures = \
                kv_transfer_config.kv_load_failure_policy == "recompute"
            # Once, now that the manager exists (vLLM builds it after the connector).
            self.connector.bind_gpu_block_pool(self.kv_cache_manager.block_pool)
        # Tokens asked of the connector beyond the local hit, and those it had.
        self.connector_prefix_cache_stats = PrefixCacheStats() if self.connector else None
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self._async_local_hits: dict[str, int] = {}   # req -> local hit when its load began

    # -- requests in and out -------------------------------------------------

    def new_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None) -> EngineRequest:
        """Make a request with this scheduler's block hasher and EOS, and add it."""
        request = EngineRequest(request_id, list(prompt_token_ids), sampling_params,
                                eos_token_id=self.eos_token_id, block_hasher=self.block_hasher)
        self.add_request(request)
        return request

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request at the back of the waiting queue."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt of {request.num_tokens} "
                             f"tokens leaves no room to generate (max_model_len "
                             f"{self.max_model_len})")
        self.waiting.append(request)
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.on_new_request(request)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += request.num_prompt_tokens

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests from outside (an abort): dequeue and free them."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        # A set, as vLLM makes it: several requests end in its iteration order
        # (which depends on PYTHONHASHSEED, for request-id strings).
        ids = [request_ids] if isinstance(request_ids, str) else set(request_ids)
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            delay_free_blocks = False
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.skipped_waiting:
                self.skipped_waiting.remove(request)
            else:
                self.waiting.remove(request)
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its load is still writing into its blocks: free them when it ends.
                delay_free_blocks = request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request_id)
                self.failed_recving_kv_req_ids.discard(request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free_blocks)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)


    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished since the last ``schedule()`` (the next output must still report
        them), or finished with blocks a KV connector still holds (sending their KV)."""
        return bool(self.finished_req_ids) or \
            len(self.requests) > self.get_num_unfinished_requests()

    def has_requests(self) -> bool:
        """Whether the engine must step again (vLLM's ``has_requests``): unfinished
        requests, or finished ones no ``SchedulerOutput`` has reported yet (so
        vLLM's engine runs one more, empty, step after the last request ends), or
        a connector with push work still in flight."""
        return (self.has_unfinished_requests() or self.has_finished_requests()
                or (self.connector is not None and self.connector.has_pending_push_work()))

    # -- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and tokens; allocate their KV blocks.

        vLLM's ``schedule`` (``scheduler.py:396-1133``), told in its three
        parts, each a method below that names its vLLM lines: the RUNNING
        requests, the WAITING ones, the output. What the step has decided so
        far (the token budget, who is scheduled with how many tokens, who was
        preempted) travels between them in one ``_StepState``. The module's
        docstring draws the whole step.
        """
        step = _StepState(token_budget=self.max_num_scheduled_tokens)
        self.kv_cache_manager.new_step_starts()

        # 1. RUNNING requests first, in the order they were admitted.
        self._schedule_running(step)
        # 2. WAITING requests, unless this step had to preempt (the pool is tight).
        if not step.preempted:
            self._schedule_waiting(step)

        # 3. The output, the connector's plan for it, then every scheduled
        #    request advances.
        output = self._make_scheduler_output(step)
        if self.connector is not None:
            # Plans this step's loads and saves; resets the connector's per-step
            # state (vLLM's scheduler.py:1111-1117).
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self._record_step(output, step.scheduled_new, step.scheduled_resumed, step.preempted,
                          step.prefix_hit_tokens)
        # The fence counts only steps that write KV (whose output comes back;
        # vLLM's scheduler.py:1126-1129).
        if self.defer_block_free and output.total_num_scheduled_tokens > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(output)
        return output

    # -- 1. running requests ---------------------------------------------------

    def _schedule_running(self, step: _StepState) -> None:
        """The RUNNING requests, in admission order (vLLM's ``scheduler.py:440-634``).

        Each gets the tokens it still lacks, capped; a full pool preempts from
        the tail of ``running`` until the request fits or preempts itself.
        """
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            if self._in_flight_steps_reach_max_tokens(request):
                req_index += 1
                continue
            num_new_tokens = self._num_new_tokens_running(request, step.token_budget)
            if num_new_tokens <= 0:
                # Nothing to do for it now; later requests may still run (not strict FCFS).
                req_index += 1
                continue

            new_blocks = self._allocate_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                break
            self._schedule_running_request(request, num_new_tokens, new_blocks, step)
            req_index += 1

    @staticmethod
    def _in_flight_steps_reach_max_tokens(request: EngineRequest) -> bool:
        """Async scheduling: the steps in flight already reach max_tokens even if
        all their drafts are rejected (placeholders minus the one sampled token
        are drafts), so another step would only be thrown away (vLLM's
        ``scheduler.py:445-459``). Never true without placeholders."""
        return (request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens)

    def _num_new_tokens_running(self, request: EngineRequest, token_budget: int) -> int:
        """What a running request still lacks, capped by the threshold, the budget
        and max_model_len - 1 (vLLM's ``scheduler.py:473-489``)."""
        # Placeholders: tokens of steps in flight, counted in num_computed_tokens
        # but not yet in num_tokens (always 0 without async scheduling).
        num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                          - request.num_computed_tokens)
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        num_new_tokens = min(num_new_tokens, token_budget,
                             self.max_model_len - 1 - request.num_computed_tokens)
        return num_new_tokens

    def _allocate_or_preempt(self, request: EngineRequest, num_new_tokens: int,
                             step: _StepState) -> KVCacheBlocks | None:
        """``allocate_slots``, preempting until it fits (vLLM's ``scheduler.py:532-582``).

        None: the request preempted itself, and the running loop stops.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            # Out of blocks: recompute-preempt the last-admitted running request.
            victim = self.running.pop()
            self._preempt_request(victim)
            step.preempted.append(victim)
            if victim is request:
                return None                       # it preempted itself: nothing left to free

    def _schedule_running_request(self, request: EngineRequest, num_new_tokens: int,
                                  new_blocks: KVCacheBlocks, step: _StepState) -> None:
        """Count a running request in, with the drafts that fit (vLLM's
        ``scheduler.py:584-609``)."""
        step.scheduled_running.append(request)
        step.prefill_scheduled |= request.is_prefill_chunk
        step.req_to_new_blocks[request.request_id] = new_blocks
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.token_budget -= num_new_tokens

        if request.spec_token_ids:
            # The drafts that fit after the real tokens (the budget may cut them).
            num_spec = (num_new_tokens + request.num_computed_tokens - request.num_tokens
                        - request.num_output_placeholders)
            if num_spec > 0:
                step.scheduled_spec_decode_tokens[request.request_id] = \
                    list(request.spec_token_ids[:num_spec])
            request.spec_token_ids = []           # the runner proposes fresh ones

    # -- 2. waiting requests ---------------------------------------------------

    def _schedule_waiting(self, step: _StepState) -> None:
        """The WAITING requests, first come first served (vLLM's ``scheduler.py:636-1015``).

        The queue of requests blocked on a load (``skipped_waiting``) is looked
        at first. For each: find its computed tokens (local hit, then the
        connector's), decide its tokens, allocate; an asynchronous load is
        parked, anything else is admitted. A request that does not fit stops
        admission and stays first in line.
        """
        while (self.waiting or self.skipped_waiting) and step.token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            queue = self.skipped_waiting or self.waiting
            request = queue[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS \
                    and not self._try_promote_blocked_waiting_request(request):
                step.skipped.append(queue.popleft())      # still loading
                continue

            hit = self._get_computed_tokens(request)
            if hit is None:
                step.skipped.append(queue.popleft())      # ask again next step
                continue
            num_new_tokens, pad_spec_decode = self._num_new_tokens_waiting(request, hit, step)
            if num_new_tokens is None:
                break                             # 1 + k, or an uncut prompt, does not fit
            if not self._allocate_waiting(request, hit, num_new_tokens):
                break                             # no room: it stays first in line

            queue.popleft()
            if hit.load_kv_async:
                self._park_async_load(request, hit, step)
                continue
            self._admit_waiting(request, hit, num_new_tokens, pad_spec_decode, step)
        # Skipped requests keep their order, ahead of the rest next step.
        self.skipped_waiting.extendleft(reversed(step.skipped))

    def _get_computed_tokens(self, request: EngineRequest) -> _ComputedTokens | None:
        """A waiting request's computed tokens: the local prefix hit, then what a
        connector brings after it (vLLM's ``scheduler.py:682-790``).

        None: the connector cannot tell yet; the request is asked again next step.
        """
        manager = self.kv_cache_manager
        if request.num_computed_tokens:
            # A request whose asynchronous load landed: its tokens are computed.
            return _ComputedTokens(manager.empty_kv_cache_blocks, 0, 0,
                                   request.num_computed_tokens, False)
        if self.connector is not None and manager.kv_cache_config.has_mamba_layers \
                and isinstance(manager.coordinator, HybridKVCacheCoordinator):
            new_computed_blocks, num_new_local_computed_tokens = \
                self._mamba_hybrid_local_hit(request)
        else:
            new_computed_blocks, num_new_local_computed_tokens = \
                manager.get_computed_blocks(request)
        num_external_computed_tokens = 0
        load_kv_async = False
        if self.connector is not None:
            num_external, load_kv_async = self.connector.get_num_new_matched_tokens(
                request, num_new_local_computed_tokens)
            if num_external is None:
                return None
            num_external_computed_tokens = num_external
        num_computed_tokens = num_new_local_computed_tokens + num_external_computed_tokens
        assert num_computed_tokens <= request.num_tokens
        return _ComputedTokens(new_computed_blocks, num_new_local_computed_tokens,
                               num_external_computed_tokens, num_computed_tokens,
                               load_kv_async)

    def _mamba_hybrid_local_hit(self, request: EngineRequest) -> tuple[KVCacheBlocks, int]:
        """The local hit of a Mamba hybrid with a connector (vLLM's ``scheduler.py:689-722``).

        Each group's own hit, no agreement between groups; the local hit handed
        to the connector is the longest of them (the full-attention one), so it
        brings only what follows. Unlike get_computed_blocks,
        skip_reading_prefix_cache is not checked here (nor in vLLM); with
        caching off the coordinator is not the hybrid one, so this path is not
        taken.
        """
        manager = self.kv_cache_manager
        computed, per_group_hits = manager.coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1)
        new_computed_blocks = manager.create_kv_cache_blocks(computed)
        num_new_local_computed_tokens = max(per_group_hits)
        if manager.log_stats:
            manager.prefix_cache_stats.record(
                num_tokens=request.num_tokens, num_hits=num_new_local_computed_tokens,
                preempted=request.num_preemptions > 0)
        return new_computed_blocks, num_new_local_computed_tokens

    def _num_new_tokens_waiting(self, request: EngineRequest, hit: _ComputedTokens,
                                step: _StepState) -> tuple[int | None, bool]:
        """A waiting request's tokens this step, and whether they are padded to
        ``1 + k`` (vLLM's ``scheduler.py:797-843``). None: admission stops."""
        if hit.load_kv_async:
            return 0, False                       # nothing computes until the KV lands
        pad_spec_decode = False
        # num_tokens, not the prompt: a resumed request recomputes its outputs.
        num_new_tokens = request.num_tokens - hit.num_computed_tokens
        if (self.num_spec_tokens > 0 and num_new_tokens == 1
                and step.scheduled_running and not step.prefill_scheduled):
            # One token left (a prefix hit of all but the last token, new or
            # resumed) while the batch is all decodes: vLLM schedules it as a
            # decode with k draft slots of -1, so the batch keeps one shape
            # (1 + k per request: a full CUDA graph). Rather than admit it
            # unpadded, admission stops when 1 + k does not fit.
            num_new_tokens = 1 + self.num_spec_tokens
            if (num_new_tokens > step.token_budget
                    or hit.num_computed_tokens + num_new_tokens > self.max_model_len):
                self.stats.num_padding_refusals += 1
                return None, False
            pad_spec_decode = True
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        if not self.enable_chunked_prefill and num_new_tokens > step.token_budget:
            return None, False
        num_new_tokens = min(num_new_tokens, step.token_budget)
        # Fails when a connector offered a synchronous hit of the whole
        # sequence (a full hit must leave the last token to compute).
        assert num_new_tokens > 0, request.request_id
        return num_new_tokens, pad_spec_decode

    def _allocate_waiting(self, request: EngineRequest, hit: _ComputedTokens,
                          num_new_tokens: int) -> bool:
        """``allocate_slots`` for a waiting request, then tell the connector
        (vLLM's ``scheduler.py:896-945``). False: no room."""
        manager = self.kv_cache_manager
        # An async load holds its blocks with no progress until it lands: admit
        # it only if the in-flight prefills can still finish after it.
        reserved_blocks = self._inflight_prefill_reserved_blocks() \
            if hit.load_kv_async else 0
        new_blocks = manager.allocate_slots(
            request, num_new_tokens,
            num_new_computed_tokens=hit.num_new_local_computed_tokens,
            new_computed_blocks=hit.new_computed_blocks,
            num_external_computed_tokens=hit.num_external_computed_tokens,
            delay_cache_blocks=hit.load_kv_async,
            full_sequence_must_fit=self.scheduler_reserve_full_isl,
            reserved_blocks=reserved_blocks,
            has_scheduled_reqs=bool(self.running))
        if new_blocks is None:
            return False

        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, manager.get_blocks(request.request_id),
                hit.num_external_computed_tokens)
            if request.num_computed_tokens == 0:
                self.connector_prefix_cache_stats.record(
                    num_tokens=request.num_tokens - hit.num_new_local_computed_tokens,
                    num_hits=hit.num_external_computed_tokens,
                    preempted=request.num_preemptions > 0)
        return True

    def _park_async_load(self, request: EngineRequest, hit: _ComputedTokens,
                         step: _StepState) -> None:
        """Blocks allocated, uncached; the request waits for its KV in
        ``skipped_waiting`` (vLLM's ``scheduler.py:947-967``)."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = hit.num_computed_tokens
        self._async_local_hits[request.request_id] = hit.num_new_local_computed_tokens
        self._count_prompt_tokens_cached(request, hit.num_new_local_computed_tokens)
        step.prefix_hit_tokens[request.request_id] = hit.num_new_local_computed_tokens
        self._inflight_prefills.add(request)
        step.skipped.append(request)

    def _admit_waiting(self, request: EngineRequest, hit: _ComputedTokens,
                       num_new_tokens: int, pad_spec_decode: bool, step: _StepState) -> None:
        """A waiting request becomes RUNNING (vLLM's ``scheduler.py:969-996``)."""
        self.running.append(request)
        if request.status == RequestStatus.WAITING:
            step.scheduled_new.append(request)
        elif request.status == RequestStatus.PREEMPTED:
            step.scheduled_resumed.append(request)
        else:
            raise RuntimeError(f"invalid status {request.status.name} in the "
                               f"waiting queue for {request.request_id!r}")
        step.req_to_new_blocks[request.request_id] = \
            self.kv_cache_manager.get_blocks(request.request_id)
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.token_budget -= num_new_tokens
        request.status = RequestStatus.RUNNING
        num_computed_tokens = hit.num_computed_tokens
        if request.request_id in self._async_local_hits:
            # Its load landed: what it skips beyond the local hit came from outside.
            local = self._async_local_hits.pop(request.request_id)
            self._count_prompt_tokens_external(request, local, num_computed_tokens)
        else:
            local = hit.num_new_local_computed_tokens
            step.prefix_hit_tokens[request.request_id] = local
            self._count_prompt_tokens_cached(request, local)
            self._count_prompt_tokens_external(request, local, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        if pad_spec_decode:
            step.scheduled_spec_decode_tokens[request.request_id] = \
                [-1] * self.num_spec_tokens
            self.stats.num_padded_admissions += 1
        if not request.output_token_ids:
            request.num_cached_tokens = num_computed_tokens
        if num_computed_tokens + num_new_tokens < request.num_tokens:
            self._inflight_prefills.add(request)

    # -- 3. the output -----------------------------------------------------------

    def _make_scheduler_output(self, step: _StepState) -> SchedulerOutput:
        """Check the step's limits and build its ``SchedulerOutput`` (vLLM's
        ``scheduler.py:1022-1109``)."""
        manager = self.kv_cache_manager
        total = sum(step.num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens and step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        num_common_prefix_blocks = [0] * manager.num_kv_cache_groups
        if self.running:
            num_common_prefix_blocks = manager.get_num_common_prefix_blocks(
                self.running[0].request_id)

        new_reqs_data = [
            NewRequestData(req.request_id, list(req.prompt_token_ids), req.sampling_params,
                           step.req_to_new_blocks[req.request_id].get_block_ids(),
                           req.num_computed_tokens)
            for req in step.scheduled_new]
        cached_reqs_data = self._make_cached_request_data(
            step.scheduled_running, step.scheduled_resumed, step.req_to_new_blocks)
        self.prev_step_scheduled_req_ids = set(step.num_scheduled_tokens)

        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=step.scheduled_spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix; True if it was done (vLLM's
        ``scheduler.py:2196-2243``).

        The KV layer refuses while a request holds blocks (INV-RESET-1), so by
        default this is False whenever requests are running.
        ``reset_running_requests``: preempt every running request first (last
        first, so they return to the waiting queue's front in their order); they
        then recompute their KV from scratch. Under async scheduling, outputs
        still in flight for them are dropped when they arrive (their
        ``num_output_placeholders`` become ``async_tokens_to_discard``). If the
        layer still refuses (a request waiting for a KV load holds blocks), this
        raises ``RuntimeError``. ``reset_connector``: also reset the KV
        connector's own cache (``reset_connector_cache``).
        """
        if reset_running_requests:
            while self.running:
                request = self.running.pop()
                self._preempt_request(request)
                request.async_tokens_to_discard = request.num_output_placeholders
                request.num_output_placeholders = 0
            # They are resumed as if not scheduled the step before: the runner gets
            # their whole token lists again.
            self.prev_step_scheduled_req_ids.clear()
        done = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not done:
            raise RuntimeError("the prefix cache could not be reset although every running "
                               "request was preempted: a request waiting for a KV load "
                               "still holds blocks")
        if reset_connector:
            done = self.reset_connector_cache() and done
        return done

    def reset_connector_cache(self) -> bool:
        """Reset the KV connector's own cache: True with no connector, False only
        when the connector says it could not (vLLM's ``scheduler.py:2245-2266``:
        a connector that does not implement ``reset_cache`` counts as done)."""
        if self.connector is None:
            return True
        if self.connector.reset_cache() is False:
            return False
        if self.connector_prefix_cache_stats is not None:
            self.connector_prefix_cache_stats.reset = True
        return True

    def _preempt_request(self, request: EngineRequest) -> None:
        """Recompute-preemption: drop the KV, start over from the waiting queue's front.

        The caller has already taken it off ``running``. Its tokens (prompt and
        outputs so far) stay; its blocks go back to the pool, where the full
        ones stay cached, so the resumed request often hits its own prefix.
        Its ``num_output_placeholders`` stay too: the steps in flight still
        return their tokens for it.
        """
        assert request.status == RequestStatus.RUNNING, "only running requests are preempted"
        self._free_request_blocks(request)
        self._inflight_prefills.discard(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance now, before the model runs: a cut prefill can be scheduled again next step.
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            self._count_prompt_tokens_computed(request, n)
            request.num_computed_tokens += n
            if self.defer_block_free:
                request.last_sched_seq = self.sched_step_seq   # the step that writes its blocks
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            if not request.is_prefill_chunk:
                self._inflight_prefills.discard(request)
        self.stats.total_tokens_scheduled += output.total_num_scheduled_tokens
        self.stats.num_steps += 1
        # Fresh sets: the output just built keeps the old ones.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def _make_cached_request_data(self, running: list[EngineRequest],
                                  resumed: list[EngineRequest],
                                  req_to_new_blocks: dict[str, KVCacheBlocks]
                                  ) -> CachedRequestData:
        data = CachedRequestData()
        resumed_ids = {req.request_id for req in resumed}
        for req in running + resumed:
            data.req_ids.append(req.request_id)
            if req.request_id in resumed_ids:
                data.resumed_req_ids.add(req.request_id)
            if req.request_id not in self.prev_step_scheduled_req_ids:
                data.all_token_ids[req.request_id] = list(req.all_token_ids)
            data.new_block_ids.append(
                req_to_new_blocks[req.request_id].get_block_ids(allow_none=True))
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(req.num_output_tokens)
        return data

    # -- after the model ran ---------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineRequest]:
        """Append the sampled tokens, stop what is done, free it; return the finished."""
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            # This step's writes are done, and every earlier step's: blocks waiting
            # on them may go back to the pool.
            self.processed_step_seq += 1
            self._drain_deferred_frees()
        finished: list[EngineRequest] = []
        stopped_running: list[EngineRequest] = []
        stopped_preempted: list[EngineRequest] = []
        record = self._records_in_flight.pop(id(scheduler_output), None)
        kv_connector_output = model_runner_output.kv_connector_output
        failed_kv_load_req_ids: set[str] = set()
        if kv_connector_output is not None and kv_connector_output.invalid_block_ids:
            # Blocks whose external KV never arrived: their requests go back to the
            # first such block ("recompute") or are failed below ("fail").
            failed_kv_load_req_ids = self._handle_invalid_blocks(
                kv_connector_output.invalid_block_ids, scheduler_output.num_scheduled_tokens)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            assert n > 0
            if req_id in failed_kv_load_req_ids:
                continue                          # rescheduled (or failed) for a bad load
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue                          # aborted (or stopped) while the model ran
            index = model_runner_output.req_id_to_index[req_id]
            new_token_ids = list(model_runner_output.sampled_token_ids[index])
            if not new_token_ids:
                continue                          # a cut prefill samples nothing
            draft = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if draft and request.async_tokens_to_discard == 0:
                # (A frame to be discarded counts nothing: scheduler.py:1586-1592.)
                self._roll_back_rejected_drafts(request, draft, new_token_ids)
            status_before = request.status
            new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            if record is not None:
                record.sampled.setdefault(req_id, []).extend(new_token_ids)
            if stopped:
                finished.append(request)
                self._free_request(request)
                if status_before == RequestStatus.RUNNING:
                    stopped_running.append(request)
                else:
                    stopped_preempted.append(request)   # async: preempted while in flight
                if record is not None:
                    record.finished.append(request.request_id)
        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
        for request in stopped_preempted:
            self.waiting.remove(request)
        if failed_kv_load_req_ids and not self.recompute_kv_load_failures:
            failed = [self.requests[req_id] for req_id in failed_kv_load_req_ids]
            self.finish_requests(failed_kv_load_req_ids, RequestStatus.FINISHED_ERROR)
            finished.extend(failed)
            if record is not None:
                record.finished.extend(r.request_id for r in failed)
        if self.connector is not None and kv_connector_output is not None:
            # (None: a step without a forward whose connector had nothing to report.)
            self._update_from_kv_xfer_finished(kv_connector_output)
        if self.connector is not None:
            # The connector's own counters for this step (vLLM adds them to the
            # step's SchedulerStats).
            self.kv_connector_stats = self.connector.get_kv_connector_stats()
        self._publish_kv_events()
        return finished

    def _roll_back_rejected_drafts(self, request: EngineRequest, draft: list[int],
                                   new_token_ids: list[int]) -> None:
        """All but the last sampled token are accepted drafts; the slots of the
        rejected ones count as not computed (they get overwritten). vLLM's
        ``scheduler.py:1583-1610``."""
        num_accepted = len(new_token_ids) - 1
        num_rejected = len(draft) - num_accepted
        if request.num_computed_tokens > 0:       # 0: preempted meanwhile
            request.num_computed_tokens -= num_rejected
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= num_rejected
        self.stats.num_draft_tokens += len(draft)
        self.stats.num_accepted_tokens += num_accepted

    def _publish_kv_events(self) -> None:
        """The manager's KV cache events and the connector's go out together, once
        per step (vLLM publishes them as one KVEventBatch, ``scheduler.py:1802-1816``;
        with events off its publisher drops them, the connector's included)."""
        events = list(self.kv_cache_manager.take_events())
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events and self.kv_cache_manager.block_pool.enable_kv_cache_events:
            self.kv_event_batches.append(events)

    def take_events(self) -> list:
        """The KV cache events published since the last call, oldest first: the
        manager's block events and the connector's, taken after each step (none
        unless the manager was built with ``enable_kv_cache_events``)."""
        batches, self.kv_event_batches = self.kv_event_batches, []
        return [event for batch in batches for event in batch]

    def _update_request_with_output(self, request: EngineRequest, new_token_ids: list[int]
                                    ) -> tuple[list[int], bool]:
        """Append the tokens up to a stop; return those kept and whether it stopped."""
        for i, token in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token)
            if check_stop(request, self.max_model_len):
                return new_token_ids[:i], True
        return new_token_ids, False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Store each request's draft for the next step (vLLM drops drafts of prefill chunks)."""
        for req_id, draft in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = [] if request.is_prefill_chunk else list(draft)

    def _free_request(self, request: EngineRequest, delay_free_blocks: bool = False) -> None:
        """A finished request leaves; its blocks too, unless a transfer still uses
        them (then ``_free_blocks`` runs when the connector reports it done)."""
        assert request.is_finished()
        self._inflight_prefills.discard(request)
        self._async_local_hits.pop(request.request_id, None)
        connector_delay_free_blocks, request.kv_transfer_params_out = \
            self._connector_finished(request)
        self.finished_req_ids.add(request.request_id)
        self.stats.num_finished += 1
        if not (delay_free_blocks or connector_delay_free_blocks):
            self._free_blocks(request)

    def _free_blocks(self, request: EngineRequest) -> None:
        assert request.is_finished()
        self._free_request_blocks(request)
        del self.requests[request.request_id]

    def _free_request_blocks(self, request: EngineRequest) -> None:
        """Give a request's blocks back, or, when a step still in flight may write
        them and a KV consumer could refill them, park them until that step is
        processed (``pop_blocks_for_free`` takes them off the request now).

        Why: a KV consumer's load into a reused block is not ordered against the
        in-flight step's write to it (see ``defer_block_free`` in ``__init__``;
        vLLM's ``scheduler.py:146-152, 2130-2143``)."""
        if not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq:
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _drain_deferred_frees(self) -> None:
        """Free the parked blocks whose step has been processed (oldest first)."""
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            # Reversed, as a free does: the tail of a request is evicted first.
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))

    def deferred_blocks(self) -> list[list]:
        """The block lists parked by deferred frees (for the invariant checker:
        ``check_kv_cache_manager(manager, popped_blocks=scheduler.deferred_blocks())``)."""
        return [blocks for _, blocks in self.deferred_frees]

    # -- KV connector ------------------------------------------------------------

    def _connector_finished(self, request: EngineRequest) -> tuple[bool, dict | None]:
        """Tell the connector a request ended; it may keep the blocks (a producer sending)."""
        if self.connector is None:
            return False, None
        manager = self.kv_cache_manager
        manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens,
                                      request.num_prompt_tokens)
        block_ids = manager.get_block_ids_for_computed_tokens(request.request_id,
                                                              request.num_computed_tokens)
        if not isinstance(self.connector, SupportsHMA):
            # vLLM's path for connectors without SupportsHMA (scheduler.py:2377-2383):
            # the hybrid manager is off for them, so there is one group.
            assert len(manager.kv_cache_config.kv_cache_groups) == 1
            return self.connector.request_finished(request, block_ids[0])
        return self.connector.request_finished_all_groups(request, block_ids)

    def _request_remaining_blocks(self, request: EngineRequest) -> int:
        """Blocks ``request`` still has to allocate to hold its whole sequence."""
        manager = self.kv_cache_manager
        num_tokens = min(request.num_tokens, self.max_model_len)
        return manager.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, manager.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=0, total_computed_tokens=request.num_computed_tokens,
            num_tokens_main_model=num_tokens, apply_admission_cap=True)

    def _inflight_prefill_reserved_blocks(self) -> int:
        """What the admitted-but-unfinished prefills (and loads) will still allocate.

        Passed as ``allocate_slots(..., reserved_blocks=...)`` for an asynchronous
        load only. Why (vLLM's ``scheduler.py:897-901``): a load holds all its
        blocks for the whole transfer and makes no progress meanwhile, and it is
        not preemptible (it is not in ``running``, where victims are taken). If it
        took blocks a running prefill still needs, that prefill would preempt
        running requests, or itself, to get them: preemptions one could predict
        at admission, and, when loads hold enough of the pool, a state where no
        running request can finish and no load lets go, a deadlock. So a load is
        admitted only if it fits in the free blocks minus this reservation.
        """
        return sum(self._request_remaining_blocks(r) for r in self._inflight_prefills)

    def _try_promote_blocked_waiting_request(self, request: EngineRequest) -> bool:
        """A request waiting for remote KV becomes schedulable once its load ended."""
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self._update_waiting_for_remote_kv(request)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions \
            else RequestStatus.WAITING
        return True

    def _update_waiting_for_remote_kv(self, request: EngineRequest) -> None:
        """The load ended: cache what arrived (delay_cache_blocks held it back)."""
        manager = self.kv_cache_manager
        if request.request_id in self.failed_recving_kv_req_ids:
            # num_computed_tokens was cut back to the first failed block already.
            if request.num_computed_tokens:
                manager.cache_blocks(request, request.num_computed_tokens)
            else:
                manager.free(request)             # nothing usable; a retry may hit locally
                self._async_local_hits.pop(request.request_id, None)
            self.failed_recving_kv_req_ids.remove(request.request_id)
        else:
            manager.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                # A full hit still computes its last token: it gives the next one's logits.
                request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(request.request_id)

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """Finished loads make their requests schedulable; finished sends free blocks."""
        self.connector.update_connector_output(kv_connector_output)
        for req_id in kv_connector_output.finished_recving or ():
            request = self.requests[req_id]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            else:
                assert request.is_finished()      # aborted while loading
                self._free_blocks(request)
        for req_id in kv_connector_output.finished_sending or ():
            self._free_blocks(self.requests[req_id])

    def _update_requests_with_invalid_blocks(self, requests: Iterable[EngineRequest],
                                             invalid_block_ids: set[int],
                                             num_scheduled_tokens: dict[str, int]
                                             ) -> tuple[set[str], set[int]]:
        """Cut each request holding a failed block back to the first one.

        Returns the affected request ids and the blocks from each first failed
        block on (vLLM evicts those from the prefix cache under "fail"). A failed
        block shared by two requests is recomputed by the first; the second
        only falls back to what it had computed before this step.
        """
        block_size = self.kv_cache_manager.kv_cache_config.kv_cache_groups[0] \
            .kv_cache_spec.block_size
        affected: set[str] = set()
        blocks_from_failure: set[int] = set()
        marked: set[int] = set()
        for request in requests:
            all_groups = self.kv_cache_manager.get_block_ids(request.request_id)
            if len(all_groups) != 1:
                # vLLM 0.25.1 has no per-group path here yet: a TODO for the hybrid
                # manager (scheduler.py:2545) over an unpacking of the one group
                # (:2546) that fails the same way (ValueError), so a failed load on
                # a hybrid model stops the engine there too.
                raise ValueError(
                    f"a KV load failed for request {request.request_id!r} of a model with "
                    f"{len(all_groups)} KV cache groups: load-failure handling supports "
                    "one group (vLLM 0.25.1's scheduler.py:2545-2546 is a TODO for the "
                    "hybrid manager)")
            (block_ids,) = all_groups
            num_computed = request.num_computed_tokens - \
                num_scheduled_tokens.get(request.request_id, 0)
            is_affected = marked_here = False
            for index, block_id in enumerate(block_ids[:cdiv(num_computed, block_size)]):
                if block_id not in invalid_block_ids:
                    continue
                is_affected = True
                if block_id in marked:
                    continue                      # an earlier request recomputes it
                marked.add(block_id)
                if marked_here:
                    continue
                marked_here = True
                request.num_computed_tokens = index * block_size
                blocks_from_failure.update(block_ids[index:])
            if is_affected:
                if not marked_here:
                    request.num_computed_tokens = num_computed
                affected.add(request.request_id)
        return affected, blocks_from_failure

    def _handle_invalid_blocks(self, invalid_block_ids: set[int],
                               num_scheduled_tokens: dict[str, int]) -> set[str]:
        """Requests hit by failed loads; returns those update_from_output must skip."""
        loading = [r for r in self.skipped_waiting
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        async_failed, _ = self._update_requests_with_invalid_blocks(
            loading, invalid_block_ids, num_scheduled_tokens)
        sync_failed, sync_blocks = self._update_requests_with_invalid_blocks(
            self.running, invalid_block_ids, num_scheduled_tokens)
        self.stats.num_kv_load_failures += len(async_failed) + len(sync_failed)
        if not (async_failed or sync_failed):
            return set()
        if not self.recompute_kv_load_failures:
            # The failed blocks (and what follows them) must not serve later hits.
            if sync_blocks:
                self.kv_cache_manager.evict_blocks(sync_blocks)
            logger.error("KV load failed for request(s) %s: finishing them with an error "
                         "(kv_load_failure_policy='fail')",
                         sorted(async_failed | sync_failed))
            return async_failed | sync_failed
        logger.warning("KV load failed for request(s) %s: recomputing from the first "
                       "failed block (kv_load_failure_policy='recompute')",
                       sorted(async_failed | sync_failed))
        # Recompute: async ones resume from what landed once their load ends.
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed

    # -- bookkeeping -------------------------------------------------------------

    def _count_prompt_tokens_cached(self, request: EngineRequest, num_hit: int) -> None:
        self.stats.prompt_tokens_cached += min(num_hit, request.num_prompt_tokens)

    def _count_prompt_tokens_external(self, request: EngineRequest, num_local: int,
                                      num_computed: int) -> None:
        self.stats.prompt_tokens_external += max(
            0, min(num_computed, request.num_prompt_tokens) - num_local)

    def _count_prompt_tokens_computed(self, request: EngineRequest, n: int) -> None:
        start = request.num_computed_tokens
        self.stats.prompt_tokens_computed += max(
            0, min(start + n, request.num_prompt_tokens) - start)

    def _record_step(self, output: SchedulerOutput, new: list[EngineRequest],
                     resumed: list[EngineRequest], preempted: list[EngineRequest],
                     prefix_hit_tokens: dict[str, int]) -> None:
        record = StepRecord(
            step=len(self.step_records),
            num_scheduled_tokens=dict(output.num_scheduled_tokens),
            admitted=[r.request_id for r in new],
            resumed=[r.request_id for r in resumed],
            preempted=[r.request_id for r in preempted],
            prefix_hit_tokens=prefix_hit_tokens,
            num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.skipped_waiting))
        self.step_records.append(record)
        self._records_in_flight[id(output)] = record
