"""A recorded operation stream, replayed as bare API calls and timed.

No vLLM counterpart (benchmark harness). The conformance traces
(``tests/conformance/traces/<class>/*.json.gz``) record how a scheduler drove
vLLM's KV layer. For timing, each op is turned *before the clock starts* into a
zero-argument closure that makes exactly the recorded call (arguments, request
objects' keyword arguments, enum values all prepared), so the timed loop is::

    for call in calls:
        call()

with no checking, no digests and no comparison. Ops that vLLM answered with an
exception raise here too and are swallowed (a ``try`` costs nothing when
nothing is raised). ``add_request`` times the ``Request(...)`` construction,
which includes hashing the prompt's blocks; its ``SamplingParams`` (vLLM) is
an argument and is built before the clock starts.

    side = sides.get_side("kvref")
    wall_s, cpu_s = time_trace(side, load_trace(path))
"""

from __future__ import annotations

import gc
import time
from typing import Callable

from kvref.verify.trace_replay import load_trace  # noqa: F401  (re-exported for callers)


def compile_calls(ops: list[dict], built,
                  prebuild_requests: bool = False) -> list[Callable[[], object]]:
    """One closure per op, each making the op's API call on ``built.manager``.

    ``prebuild_requests``: construct every ``Request`` now, so ``add_request``
    times only storing it (the manager's calls alone; a request's construction
    does not depend on the manager's state, so the calls see the same objects).
    """
    m, status = built.manager, built.status
    requests: dict = {}   # request id -> Request, filled as add_request runs
    last_hit: dict = {}   # request id -> KVCacheBlocks of its last get_computed_blocks
    handles: dict = {}    # pop_blocks_for_free handle -> blocks
    if prebuild_requests:
        built.pin_none_hash()
    return [_compile(op, m, status, built.request_factory, requests, last_hit, handles,
                     prebuild_requests)
            for op in ops]


def _compile(op, m, status, request_factory, requests, last_hit, handles, prebuild=False):
    name, rid = op["op"], op.get("req")
    if name == "add_request":
        make = request_factory(op)
        if prebuild:
            made = make()

            def call():
                requests[rid] = made
            return call

        def call():
            requests[rid] = make()
        return call
    if name == "get_computed_blocks":
        def call():
            last_hit[rid] = m.get_computed_blocks(requests[rid])[0]
        return call
    if name == "allocate_slots":
        return _compile_allocate(op, m, rid, requests, last_hit)
    if name == "free":
        return lambda: m.free(requests[rid])
    if name == "pop_blocks_for_free":
        handle = op["handle"]

        def call():
            handles[handle] = m.pop_blocks_for_free(requests[rid])
        return call
    if name == "block_pool_free_blocks":
        handle, reverse = op["handle"], op.get("reverse", True)

        def call():
            blocks = handles.pop(handle)
            m.block_pool.free_blocks(blocks[::-1] if reverse else blocks)
        return call
    if name == "remove_skipped_blocks":
        total, prompt = op["total_computed_tokens"], op.get("num_prompt_tokens")
        return lambda: m.remove_skipped_blocks(rid, total, prompt)
    if name == "evict_blocks":
        ids = set(op["block_ids"])
        return lambda: m.evict_blocks(ids)
    if name == "reset_prefix_cache":
        return m.reset_prefix_cache
    if name == "get_num_common_prefix_blocks":
        return lambda: m.get_num_common_prefix_blocks(rid)
    if name == "take_events":
        return m.take_events
    if name == "take_new_block_ids":
        return m.take_new_block_ids
    if name == "new_step_starts":
        return m.new_step_starts
    if name == "get_block_ids":
        return lambda: m.get_block_ids(rid)
    if name == "get_block_ids_for_computed_tokens":
        n = op["num_computed_tokens"]
        return lambda: m.get_block_ids_for_computed_tokens(rid, n)
    if name == "cache_blocks":
        n = op["num_computed_tokens"]
        return lambda: m.cache_blocks(requests[rid], n)
    if name == "usage":
        return lambda: m.usage
    if name == "num_free_blocks":
        return m.block_pool.get_num_free_blocks
    if name == "make_prefix_cache_stats":
        return m.make_prefix_cache_stats
    if name == "set_num_computed_tokens":
        value = op["value"]

        def call():
            requests[rid].num_computed_tokens = value
        return call
    if name == "set_status":
        value = status[op["value"]]

        def call():
            requests[rid].status = value
        return call
    if name == "set_num_preemptions":
        value = op["value"]

        def call():
            requests[rid].num_preemptions = value
        return call
    if name == "append_output_token_ids":
        tokens = list(op["tokens"])
        return lambda: requests[rid].append_output_token_ids(tokens)
    raise ValueError(f"unknown op {name!r}")


