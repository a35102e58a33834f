"""The scheduler workloads' narration agrees with what their traces show."""

import re

import pytest

from kvref.viz.player import TracePlayer
from kvref.viz.workloads import PRESETS, record_workload


@pytest.mark.parametrize("name", ["chat", "multi-turn", "pressure", "hybrid", "connector"])
def test_each_step_story_matches_the_ops_of_that_step(name):
    trace = record_workload(name)
    player = TracePlayer(trace)
    assert len(player.narration) == len(player.steps)
    seen_preemption = seen_resume = False
    for k in range(len(player.steps)):
        player.seek_step(k)
        story = player.narration[k]
        facts = player.step_facts()
        # every admission names the request and the hit its lookup found
        for rid, hit in re.findall(r"(\S+) admitted, (\d+) prompt tokens from the cache", story):
            lookups = [f for f in facts if f.hit_tokens is not None and f.op["req"] == rid]
            assert lookups and lookups[-1].hit_tokens == int(hit), (k, story)
        for rid, hit in re.findall(r"(\S+) resumed \((\d+) tokens hit\)", story):
            lookups = [f for f in facts if f.hit_tokens is not None and f.op["req"] == rid]
            assert lookups[-1].hit_tokens == int(hit), (k, story)
            seen_resume = True
        for rid in re.findall(r"(\S+) admitted, no prefix hit", story):
            assert any(f.op.get("req") == rid and f.hit_tokens == 0 for f in facts), (k, story)
        preempted = re.search(r"preempted \(pool full\): ([^;.]+)", story)
        frees = {f.op["req"] for f in facts if f.is_preemption}
        assert set(preempted.group(1).split(", ") if preempted else []) == frees, (k, story)
        seen_preemption |= bool(frees)
        finished = re.search(r"finished: ([^;]+);", story)
        done = {f.op["req"] for f in facts if f.op["op"] == "free" and not f.is_preemption}
        assert set(finished.group(1).split(", ") if finished else []) == done, (k, story)
    assert seen_preemption == seen_resume == (name == "pressure")


def test_every_preset_describes_itself():
    for name, make in PRESETS.items():
        preset = make()
        assert preset.name == name and preset.description and preset.arrivals


def test_connector_narration_tells_each_load_as_the_trace_records_it():
    trace = record_workload("connector")
    story = " ".join(trace["narration"].values())
    ops = trace["ops"]
    async_loads = {op["req"]: op for op in ops
                   if op["op"] == "allocate_slots" and op.get("delay_cache_blocks")}
    # every asynchronous load the trace records is told, with its external tokens
    told = dict(re.findall(r"(\S+) loads (\d+) prompt tokens from the remote prefill", story))
    assert {r: int(n) for r, n in told.items()} == {
        r: op["num_external_computed_tokens"] for r, op in async_loads.items()}
    assert set(told) == set(PRESETS["connector"]().remote)
    # the load admitted beside a prefill in flight says the reserve it was given
    reserved = {r: op["reserved_blocks"] for r, op in async_loads.items()
                if op.get("reserved_blocks")}
    assert reserved and all(f"reserved_blocks={n}" in story for n in reserved.values())
    # d3 shares d0's system prompt but arrives while d0 loads: no hit; d5 after: a hit
    assert "d3 loads 22 prompt tokens from the remote prefill (0 hit here)" in story
    assert "(16 hit here)" in story.split("d5 loads")[1].split(";")[0]
    # the failed block: one failure, recomputed from the block before it
    assert re.search(r"block \d+ of d2 failed to load: d2 keeps the 2 blocks", story)
    cached = [op for op in ops if op["op"] == "cache_blocks" and op["req"] == "d2"]
    assert cached[0]["num_computed_tokens"] == 8


def test_connector_workload_finishes_every_request_failed_load_included():
    trace = record_workload("connector")
    finished = set()
    for text in trace["narration"].values():
        m = re.search(r"finished: ([^;]+);", text)
        finished |= set(m.group(1).split(", ")) if m else set()
    assert finished == {a.request_id for a in PRESETS["connector"]().arrivals}
    assert "still loading" not in list(trace["narration"].values())[-1]


def test_a_false_connector_claim_stops_the_recording(monkeypatch):
    from kvref.viz import workloads

    monkeypatch.setattr(workloads._LoadNarrator, "_cached",
                        lambda self, ids: [True] * len(ids))   # "everything is cached"
    with pytest.raises(workloads.NarrationError, match="held uncached"):
        record_workload("connector")
