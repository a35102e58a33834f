"""Replay vLLM 0.25.1 scheduler traces on kvref's engine and compare every decision.

A trace (format ``kvref-vllm-scheduler-trace/1``, written by
``tools/record_vllm_scheduler.py``) holds runs of vLLM's own ``Scheduler`` or
``AsyncScheduler``: the configuration, the arrivals (which engine iteration
each request arrived before), and one event per ``schedule()`` and per
``update_from_output()`` call, in call order:

* ``schedule``: the requests scheduled and their token counts (in batch
  order), the new / resumed / preempted ids, the finished ids the output
  reports, the draft tokens scheduled, each scheduled request's
  ``num_computed_tokens`` (as the output carries it) and block table (per KV
  cache group), the free blocks, the running and waiting queues, and under
  async scheduling each scheduled request's ``num_output_placeholders``;
* ``update``: which step's output was applied, the tokens each request
  sampled, the requests that finished (and why), the free blocks and queues.

With a KV connector (``config["connector"]``) both sides drive the same
simulated connector (``sim_connector.py``), and every event also carries
``conn`` (the connector calls since the previous event, arguments and
answers) and ``kv`` (the KV cache manager's calls and answers); an update
also carries the published KV events (block hashes compared by the order
they first appear) and every request's status; ``abort`` events are the
run cancelling what is left after ``STALL_STEPS`` idle engine iterations.

The replay builds kvref's ``KVCacheManager`` and ``Scheduler`` (or
``AsyncScheduler``) from the configuration, runs them with kvref's
``ModelFreeRunner`` and kvref's own engine loop, and records the same events
from kvref's objects. The tokens and drafts are not read from the trace: the
runner's hash and kvref's ``NgramProposer`` compute them, so equal ``sampled``
fields also show that both sides share the model and the drafting rule.
Use::

    for result in replay_file("tests/engine/vllm_scheduler_traces/tight.json.gz"):
        print(result.name, result.divergence or "identical")
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                      SlidingWindowSpec)
from kvref.verify.invariants import check_kv_cache_manager

TRACE_FORMAT = "kvref-vllm-scheduler-trace/1"
# A connector run aborts its unfinished requests after this many engine iterations in
# a row with nothing scheduled, ended or in flight (the recorder's rule:
# tools/record_vllm_scheduler.py).
STALL_STEPS = 12

__all__ = ["ReplayResult", "TRACE_FORMAT", "build_engine", "load_trace", "replay_file",
           "replay_run"]


@dataclass
class ReplayResult:
    """One run replayed: how many steps agreed, and the first divergence (None if none)."""

    name: str
    num_steps: int                 # schedule() calls in the trace
    num_events: int
    divergence: str | None
    divergent_steps: int           # steps whose events differ (0 when identical)
    stats: Any = None              # kvref's SchedulerStats after the replay


def load_trace(path: str | Path) -> dict:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    if doc.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT} trace (format {doc.get('format')!r})")
    return doc


def build_engine(config: dict):
    """kvref's scheduler and model-free runner for a trace configuration."""
    from kvref.worker.model_free_runner import ModelFreeRunner
    from kvref.spec_decode.ngram_proposer import NgramProposer
    from kvref.sched.async_scheduler import AsyncScheduler
    from kvref.sched.scheduler import Scheduler

    bs = config["block_size"]
    groups = []
    for i, g in enumerate(config["groups"]):
        group_bs = g.get("block_size", bs)
        if g["kind"] == "full":
            spec = FullAttentionSpec(group_bs, num_kv_heads=1, head_size=64)
        elif g["kind"] == "sliding_window":
            spec = SlidingWindowSpec(group_bs, g["sliding_window"], num_kv_heads=1,
                                     head_size=64)
        else:
            raise ValueError(f"unknown KV cache group kind {g['kind']!r}")
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], spec))
    manager = KVCacheManager(
        KVCacheConfig(config["num_blocks"], groups), max_model_len=config["max_model_len"],
        # Several block sizes: their lcm and gcd, as vLLM resolves them (in the trace).
        scheduler_block_size=config.get("scheduler_block_size", bs),
        hash_block_size=config.get("hash_block_size", bs),
        max_num_batched_tokens=config["max_num_batched_tokens"],
        enable_caching=config["enable_prefix_caching"], log_stats=True,
        watermark=config["watermark"],
        enable_kv_cache_events=config.get("enable_kv_cache_events", False))
    spec = config["speculative"]
    cls = AsyncScheduler if config["async_scheduling"] else Scheduler
    transfer = worker_connector = None
    if config.get("connector"):
        transfer, worker_connector = _sim_connector(config, manager.kv_cache_config)
    scheduler = cls(
        manager, max_num_batched_tokens=config["max_num_batched_tokens"],
        max_num_seqs=config["max_num_seqs"], max_model_len=config["max_model_len"],
        long_prefill_token_threshold=config["long_prefill_token_threshold"],
        scheduler_reserve_full_isl=config["scheduler_reserve_full_isl"],
        num_speculative_tokens=spec["num_speculative_tokens"] if spec else 0,
        eos_token_id=config["eos_token_id"], kv_transfer_config=transfer)
    drafter = None
    if spec:
        drafter = NgramProposer(spec["prompt_lookup_min"], spec["prompt_lookup_max"],
                                spec["num_speculative_tokens"], config["max_model_len"])
    runner = ModelFreeRunner(config["vocab_size"], drafter=drafter,
                             async_scheduling=config["async_scheduling"],
                             kv_connector=worker_connector)
    if worker_connector is not None:
        execute = runner.execute_model

        def execute_model(scheduler_output):
            # vLLM's runner returns no connector output from a step without a
            # forward that has nothing to report (vllm/v1/outputs.py:284-294).
            output = execute(scheduler_output)
            if (scheduler_output.total_num_scheduled_tokens == 0
                    and output.kv_connector_output.is_empty()):
                output.kv_connector_output = None
            return output
        runner.execute_model = execute_model
    return scheduler, runner


