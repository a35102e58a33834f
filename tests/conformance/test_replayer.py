"""The replayer itself must notice a difference: a checker that cannot fail proves nothing."""

import copy
from pathlib import Path

from kvref.verify.trace_replay import first_difference, load_trace, replay

TRACE = Path(__file__).parent / "traces" / "full" / "full-public-00001.json.gz"


def _first_op_with(trace, predicate):
    return next(i for i, op in enumerate(trace["ops"]) if predicate(op))


def test_a_changed_block_id_is_reported_at_its_op():
    trace = load_trace(TRACE)
    i = _first_op_with(trace, lambda op: op["op"] == "allocate_slots"
                       and op["expect"].get("ret"))
    bad = copy.deepcopy(trace)
    bad["ops"][i]["expect"]["ret"][0][0] += 1000
    result = replay(bad)
    assert result.divergence is not None
    assert result.divergence.index == i
    assert result.divergence.path == "ret[0][0]"


def test_a_changed_free_queue_order_is_reported():
    trace = load_trace(TRACE)
    i = _first_op_with(trace, lambda op: len(op["expect"].get("state", {}).get("free", [])) > 1)
    bad = copy.deepcopy(trace)
    free = bad["ops"][i]["expect"]["state"]["free"]
    free[0], free[1] = free[1], free[0]
    result = replay(bad)
    assert result.divergence is not None and result.divergence.index == i
    assert result.divergence.path == "state.free[0]"


def test_a_changed_event_hash_is_reported():
    trace = load_trace(TRACE)
    i = _first_op_with(trace, lambda op: op["op"] == "take_events" and any(
        ev["type"] == "BlockStored" for ev in op["expect"].get("ret", [])))
    bad = copy.deepcopy(trace)
    event = next(ev for ev in bad["ops"][i]["expect"]["ret"] if ev["type"] == "BlockStored")
    event["block_hashes"][0] = "0" * 16
    assert replay(bad).divergence.index == i


def test_a_missing_exception_is_reported():
    trace = load_trace(TRACE)
    i = _first_op_with(trace, lambda op: op["op"] == "usage")
    bad = copy.deepcopy(trace)
    bad["ops"][i]["expect"] = {"raises": "ValueError"}
    result = replay(bad)
    assert result.divergence.index == i and result.divergence.path == "raises"


def test_first_difference_is_strict_about_types_and_lengths():
    assert first_difference(1, True) == (".", 1, True)
    assert first_difference([1, 2], [1, 2, 3]) == (". (length)", [1, 2], [1, 2, 3])
    assert first_difference({"a": 1}, {"a": 1, "b": 2}) == (".b", "<missing>", 2)
    assert first_difference(0.5, 0.5 + 1e-12) is None
    assert first_difference(0.5, 0.51) == (".", 0.5, 0.51)