# allocate_slots keyword arguments a trace may set (vLLM v0.25.1 names).
ALLOCATE_KEYWORDS = ("num_new_computed_tokens", "num_lookahead_tokens",
                     "num_external_computed_tokens", "delay_cache_blocks",
                     "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks",
                     "has_scheduled_reqs")


def _compile_allocate(op, m, rid, requests, last_hit):
    n = op["num_new_tokens"]
    # Only what the trace set is passed, as a scheduler passes what it uses.
    kwargs = {k: op[k] for k in ALLOCATE_KEYWORDS if k in op}
    which = op.get("new_computed_blocks")
    if which == "last":
        return lambda: m.allocate_slots(requests[rid], n, new_computed_blocks=last_hit[rid],
                                        **kwargs)
    if which == "empty":
        kwargs["new_computed_blocks"] = m.empty_kv_cache_blocks
    elif which is not None:
        raise ValueError(f"bad new_computed_blocks {which!r}")
    return lambda: m.allocate_slots(requests[rid], n, **kwargs)


def run_calls(calls: list[Callable[[], object]]) -> int:
    """Make every call; return how many raised (as recorded from vLLM)."""
    raised = 0
    for call in calls:
        try:
            call()
        except Exception:  # noqa: BLE001 - the trace recorded this exception from vLLM
            raised += 1
    return raised


def time_trace(side, trace: dict, prebuild_requests: bool = False
               ) -> tuple[float, float, int, int]:
    """``(wall seconds, process CPU seconds, ops, ops that raised)`` of one
    replay of ``trace``. Building the manager and compiling the calls are not timed.
    """
    built = side.from_header(trace["header"])
    calls = compile_calls(trace["ops"], built, prebuild_requests)
    built.pin_none_hash()   # the hash chain's seed is a module global on both sides
    gc.collect()            # start every replay from the same collector state
    wall0, cpu0 = time.perf_counter(), time.process_time()
    raised = run_calls(calls)
    wall1, cpu1 = time.perf_counter(), time.process_time()
    return wall1 - wall0, cpu1 - cpu0, len(calls), raised


def time_traces(side, traces: list[dict], passes: int = 1, prebuild_requests: bool = False
                ) -> tuple[float, float, int, int]:
    """Sums of ``time_trace`` over ``passes`` replays of every trace (fresh
    managers each time)."""
    totals = [0.0, 0.0, 0, 0]
    for _ in range(passes):
        for trace in traces:
            totals = [a + b for a, b in zip(totals, time_trace(side, trace, prebuild_requests))]
    return tuple(totals)


def time_by_op(side, traces: list[dict], passes: int = 1) -> dict[str, list]:
    """``{op name: [calls, process CPU seconds]}``: each call timed on its own
    (CPU time: wall time is at the mercy of other processes). For finding where
    time goes, not for the ratio: the clock itself costs a fraction of a µs."""
    per_op: dict[str, list] = {}
    clock = time.process_time
    for _ in range(passes):
        for trace in traces:
            built = side.from_header(trace["header"])
            calls = compile_calls(trace["ops"], built)
            built.pin_none_hash()
            for op, call in zip(trace["ops"], calls):
                t0 = clock()
                try:
                    call()
                except Exception:  # noqa: BLE001 - recorded from vLLM
                    pass
                entry = per_op.setdefault(op["op"], [0, 0.0])
                entry[0] += 1
                entry[1] += clock() - t0
    return per_op
