"""Recording a workload as kvtrace/1: what is written, and that it replays identically."""

import copy
import gzip
import json

import pytest

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request
from kvref.engine import ModelFreeRunner, SamplingParams, Scheduler, engine_step
from kvref.verify.trace_record import RecordingKVCacheManager, make_header, write_trace
from kvref.verify.trace_replay import replay
from kvref.viz.player import read_trace
from kvref.viz.workloads import record_workload, workload_names


@pytest.fixture(scope="module")
def traces():
    return {name: record_workload(name) for name in workload_names()}


def _header(num_blocks=16):
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["attn"], FullAttentionSpec(4))])
    return make_header(config, max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                       max_num_batched_tokens=16)


@pytest.mark.parametrize("name", workload_names())
def test_every_workload_replays_on_kvref_with_no_divergence(traces, name):
    trace = traces[name]
    result = replay(trace, compare_hashes=True, check_invariants=True)
    assert result.divergence is None, str(result.divergence)
    assert result.num_ops == len(trace["ops"]) > 20


def test_a_recorded_trace_is_a_test_that_can_fail(traces):
    bad = copy.deepcopy(traces["chat"])
    i = next(i for i, op in enumerate(bad["ops"])
             if op["op"] == "get_computed_blocks" and op["expect"]["ret"]["num_computed_tokens"])
    bad["ops"][i]["expect"]["ret"]["num_computed_tokens"] -= 4
    result = replay(bad)
    assert result.divergence is not None and result.divergence.index == i


def test_every_op_carries_an_expect_and_hashes_are_comparable(traces):
    for trace in traces.values():
        assert trace["format"] == "kvtrace/1" and trace["header"]["hash"]["none_hash_seed"]
        assert all("expect" in op for op in trace["ops"])
        assert trace["ops"][0]["op"] == "new_step_starts"


def test_the_scheduler_bookkeeping_is_written_before_the_call_that_needs_it():
    rec = RecordingKVCacheManager(_header())
    scheduler = Scheduler(rec, max_num_batched_tokens=16)
    scheduler.new_request("a", list(range(10)), SamplingParams(max_tokens=2, ignore_eos=True))
    runner = ModelFreeRunner(vocab_size=50)
    while scheduler.has_unfinished_requests():
        engine_step(scheduler, runner)
    names = [(op["op"], op.get("value")) for op in rec.ops]
    # step 1 schedules the prompt; step 2 first says what the scheduler set.
    second = names.index(("new_step_starts", None), 1)
    after = names[second:]
    assert ("set_status", "RUNNING") in after and ("set_num_computed_tokens", 10) in after
    assert after.index(("append_output_token_ids", None)) < after.index(("allocate_slots", None))
    # ... and, as vLLM's, takes the step's KV events at the end of update_from_output.
    assert names[-3:] == [("set_status", "FINISHED_LENGTH_CAPPED"), ("free", None),
                          ("take_events", None)]


def test_only_recordable_hit_blocks_are_accepted():
    rec = RecordingKVCacheManager(_header())
    req = Request("a", list(range(9)))
    foreign = rec.manager.create_kv_cache_blocks(([rec.manager.block_pool.blocks[3]],))
    with pytest.raises(ValueError, match="new_computed_blocks must be"):
        rec.allocate_slots(req, 9, 4, foreign)


def test_writes_to_the_pool_behind_the_recorders_back_are_refused():
    rec = RecordingKVCacheManager(_header())
    assert rec.block_pool.get_num_free_blocks() == 15
    with pytest.raises(AttributeError, match="cannot record block_pool.free_blocks"):
        rec.block_pool.free_blocks([])


def test_written_trace_reads_back_equal_one_op_per_line(tmp_path, traces):
    trace = traces["prefix-caching"]
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    write_trace(trace, plain)
    write_trace(trace, packed)
    assert read_trace(str(plain)) == json.loads(json.dumps(trace)) == read_trace(str(packed))
    lines = plain.read_text().splitlines()
    assert sum(1 for line in lines if line.startswith('    {"op": ')) == len(trace["ops"])
    assert gzip.open(packed, "rt").read() == plain.read_text()


def test_unrecordable_calls_say_so():
    rec = RecordingKVCacheManager(_header())
    with pytest.raises(AttributeError, match="no recordable 'pop_blocks_for_free'"):
        rec.pop_blocks_for_free
