"""Ops in words, events, figures over time, and whole frames within 80 columns."""

import pytest

from kvref.viz.panels import describe_op, render_events, render_frame, render_stats, sparkline
from kvref.viz.player import TracePlayer, summarize
from kvref.viz.panels import render_summary
from kvref.viz.workloads import record_workload, workload_names
from tests.viz.helpers import text_of, widest_line


@pytest.fixture(scope="module")
def traces():
    return {name: record_workload(name, max_steps=12) for name in workload_names()}


@pytest.mark.parametrize("name", workload_names())
def test_every_frame_of_every_workload_fits_80_columns(traces, name):
    player = TracePlayer(traces[name])
    for k in range(len(player.steps)):
        player.seek_step(k)
        text = text_of(render_frame(player))
        assert widest_line(text) <= 80, (k, text)
    assert f"step {len(player.steps) - 1}/" in text


def test_describe_op_tells_hits_allocations_and_frees(traces):
    player = TracePlayer(traces["chat"])
    player.seek(len(player.ops))
    lines = [describe_op(f) for f in player.facts]
    assert "user0 arrives with" in lines[1]
    assert any(line.startswith("user1 looks up the prefix cache: 24 of ") for line in lines)
    assert any(line.startswith("user0 finishes (finished_length_capped)") for line in lines)


def test_events_of_the_step_are_listed(traces):
    player = TracePlayer(traces["chat"])
    player.seek_step(0)
    text = text_of(render_events(player.step_facts()))
    assert "events this step: 1" in text
    prompt = next(op["prompt"] for op in player.ops if op["op"] == "add_request")
    full = len(prompt) // 4                     # user0 alone: every full block stored
    assert f"stored  g0 {full} block(s), {4 * full} tokens, full_attention" in text


def test_stats_follow_usage_evictable_and_hit_rate_per_step(traces):
    player = TracePlayer(traces["chat"])
    player.seek_step(5)
    text = text_of(render_stats(player))
    h = player.history[-1]
    assert len(player.history) == 6
    assert f"{h.usage:.0%}" in text and f"{h.evictable_cached} blocks" in text
    assert f"({h.hits}/{h.queries} tokens)" in text


def test_sparkline_scales_to_the_top_value():
    assert sparkline([0, 0.5, 1.0], 1.0) == "▁▅█"
    assert sparkline([0, 0]) == "▁▁"
    assert len(sparkline(list(range(100)))) == 48


def test_summary_table_shows_the_totals(traces):
    s = summarize(traces["pressure"])
    text = text_of(render_summary(s))
    assert f"{s.hit_rate:.1%} ({s.hits} of {s.queries} tokens)" in text
    assert "preemptions" in text and str(s.preemptions) in text
