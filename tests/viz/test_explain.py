"""kvref explain: the reasons it gives are the numbers the manager used."""

import pytest

from kvref.viz.explain import explain
from kvref.viz.player import TracePlayer
from kvref.viz.tables import compress_ids
from kvref.viz.workloads import record_workload
from kvref.viz.walkthroughs import PrefixCachingWalkthrough, SlidingWindowWalkthrough


@pytest.fixture(scope="module")
def pressure():
    trace = record_workload("pressure")
    player = TracePlayer(trace)
    player.seek(len(player.ops))
    return trace, player.facts


def test_a_refused_allocation_names_the_gate_and_the_shortfall(pressure):
    trace, facts = pressure
    refused = next(f for f in facts if f.op["op"] == "allocate_slots"
                   and f.observed.get("ret") is None
                   and not f.op.get("full_sequence_must_fit"))
    player = TracePlayer(trace)
    player.seek(refused.index)
    free = player.manager.block_pool.get_num_free_blocks()
    text = "\n".join(explain(trace, refused.index))
    assert "REFUSED by the capacity gate" in text
    needed = int(text.split("needs ")[1].split(" block")[0])
    watermark = int(text.split(" + ")[1].split(" watermark")[0])
    assert f"short by {needed + watermark - free}" in text and needed + watermark > free


def test_a_refused_admission_names_the_full_sequence_gate(pressure):
    # The scheduler admits a waiting request only if its whole sequence fits
    # (vLLM's scheduler_reserve_full_isl): the pressure workload's first refusal.
    trace, facts = pressure
    refused = next(f for f in facts if f.op["op"] == "allocate_slots"
                   and f.observed.get("ret") is None)
    assert refused.op.get("full_sequence_must_fit") is True
    player = TracePlayer(trace)
    player.seek(refused.index)
    free = player.manager.block_pool.get_num_free_blocks()
    text = "\n".join(explain(trace, refused.index))
    assert "full-sequence gate: the whole request needs" in text
    needed = int(text.split("needs ")[1].split(" block")[0])
    watermark = int(text.split(" + ")[1].split(" watermark")[0])
    assert f"{free} are free: short by {needed + watermark - free}" in text


def test_an_evicting_allocation_lists_the_evicted_blocks(pressure):
    trace, facts = pressure
    f = next(f for f in facts if f.evicted)
    text = "\n".join(explain(trace, f.index))
    assert f"evicted cached block(s) {compress_ids(f.evicted)}:" in text
    assert "least recently freed" in text


def test_a_preemption_free_says_where_the_blocks_went(pressure):
    trace, facts = pressure
    f = next(f for f in facts if f.is_preemption)
    text = "\n".join(explain(trace, f.index))
    assert "preempted" in text and "TAIL of the free queue" in text


def _lookup(trace, req):
    return next(i for i, op in enumerate(trace["ops"])
                if op["op"] == "get_computed_blocks" and op["req"] == req)


def test_the_cap_is_named_when_it_stops_the_hit():
    trace = PrefixCachingWalkthrough().record()
    text = "\n".join(explain(trace, _lookup(trace, "D")))
    assert "all 3 hashed blocks are cached" in text
    assert "block 2 is cached but recomputed" in text and "a whole block" in text
    assert "agreed hit: 8 tokens" in text


def test_a_missed_hash_is_named_with_its_tokens():
    trace = PrefixCachingWalkthrough().record()
    text = "\n".join(explain(trace, _lookup(trace, "B")))
    assert "block 2 (tokens 8-11) missed" in text
    assert "cached but recomputed" not in text


def test_a_first_lookup_on_an_empty_cache_says_it_is_empty():
    trace = PrefixCachingWalkthrough().record()
    text = "\n".join(explain(trace, _lookup(trace, "A")))
    assert "block 0 (tokens 0-3) missed" in text
    assert "the pool holds no cached block yet" in text
    assert "not empty" not in text


def test_a_miss_on_a_warm_cache_counts_what_it_holds(multi_turn):
    trace, op = multi_turn, 233
    text = "\n".join(explain(trace, op))
    assert "block 0 (tokens 0-" in text and "missed" in text
    held = int(text.split("the pool holds ")[1].split(" cached blocks")[0])
    assert held > 0 and "the cache is not empty" in text


def test_the_hybrid_fixed_point_names_the_limiting_group():
    trace = SlidingWindowWalkthrough().record()
    text = "\n".join(explain(trace, _lookup(trace, "C")))
    assert "g0 (full) alone would hit 16 tokens" in text
    assert "g1 (window 8) is what limits the hit to 8 tokens" in text


def test_an_op_out_of_range_is_an_index_error():
    trace = PrefixCachingWalkthrough().record()
    with pytest.raises(IndexError, match="out of range"):
        explain(trace, len(trace["ops"]))


@pytest.fixture(scope="module")
def multi_turn():
    return record_workload("multi-turn")


def test_a_next_chat_turn_stops_where_the_last_turn_ended(multi_turn):
    text = "\n".join(explain(multi_turn, _lookup(multi_turn, "c0.t1")))
    t0 = next(op for op in multi_turn["ops"] if op.get("req") == "c0.t0"
              and op["op"] == "add_request")
    previous = len(t0["prompt"]) + t0["max_tokens"]          # prompt + its outputs
    assert f"c0.t0, is a prefix of this one: it ends after {previous} tokens" in text
    assert f"agreed hit: {previous // 4 * 4} tokens" in text


def test_a_changed_early_token_is_found(multi_turn):
    text = "\n".join(explain(multi_turn, _lookup(multi_turn, "c2.t1")))
    assert "block 0 (tokens 0-3) missed" in text
    assert "token 2 differs (block 0)" in text
    assert "cached blocks" in text and "the cache is not empty" in text