def _sim_connector(config: dict, kv_cache_config):
    """The recorded runs' simulated connector (``sim_connector.py``): its transfer
    config for the scheduler, and its worker half for the runner."""
    from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                    KVTransferConfig)
    from kvref.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvref.verify import sim_connector  # noqa: F401 - registers SimConnector

    connector = config["connector"]
    transfer = KVTransferConfig(
        kv_connector="SimConnector", kv_role=connector["kv_role"],
        kv_load_failure_policy=connector["policy"],
        kv_connector_extra_config={"plans": connector["plans"],
                                   "block_size": config["block_size"], "calls": []})
    worker = KVConnectorFactory.create_connector(transfer, KVConnectorRole.WORKER,
                                                 kv_cache_config)
    return transfer, worker


class _EventLog:
    """Wraps a scheduler's schedule/update_from_output to log trace events."""

    def __init__(self, scheduler, async_scheduling: bool) -> None:
        self.events: list[dict] = []
        self.num_schedules = 0
        self.step_of: dict[int, int] = {}           # id(SchedulerOutput) -> step
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        schedule, update = scheduler.schedule, scheduler.update_from_output
        scheduler.schedule = lambda: self._schedule(schedule)
        scheduler.update_from_output = lambda so, ro: self._update(update, so, ro)
        self.kv_calls: list = []
        self.conn_calls: list = []
        self.num_idle = 0                         # iterations in a row with nothing going on
        if scheduler.connector is not None:
            self.conn_calls = scheduler.connector.sim.calls
            self._observe_manager()

    # -- a connector run: what else is observed (the recorder's fields) ------------

    def _observe_manager(self) -> None:
        import inspect
        manager = self.scheduler.kv_cache_manager
        log = self.kv_calls

        def wrap(name, summarize):
            original = getattr(manager, name)
            signature = inspect.signature(original)

            def call(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                answer = original(*args, **kwargs)
                log.append(summarize(bound.arguments, answer))
                return answer
            setattr(manager, name, call)

        def ids(blocks):
            return None if blocks is None else [list(g) for g in blocks.get_block_ids()]
        wrap("get_computed_blocks", lambda a, r: ["hit", a["request"].request_id, r[1]])
        wrap("allocate_slots", lambda a, r: [
            "alloc", a["request"].request_id, a["num_new_tokens"], a["num_new_computed_tokens"],
            a["num_external_computed_tokens"], a["delay_cache_blocks"], a["reserved_blocks"],
            a["full_sequence_must_fit"], ids(r)])
        wrap("cache_blocks", lambda a, r: ["cache", a["request"].request_id,
                                           a["num_computed_tokens"]])
        wrap("evict_blocks", lambda a, r: ["evict", sorted(a["block_ids"])])
        wrap("pop_blocks_for_free", lambda a, r: ["pop", a["request"].request_id,
                                                  [b.block_id for b in r]])
        wrap("free", lambda a, r: ["free", a["request"].request_id])

    def attach(self, event: dict) -> dict:
        """A connector run's event carries the calls made since the previous one."""
        if self.scheduler.connector is not None:
            event["conn"], self.conn_calls[:] = list(self.conn_calls), []
            event["kv"], self.kv_calls[:] = list(self.kv_calls), []
            if event["op"] == "update":
                batches, self.scheduler.kv_event_batches = self.scheduler.kv_event_batches, []
                event["published"] = [[summarize_kv_event(e) for e in batch]
                                      for batch in batches]
                event["status"] = {rid: r.status.name
                                   for rid, r in sorted(self.scheduler.requests.items())}
        return event

    def abort_if_stalled(self, first_event: int) -> None:
        """The recorder's rule: after STALL_STEPS engine iterations in a row in which
        nothing was scheduled, no transfer ended and none was in flight, abort the
        unfinished requests, one by one in id order. ``first_event``: where this
        iteration's events start."""
        from kvref import RequestStatus
        sim = self.scheduler.connector.sim
        busy = (sim.pending
                or any(e["op"] == "schedule" and e["tokens"] for e in self.events[first_event:])
                or any(c[0] == "update_connector_output" and (c[1] or c[2] or c[3])
                       for e in self.events[first_event:] for c in e["conn"]))
        self.num_idle = 0 if busy else self.num_idle + 1
        if self.num_idle < STALL_STEPS:
            return
        self.num_idle = 0
        sched = self.scheduler
        ids = sorted(r.request_id for r in [*sched.running, *sched.waiting,
                                            *sched.skipped_waiting])
        if not ids:
            return
        for rid in ids:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.events.append(self.attach({"op": "abort", "step": self.num_schedules,
                                        "ids": ids}))

    def _queues(self) -> dict:
        return {"running": [r.request_id for r in self.scheduler.running],
                "waiting": [r.request_id for r in self.scheduler.waiting]}

    def _schedule(self, schedule):
        # tools/record_vllm_scheduler.py observes vLLM with the same fields;
        # it keeps its own copy because the recorder must not import kvref.
        sched = self.scheduler
        out = schedule()
        manager = sched.kv_cache_manager
        cached = out.scheduled_cached_reqs
        nc = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for i, rid in enumerate(cached.req_ids):
            nc[rid] = cached.num_computed_tokens[i]
        event = {
            "op": "schedule", "step": self.num_schedules,
            "tokens": [[rid, n] for rid, n in out.num_scheduled_tokens.items()],
            "new": [r.req_id for r in out.scheduled_new_reqs],
            "resumed": sorted(cached.resumed_req_ids),
            "preempted": sorted(out.preempted_req_ids),
            "finished": sorted(out.finished_req_ids),
            "spec": {rid: list(t) for rid, t in out.scheduled_spec_decode_tokens.items()},
            "nc": nc,
            "blocks": {rid: [list(ids) for ids in manager.get_block_ids(rid)]
                       for rid in out.num_scheduled_tokens},
            "free": manager.block_pool.get_num_free_blocks(),
            **self._queues(),
        }
        if self.async_scheduling:
            event["placeholders"] = {rid: sched.requests[rid].num_output_placeholders
                                     for rid in out.num_scheduled_tokens}
        self.events.append(self.attach(event))
        self.step_of[id(out)] = self.num_schedules
        self.num_schedules += 1
        return out

    def _update(self, update, out, runner_output):
        finished = update(out, runner_output)
        sampled = {rid: list(runner_output.sampled_token_ids[i])
                   for i, rid in enumerate(runner_output.req_ids)
                   if runner_output.sampled_token_ids[i]}
        self.events.append(self.attach({
            "op": "update", "step": self.step_of.pop(id(out)),
            "sampled": sampled,
            "finished": [[r.request_id, r.get_finished_reason()] for r in finished],
            "free": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            **self._queues(),
        }))
        return finished


def summarize_kv_event(event) -> list:
    """A published KV cache event, as the recorder writes vLLM's."""
    kind = type(event).__name__
    if kind == "BlockStored":
        return [kind, list(event.block_hashes), event.parent_block_hash, len(event.token_ids),
                event.block_size, event.medium, event.group_idx]
    if kind == "BlockRemoved":
        return [kind, list(event.block_hashes), event.medium, event.group_idx]
    return [kind]


def _number_event_hashes(events: list[dict]) -> list[dict]:
    """The published events with each block hash replaced by the order of its first
    appearance in the run: hashes derive from the process's NONE_HASH (random
    unless PYTHONHASHSEED is set), so only their pattern can match."""
    numbers: dict = {}

    def number(h):
        return None if h is None else numbers.setdefault(h, len(numbers))
    out = []
    for event in events:
        if "published" in event:
            event = dict(event)
            event["published"] = [
                [[e[0], [number(h) for h in e[1]], number(e[2]), *e[3:]]
                 if e[0] == "BlockStored" else
                 [e[0], [number(h) for h in e[1]], *e[2:]] if e[0] == "BlockRemoved" else e
                 for e in batch] for batch in event["published"]]
        out.append(event)
    return out


def _diff(expected: Any, actual: Any, path: str = "") -> str | None:
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                return f"{path}.{key}: kvref has none, vLLM {expected[key]!r}"
            if key not in expected:
                return f"{path}.{key}: vLLM has none, kvref {actual[key]!r}"
            found = _diff(expected[key], actual[key], f"{path}.{key}")
            if found:
                return found
        return None
    if expected != actual:
        return f"{path}: vLLM {expected!r}, kvref {actual!r}"
    return None


def replay_run(run: dict, name: str = "", max_iterations: int = 20000) -> ReplayResult:
    """Replay one run of a trace on kvref; compare event by event."""
    from kvref.engine.core import make_engine_core
    from kvref.sampling_params import SamplingParams

    config = run["config"]
    scheduler, runner = build_engine(config)
    log = _EventLog(scheduler, config["async_scheduling"])
    loop = make_engine_core(scheduler, runner)
    pending = sorted(run["arrivals"], key=lambda a: a[0])
    iteration = 0
    error = None
    try:
        while pending or loop.has_work():
            if not loop.has_work():
                iteration = max(iteration, pending[0][0])     # idle: jump to the next arrival
            while pending and pending[0][0] <= iteration:
                _, rid, prompt, params = pending.pop(0)
                scheduler.new_request(rid, prompt, SamplingParams(
                    max_tokens=params["max_tokens"], ignore_eos=params.get("ignore_eos", True),
                    min_tokens=params.get("min_tokens", 0),
                    stop_token_ids=tuple(params.get("stop_token_ids") or ())))
            first_event = len(log.events)
            loop.step()
            if scheduler.connector is not None:
                log.abort_if_stalled(first_event)
            check_kv_cache_manager(scheduler.kv_cache_manager,
                                   popped_blocks=scheduler.deferred_blocks())
            iteration += 1
            if iteration > max_iterations:
                raise RuntimeError("the replay did not finish")
    except Exception as exc:        # a crash is a divergence too, reported where it happened
        error = f"kvref raised {type(exc).__name__}: {exc}"
    finally:
        loop.shutdown()

    expected = _number_event_hashes(run["events"])
    actual = _number_event_hashes(log.events)
    first = None
    bad_steps: set[int] = set()          # steps whose schedule or update event differs
    for i, want in enumerate(expected):
        got = actual[i] if i < len(actual) else None
        found = (f"kvref stopped after {len(actual)} events" if got is None
                 else _diff(want, got))
        if found:
            if first is None:
                first = f"event {i} ({want['op']} step {want['step']}): {found}"
            bad_steps.add(want["step"])
    if len(actual) > len(expected):
        if first is None:
            first = f"kvref has {len(actual) - len(expected)} events more than vLLM"
        bad_steps.update(e["step"] for e in actual[len(expected):])
    divergent_steps = len(bad_steps)
    if error and first is None:
        first = error
        divergent_steps = max(divergent_steps, 1)
    elif error:
        first = f"{first} ({error})"
    num_steps = sum(1 for e in expected if e["op"] == "schedule")
    return ReplayResult(name, num_steps, len(expected), first, divergent_steps,
                        scheduler.stats)


def replay_file(path: str | Path) -> list[ReplayResult]:
    doc = load_trace(path)
    return [replay_run(run, f"{doc['profile']}[{i}]") for i, run in enumerate(doc["runs"])]


def main(argv: list[str] | None = None) -> int:
    """``python -m kvref.verify.scheduler_replay TRACE...``: one JSON line per run
    (name, steps, divergent steps, first divergence). Connector traces iterate
    sets of request ids as vLLM does, so replay them under the recorder's
    ``PYTHONHASHSEED`` (0)."""
    import argparse
    import sys
    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.traces:
        for result in replay_file(path):
            print(json.dumps({"name": result.name, "num_steps": result.num_steps,
                              "divergent_steps": result.divergent_steps,
                              "divergence": result.divergence}), flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
