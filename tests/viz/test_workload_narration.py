"""The scheduler workloads' narration agrees with what their traces show."""

import re

import pytest

from kvref.viz.player import TracePlayer
from kvref.viz.workloads import PRESETS, record_workload


@pytest.mark.parametrize("name", ["chat", "multi-turn", "pressure", "hybrid"])
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
