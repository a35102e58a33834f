"""Replaying a trace to any position: steps, going back, the facts of each op."""

import gzip
import json

import pytest

from kvref.verify.trace_replay import pool_digest
from kvref.viz.player import TraceError, TracePlayer, read_trace, summarize
from kvref.viz.workloads import record_workload


@pytest.fixture(scope="module")
def pressure():
    return record_workload("pressure")


def test_steps_start_at_new_step_starts(pressure):
    player = TracePlayer(pressure)
    starts = [i for i, op in enumerate(pressure["ops"]) if op["op"] == "new_step_starts"]
    assert [s for s, _ in player.steps] == starts
    assert player.steps[-1][1] == len(pressure["ops"])


def test_a_trace_without_steps_has_one_step_per_op(pressure):
    trace = dict(pressure, ops=[op for op in pressure["ops"] if op["op"] != "new_step_starts"])
    assert len(TracePlayer(trace).steps) == len(trace["ops"])


def test_going_back_gives_the_same_state_as_going_forward(pressure):
    forward = TracePlayer(pressure)
    forward.seek_step(10)
    expected = pool_digest(forward.manager)
    player = TracePlayer(pressure)
    player.seek_step(30)
    player.seek_step(10)
    assert pool_digest(player.manager) == expected
    assert player.current_step == 10 and len(player.history) == 11


def test_facts_find_preemptions_and_evictions(pressure):
    player = TracePlayer(pressure)
    player.seek(len(player.ops))
    preempted = [f for f in player.facts if f.is_preemption]
    assert preempted and all(f.freed_status == "RUNNING" for f in preempted)
    evicting = [f for f in player.facts if f.evicted]
    assert evicting
    for f in evicting:
        hashed_before = set(player.facts[f.index - 1].observed["state"]["hashed"])
        allocated = {b for g in f.observed["ret"] for b in g}
        # evicted = the freshly allocated blocks that had a hash just before
        assert set(f.evicted) == allocated & hashed_before


def test_summary_counts_match_the_facts(pressure):
    s = summarize(pressure)
    player = TracePlayer(pressure)
    player.seek(len(player.ops))
    assert s.preemptions == sum(f.is_preemption for f in player.facts) >= 1
    assert s.evictions == sum(len(f.evicted) for f in player.facts) >= 1
    assert 0 < s.prompt_tokens_saved <= s.hits + s.preempted_hits <= s.queries + s.preempted_queries
    assert s.served_once <= s.prompt_tokens_saved and s.hits <= s.queries
    assert s.num_requests == 8


@pytest.mark.parametrize("content, reason", [
    (None, "no such file"),
    (b"{\"format\": \"kvtrace/1\", \"ops\": [", "not valid JSON"),
    (b"[1, 2]", "is a JSON object"),
    (b"{\"format\": \"kvtrace/2\"}", "not a kvtrace/1 trace"),
    (b"{\"format\": \"kvtrace/1\", \"header\": {}, \"ops\": []}", "header must be"),
])
def test_bad_trace_files_give_one_clear_reason(tmp_path, content, reason):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TraceError, match=reason):
        read_trace(str(path))


def test_a_truncated_gzip_trace_is_reported(tmp_path, pressure):
    data = gzip.compress(json.dumps(pressure).encode())
    path = tmp_path / "t.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="cannot read it"):
        read_trace(str(path))


def test_an_op_on_an_unknown_request_is_a_trace_error(pressure):
    trace = dict(pressure, ops=[{"op": "free", "req": "ghost"}])
    player = TracePlayer(trace)
    with pytest.raises(TraceError, match="op #0 free: unknown request 'ghost'"):
        player.seek(1)


@pytest.mark.parametrize("name", ["pressure", "prefix-caching", "hybrid"])
def test_every_kv_event_is_attributed_to_the_block_it_is_about(name):
    from pathlib import Path

    trace = read_trace(Path(__file__).parent / "traces" / f"kvref-{name}.json.gz")
    player = TracePlayer(trace)
    player.seek(len(player.ops))
    taken = [ev for f in player.facts if f.op["op"] == "take_events"
             for ev in f.observed.get("ret") or []]
    attributed = [(b, i, kind) for b, events in player.kv_events.items() for i, kind in events]
    hashes = {"BlockStored": 0, "BlockRemoved": 0}
    for ev in taken:
        if ev["type"] in hashes:
            hashes[ev["type"]] += len(ev["block_hashes"])
    for kind, n in hashes.items():                  # every hash of every event, once
        assert sum(1 for _, _, k in attributed if k == kind) == n, kind
    assert hashes["BlockStored"] > 0
    # ... each on a block that op changed: given a hash (a block evicted and cached
    # again in one op stays hashed, so only its being touched shows), or losing one.
    for block, i, kind in attributed:
        before = set(player.facts[i - 1].observed["state"]["hashed"]) if i else set()
        after = set(player.facts[i].observed["state"]["hashed"])
        assert block in player.facts[i].touched, (block, i, kind)
        assert block in (after if kind == "BlockStored" else before), (block, i, kind)
