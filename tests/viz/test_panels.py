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
    assert f"stored  g0 {full} blocks, {4 * full} tokens, full_attention" in text


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


def test_summary_says_why_queries_exceed_the_prompt_tokens(traces):
    """vLLM's queries count every lookup; the summary says so, and its reason adds up."""
    trace = record_workload("pressure")
    s = summarize(trace)
    player = TracePlayer(trace)
    player.seek(len(player.ops))
    pending, refused, lookups = {}, 0, 0
    for f in player.facts:
        if f.hit_tokens is not None:
            pending[f.op["req"]] = f.hit_tokens
            lookups += f.query_tokens
        elif f.op["op"] == "allocate_slots" and f.op["req"] in pending:
            hit = pending.pop(f.op["req"])
            refused += hit if f.observed.get("ret") is None else 0
    assert s.queries + s.preempted_queries == lookups > s.prompt_tokens
    # Every hit token, vLLM's or a preempted request's, was saved or refused.
    assert s.hits + s.preempted_hits == s.prompt_tokens_saved + refused
    assert s.preempted_queries > 0 and s.served_once <= s.prompt_tokens_saved
    text = " ".join(text_of(render_summary(s)).split())
    assert ("vLLM counts a query each time the scheduler looks a request up: again each "
            "step a request waits for room, and again after a preemption (preempted "
            "requests, counted apart: each retry after a preemption is a query)") in text
    assert f"preempted requests, counted apart │ {s.preempted_hits} of " \
        f"{s.preempted_queries} tokens" in text
    quiet = summarize(record_workload("prefix-caching"))
    assert quiet.queries == quiet.prompt_tokens and quiet.preempted_queries == 0
    quiet_text = text_of(render_summary(quiet))
    assert "counts a query" not in quiet_text and "counted apart" not in quiet_text


@pytest.mark.parametrize("name", workload_names())
def test_summary_counts_match_the_last_frame(traces, name):
    """The summary's step and op totals are the last frame's numbers plus one (0-based)."""
    s = summarize(traces[name])
    player = TracePlayer(traces[name])
    player.seek_step(len(player.steps) - 1)
    frame = text_of(render_frame(player))
    assert f"step {s.num_steps - 1}/{s.num_steps - 1}, op {s.num_ops - 1}/{s.num_ops - 1}" \
        in frame
    assert f"steps 0-{s.num_steps - 1} and ops 0-{s.num_ops - 1}" in \
        " ".join(text_of(render_summary(s)).split())


def test_a_refused_allocation_names_every_token_it_asked_room_for():
    from kvref.viz.player import OpFacts
    facts = OpFacts(0, {"op": "allocate_slots", "req": "r", "num_new_tokens": 0,
                        "num_external_computed_tokens": 20}, {"ret": None})
    assert describe_op(facts) == ("r: no room for 0 new tokens + 20 loaded externally "
                                  "(allocate_slots → None)")
    facts = OpFacts(0, {"op": "allocate_slots", "req": "r", "num_new_tokens": 1,
                        "num_lookahead_tokens": 3}, {"ret": None})
    assert describe_op(facts) == "r: no room for 1 new token + 3 lookahead (allocate_slots → None)"


def test_one_block_and_one_token_are_singular():
    from kvref.viz.player import OpFacts
    one = OpFacts(0, {"op": "allocate_slots", "req": "r", "num_new_tokens": 1}, {"ret": [[7]]})
    assert describe_op(one) == "r schedules 1 token, new block 7"
    two = OpFacts(0, {"op": "allocate_slots", "req": "r", "num_new_tokens": 8},
                  {"ret": [[7, 8]]})
    assert describe_op(two) == "r schedules 8 tokens, new blocks 7-8"
    loaded = OpFacts(0, {"op": "allocate_slots", "req": "r", "num_new_tokens": 0,
                         "num_external_computed_tokens": 20}, {"ret": [[3, 4, 5, 6, 7]]})
    assert describe_op(loaded) == ("r schedules 0 tokens (+ 20 loaded externally), "
                                   "new blocks 3-7")
    player = TracePlayer(record_workload("prefix-caching"))
    player.seek(len(player.ops))
    text = " ".join(text_of(render_frame(player)).split())
    assert " 1 blocks" not in text and "0 blocks" in text


@pytest.mark.parametrize("name", ["chat", "multi-turn", "pressure", "hybrid"])
def test_narrated_free_blocks_are_the_ones_the_picture_shows(name):
    """Each step's narration states the free-block count of that step's frame."""
    import re
    player = TracePlayer(record_workload(name))
    for k in range(len(player.steps)):
        player.seek_step(k)
        story = player.narration[k]
        free, total, empty, cached = map(int, re.search(
            r"(\d+) of (\d+) blocks free at the end of the step \((\d+) empty, "
            r"(\d+) cached and evictable\)", story).groups())
        pool = player.manager.block_pool
        frame = text_of(render_frame(player))
        assert (free, total) == (pool.get_num_free_blocks(), pool.num_gpu_blocks - 1), (k, story)
        assert f"evictable cached {cached}  free empty {empty}" in frame, (k, story)
