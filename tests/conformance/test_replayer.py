"""The replayer itself must notice a difference: a checker that cannot fail proves nothing."""

import copy
from pathlib import Path

import pytest

from kvref.verify.trace_replay import (
    MalformedTrace,
    TraceReplayer,
    first_difference,
    load_trace,
    replay,
)

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


def _header(groups, num_blocks=16):
    return {"num_blocks": num_blocks, "groups": groups,
            "manager": {"max_model_len": 64, "scheduler_block_size": 4,
                        "hash_block_size": 4, "enable_caching": True},
            "hash": {"algo": "sha256", "none_hash_seed": "0"}}


def test_rswa_and_sink_group_kinds_build_their_managers():
    rswa = TraceReplayer(_header([{"kind": "rswa", "block_size": 4, "rswa_window": 8}]))
    (manager,) = rswa.manager.coordinator.single_type_managers
    assert type(manager).__name__ == "RSWAManager" and manager.rswa_window == 8
    sink = TraceReplayer(_header([{"kind": "sink_full", "block_size": 4, "sink_len": 8}]))
    (manager,) = sink.manager.coordinator.single_type_managers
    assert [b.block_id for b in manager.sink_blocks] == [1, 2]
    assert sink.initial_observation()["num_free_blocks"] == 16 - 1 - 2


def test_prompt_embeds_join_the_block_hash_and_must_match_the_prompt():
    replayer = TraceReplayer(_header([{"kind": "full", "block_size": 4}]))
    prompt = [11, 12, 13, 14]
    plain = replayer.run({"op": "add_request", "req": "a", "prompt": prompt})["ret"]
    embeds = {"dtype": "float32", "rows": [[1.0, 2.0]] * 4}
    with_embeds = replayer.run({"op": "add_request", "req": "b", "prompt": prompt,
                                "prompt_embeds": embeds})["ret"]
    assert plain["num_block_hashes"] == with_embeds["num_block_hashes"] == 1
    assert plain["last_block_hash"] != with_embeds["last_block_hash"]
    with pytest.raises(MalformedTrace, match="one row"):
        replayer.run({"op": "add_request", "req": "c", "prompt": prompt,
                      "prompt_embeds": {"dtype": "float32", "rows": [[1.0]] * 3}})
    with pytest.raises(MalformedTrace, match="dtype"):
        replayer.run({"op": "add_request", "req": "d", "prompt": prompt,
                      "prompt_embeds": {"dtype": "float99", "rows": [[1.0]] * 4}})
