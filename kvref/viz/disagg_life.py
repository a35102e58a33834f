"""One disaggregated request, step by step: the scheduler's calls into the KV cache manager.

No vLLM counterpart. ``disagg_life(branch)`` runs a decode engine (kvref's
``Scheduler`` or ``AsyncScheduler``, the model-free runner, no torch) whose
request ``D`` gets its prompt's KV from a remote prefill engine (the
``RemotePrefillConnector`` of ``kvref.viz.workloads``, which moves no tensors
and lands a load a set number of steps after it starts). It records every
call the scheduler makes into the manager for ``D`` (``allocate_slots`` with
its arguments, ``cache_blocks``, ``free``, ``pop_blocks_for_free``, and the
pool's ``free_blocks`` of a deferred free), with ``D``'s status, the blocks
it holds, how many of them carry a hash, and the ``reserved_blocks`` its
load was admitted under. Each branch's rows are claims checked against the
run as it happens (``LifeError`` if one is false), and docs/pictures.md's tables
(``render_disagg_life``) must be exactly today's run
(``tests/viz/test_disagg_life.py``)::

    print(render_disagg_life(disagg_life("lands")))

Branches, on a 16-block pool of 4-token blocks, a budget of 16 tokens, prefill
chunks of at most 8 tokens; a local prompt ``P`` (24 tokens) is admitted first
and is still prefilling when ``D`` (14 prompt tokens, 3 to generate) asks
for its KV:

- ``lands``: the load lands two steps later; ``D`` computes its last prompt
  token and decodes.
- ``recompute``: block 2 of the load fails, ``kv_load_failure_policy=
  "recompute"``: ``D`` keeps blocks 0-1 and computes the rest.
- ``fail``: the same failure under ``"fail"`` (vLLM's default): ``D``
  finishes with an error in the step that reports it.
- ``deferred``: under async scheduling (two batches in flight) the client
  aborts ``D`` while a step that writes its blocks is in flight: the blocks
  leave ``D`` at once (``pop_blocks_for_free``) but go back to the pool only
  when that step's output is processed (a consumer's deferred free).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from kvref.sched.async_scheduler import AsyncScheduler
from kvref.engine.core import make_engine_core
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler
from kvref.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvref.math_utils import cdiv
from kvref.request import RequestStatus
from kvref.viz.tables import compress_ids
from kvref.viz.workloads import RemoteLoad

BLOCK = 4
NUM_BLOCKS = 16
BUDGET = 16
CHUNK = 8
LOCAL = list(range(500, 524))             # P: 24 tokens, prefilled here in chunks of 8
PROMPT = list(range(600, 614))            # D: 14 tokens, prefilled remotely
MAX_TOKENS = 3
FAILED_BLOCK = 2
BRANCHES = ("lands", "recompute", "fail", "deferred")
_DEFAULTS = {name: p.default for name, p in
             inspect.signature(KVCacheManager.allocate_slots).parameters.items()
             if p.default is not inspect.Parameter.empty}


class LifeError(AssertionError):
    """A row claims something the run contradicts."""


@dataclass
class CallRow:
    when: str                # "schedule 2", "update 1" (the step whose output is applied), "abort"
    call: str                # the manager call, with its arguments
    status: str              # D's status after the call
    held: str                # D's block ids after the call
    hashed: str              # how many of them carry a block hash
    reserved: str            # allocate_slots' reserved_blocks ("-" elsewhere)


@dataclass
class DisaggLife:
    branch: str
    rows: list[CallRow] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    def check(self, holds: bool, text: str) -> None:
        if not holds:
            raise LifeError(f"disaggregated life ({self.branch}): {text} does not hold")
        self.claims.append(text)

    def calls(self, name: str) -> list[CallRow]:
        return [r for r in self.rows if r.call.startswith(name + "(")]

    def call(self, name: str, index: int) -> CallRow:
        """The ``index``-th call of ``name`` (an empty row if there is none)."""
        found = self.calls(name)
        return found[index] if index < len(found) else CallRow("-", "-", "-", "-", "-", "-")


def _allocate_args(args: tuple, kwargs: dict) -> str:
    parts = ["D", *map(str, args[1:])] + [f"{k}={v}" for k, v in kwargs.items()
                              if k != "new_computed_blocks" and _DEFAULTS.get(k) != v]
    hit = kwargs.get("new_computed_blocks")
    if hit is not None and any(hit.blocks[0]):
        parts.append(f"new_computed_blocks=<{len(hit.blocks[0])} blocks>")
    return ", ".join(parts)


def disagg_life(branch: str = "lands") -> DisaggLife:
    """Run ``branch`` (one of ``BRANCHES``) and record D's calls, checking each step."""
    if branch not in BRANCHES:
        raise ValueError(f"unknown branch {branch!r} (one of {', '.join(BRANCHES)})")
    failed = FAILED_BLOCK if branch in ("recompute", "fail") else None
    config = KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["attn"], FullAttentionSpec(BLOCK))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, max_num_batched_tokens=BUDGET)
    transfer = KVTransferConfig(
        kv_connector="RemotePrefillConnector", kv_role="kv_consumer",
        kv_load_failure_policy="fail" if branch == "fail" else "recompute",
        kv_connector_extra_config={"remote": {"D": RemoteLoad(2, failed_block=failed)}})
    cls = AsyncScheduler if branch == "deferred" else Scheduler
    scheduler = cls(manager, max_num_batched_tokens=BUDGET, long_prefill_token_threshold=CHUNK,
                    kv_transfer_config=transfer)
    worker = KVConnectorFactory.create_connector(transfer, KVConnectorRole.WORKER, config)
    core = make_engine_core(scheduler, ModelFreeRunner(
        vocab_size=1000, kv_connector=worker, async_scheduling=branch == "deferred"))
    pool = manager.block_pool
    life = DisaggLife(branch)
    when = ["-"]
    counts = {"schedule": 0}
    depth = [0]

    def d_blocks() -> list[int]:
        per_request = manager.coordinator.single_type_managers[0].req_to_blocks
        return [b.block_id for b in per_request.get("D", [])]

    def row(call: str, reserved: str = "-") -> None:
        ids = d_blocks()
        hashed = sum(pool.blocks[b].block_hash is not None for b in ids)
        life.rows.append(CallRow(when[0], call, "", compress_ids(ids) or "-",
                                 f"{hashed}/{len(ids)}", reserved))

    def end_phase(start: int) -> None:
        """D's status as the phase leaves it, on every row the phase logged."""
        for r in life.rows[start:]:
            r.status = d.status.name

    def logged(name, method, describe, reserved_of=None):
        def wrapper(*args, **kwargs):
            depth[0] += 1
            try:
                result = method(*args, **kwargs)
            finally:
                depth[0] -= 1
            if args and getattr(args[0], "request_id", None) == "D":
                call = f"{name}({describe(args, kwargs)})"
                if name == "allocate_slots" and result is None:
                    call += " -> None"
                row(call, str(kwargs.get("reserved_blocks", 0)) if reserved_of else "-")
            return result
        return wrapper

    manager.allocate_slots = logged("allocate_slots", manager.allocate_slots,
                                    _allocate_args, reserved_of=True)
    manager.cache_blocks = logged("cache_blocks", manager.cache_blocks,
                                  lambda a, k: f"D, {a[1]}")
    manager.free = logged("free", manager.free, lambda a, k: "D")
    parked: list[int] = []

    def pop_blocks_for_free(request):
        blocks = pop(request)
        if request.request_id == "D":
            parked.extend(b.block_id for b in blocks)
            row(f"pop_blocks_for_free(D) -> {compress_ids(parked)}")
        return blocks
    pop = manager.pop_blocks_for_free
    manager.pop_blocks_for_free = pop_blocks_for_free
    pool_free = pool.free_blocks

    def free_blocks(blocks):
        blocks = list(blocks)
        pool_free(blocks)
        ids = [b.block_id for b in blocks]
        if depth[0] == 0 and parked and sorted(ids) == sorted(parked):
            row(f"block_pool.free_blocks({compress_ids(ids)})  [deferred]")
    pool.free_blocks = free_blocks

    schedule, update = scheduler.schedule, scheduler.update_from_output

    def scheduled():
        when[0] = f"schedule {counts['schedule']}"
        counts["schedule"] += 1
        start = len(life.rows)
        out = schedule()
        if len(life.rows) == start and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            row("- (no call: its load is in flight, D is skipped)")
        end_phase(start)
        return out

    def updated(scheduler_output, model_runner_output):
        when[0] = f"update {scheduler.step_records.index(_record_of(scheduler_output))}"
        start = len(life.rows)
        connector_output = model_runner_output.kv_connector_output
        ids_before = d_blocks()
        finished = update(scheduler_output, model_runner_output)
        if connector_output is not None and "D" in (connector_output.finished_recving or ()):
            lost = sorted(b for b in connector_output.invalid_block_ids or () if b in ids_before)
            text = "- (the worker reports D's load done"
            if lost:
                text += (f"; block {compress_ids(lost)}, D's block "
                         f"{ids_before.index(lost[0])}, failed")
                if d.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    text += f": num_computed_tokens -> {d.num_computed_tokens}"
            row(text + ")")
            life.rows.insert(start, life.rows.pop())     # it comes before what it caused
            held = compress_ids(ids_before) or "-"
            hashed = sum(pool.blocks[b].block_hash is not None for b in ids_before)
            life.rows[start].held = held
            life.rows[start].hashed = f"{hashed}/{len(ids_before)}"
        end_phase(start)
        return finished

    outputs: list = []

    def _record_of(scheduler_output):
        return scheduler._records_in_flight[id(scheduler_output)]
    scheduler.schedule, scheduler.update_from_output = scheduled, updated

    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    scheduler.new_request("P", LOCAL, SamplingParams(max_tokens=2, ignore_eos=True))
    d = scheduler.new_request("D", PROMPT, params)
    life.check(d.status == RequestStatus.WAITING, "D arrives waiting")
    free_before_abort = None
    for _ in range(80):
        if not core.has_work():
            break
        if (branch == "deferred" and free_before_abort is None and core.batch_queue
                and d.status == RequestStatus.RUNNING and d.num_output_tokens >= 1
                and any("D" in out.num_scheduled_tokens for _, out in core.batch_queue)):
            when[0] = "abort"
            free_before_abort = pool.get_num_free_blocks()
            held_before_abort = len(d_blocks())
            scheduler.finish_requests("D")
            end_phase(len(life.rows) - 1)
            life.check(pool.get_num_free_blocks() == free_before_abort and not d_blocks()
                       and len(parked) == held_before_abort,
                       "aborted while a step writing its blocks is in flight, D gives up its "
                       f"{held_before_abort} blocks (pop_blocks_for_free) but the pool gets "
                       "none back yet")
        outputs.append(core.step())
    core.shutdown()
    life.output_token_ids = list(d.output_token_ids)

    # -- the checks, against what the run recorded ----------------------------------
    first = life.rows[0]
    local_left = cdiv(len(LOCAL), BLOCK) - CHUNK // BLOCK
    life.check(first.call.startswith(f"allocate_slots(D, 0, num_external_computed_tokens="
                                     f"{len(PROMPT)}, delay_cache_blocks=True")
               and first.status == "WAITING_FOR_REMOTE_KVS"
               and first.hashed == f"0/{cdiv(len(PROMPT), BLOCK)}",
               "D's first step allocates every block of its prompt for the load, 0 tokens "
               "to compute, none hashed (delay_cache_blocks)")
    life.check(first.reserved == str(local_left) and local_left > 0,
               f"the load is admitted under reserved_blocks={local_left}: the blocks P's "
               "prefill in flight will still take")
    if branch in ("lands", "deferred"):
        cache = life.call("cache_blocks", 0)
        life.check(cache.call == f"cache_blocks(D, {len(PROMPT)})"
                   and cache.hashed == f"{len(PROMPT) // BLOCK}/{cdiv(len(PROMPT), BLOCK)}",
                   "when the load has landed, the next schedule caches what arrived: the "
                   "full blocks get their hashes")
        admit = life.call("allocate_slots", 1)
        life.check(admit.call.startswith("allocate_slots(D, 1,") and admit.status == "RUNNING"
                   and admit.when == cache.when,
                   "in the same schedule D is admitted with one token to compute: the last "
                   "prompt token, for the logits of the first output")
    if branch == "lands":
        life.check(life.output_token_ids == ModelFreeRunner(vocab_size=1000).reference_output(
            PROMPT, MAX_TOKENS), "D generates the tokens of an engine that computed "
                                 "everything itself")
        last = life.rows[-1]
        life.check(last.call == "free(D)" and last.status == "FINISHED_LENGTH_CAPPED"
                   and last.held == "-" and not life.calls("pop_blocks_for_free"),
                   "finished, D's blocks go back to the pool at once (free): nothing "
                   "in flight can write them")
    if branch == "recompute":
        cache = life.call("cache_blocks", 0)
        life.check(cache.call == f"cache_blocks(D, {FAILED_BLOCK * BLOCK})"
                   and cache.hashed.startswith(f"{FAILED_BLOCK}/"),
                   f"block {FAILED_BLOCK} failed: only the {FAILED_BLOCK} blocks before it "
                   "are cached")
        admit = life.call("allocate_slots", 1)
        life.check(admit.call.startswith(
            f"allocate_slots(D, {len(PROMPT) - FAILED_BLOCK * BLOCK},")
            and admit.when == cache.when,
            f"and D computes the other {len(PROMPT) - FAILED_BLOCK * BLOCK} prompt tokens")
        life.check(life.output_token_ids == ModelFreeRunner(vocab_size=1000).reference_output(
            PROMPT, MAX_TOKENS), "the same tokens as without the failure")
    if branch == "fail":
        last = life.rows[-1]
        life.check(last.call == "free(D)" and last.status == "FINISHED_ERROR"
                   and last.when.startswith("update") and not life.calls("cache_blocks")
                   and not life.output_token_ids,
                   "under 'fail' D finishes with an error and no token in the update that "
                   "reports the failed block; its blocks are freed, none was cached")
    if branch == "deferred":
        life.check(free_before_abort is not None, "D was aborted with a step in flight")
        drained = life.calls("block_pool.free_blocks")
        life.check(len(drained) == 1 and drained[0].when.startswith("update")
                   and life.rows[-1] is drained[0],
                   "the parked blocks go back to the pool when that step's output is "
                   "processed")
    life.check(pool.get_num_free_blocks() == NUM_BLOCKS - 1, "at the end every block is free")
    return life


def render_disagg_life(life: DisaggLife) -> str:
    """One branch as a plain-text table (what docs/pictures.md shows)."""
    head = ("when", "manager call for D", "D's status", "D's blocks", "hashed", "reserved")
    rows = [head] + [(r.when, r.call, r.status, r.held, r.hashed, r.reserved)
                     for r in life.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
                     for row in rows)


if __name__ == "__main__":
    for name in BRANCHES:
        print(f"{name}:")
        print(render_disagg_life(disagg_life(name)))
        print()
