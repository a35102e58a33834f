"""vLLM 0.25.1's own Scheduler and AsyncScheduler, replayed on kvref: 0 divergent steps.

``vllm_scheduler_traces/*.json.gz`` were recorded by
``tools/record_vllm_scheduler.py`` from vLLM's real schedulers (README.md
there). Each profile file is one test; every run in it must replay with
identical decisions, tokens and block tables, and the manager's invariants
hold after every engine iteration. vLLM is not needed here.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvref.verify.scheduler_replay import load_trace, replay_file, replay_run

TRACE_DIR = Path(__file__).parent / "vllm_scheduler_traces"
TRACES = sorted(TRACE_DIR.glob("*.json.gz"))
CONNECTOR_TRACES = [p for p in TRACES if p.name.startswith("conn_")]


def test_the_profiles_cover_what_the_issue_asks_for():
    """Sync and async, with and without speculation, tight pools, sliding window."""
    docs = {p.name.removesuffix(".json.gz"): load_trace(p) for p in TRACES}
    configs = [run["config"] for doc in docs.values() for run in doc["runs"]]

    def count(pred):
        return sum(1 for c in configs if pred(c))
    assert count(lambda c: not c["async_scheduling"] and not c["speculative"]) >= 50
    assert count(lambda c: not c["async_scheduling"] and c["speculative"]) >= 20
    assert count(lambda c: c["async_scheduling"] and not c["speculative"]) >= 20
    assert count(lambda c: c["async_scheduling"] and c["speculative"]) >= 10
    assert count(lambda c: len(c["groups"]) == 2) >= 10            # full + sliding window
    assert count(lambda c: c.get("hash_block_size", c["block_size"])
                 != c.get("scheduler_block_size", c["block_size"])) >= 5   # mixed block sizes
    assert count(lambda c: c["watermark"] > 0) >= 5
    assert count(lambda c: c["long_prefill_token_threshold"] > 0) >= 5
    assert count(lambda c: not c["scheduler_reserve_full_isl"]) >= 5
    assert count(lambda c: c["eos_token_id"] is not None) >= 10
    events = [e for doc in docs.values() for run in doc["runs"] for e in run["events"]]
    schedules = [e for e in events if e["op"] == "schedule"]
    assert sum(len(e["preempted"]) for e in schedules) >= 100        # tight pools preempt
    assert sum(len(e["resumed"]) for e in schedules) >= 100
    # vLLM's padding of a waiting request to 1 + k with -1 drafts happens in the traces.
    assert any(t and all(x == -1 for x in t) and rid in e["new"] + e["resumed"]
               for e in schedules for rid, t in e["spec"].items())
    assert any(e.get("placeholders") for e in schedules)
    for doc in docs.values():
        assert doc["vllm_version"].startswith("0.25.1")


def _replay_with_hash_seed_0(path: Path) -> list[dict]:
    """Replay in a Python started with PYTHONHASHSEED=0, as the recording was made:
    with a connector, vLLM's scheduler iterates sets of request ids (requests that
    failed a load finish, held blocks are freed, in set order), and kvref's does
    the same, so the two agree only under the same seed."""
    if os.environ.get("PYTHONHASHSEED") == "0":
        return [vars(r) for r in replay_file(path)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-m", "kvref.verify.scheduler_replay", str(path)],
                          env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_profile_replays_with_zero_divergent_steps(path):
    doc = load_trace(path)
    if path in CONNECTOR_TRACES:
        results = [SimpleNamespace(**r) for r in _replay_with_hash_seed_0(path)]
        assert len(results) == len(doc["runs"])
    else:
        results = [replay_run(run, f"{doc['profile']}[{i}]")
                   for i, run in enumerate(doc["runs"])]
    bad = [r for r in results if r.divergence]
    assert sum(r.num_steps for r in results) == doc["summary"]["steps"]
    assert not bad, "\n".join(f"{r.name}: {r.divergent_steps} divergent steps; first: "
                              f"{r.divergence}" for r in bad)


def test_the_padding_and_its_refusal_branch_are_exercised():
    """kvref's counters, over the speculation traces: vLLM padded admissions to
    1 + k, and stopped admitting when 1 + k did not fit, and kvref did both at
    the same steps (the replay found no divergence)."""
    padded = refused = 0
    for path in TRACES:
        doc = load_trace(path)
        if not any(run["config"]["speculative"] for run in doc["runs"]):
            continue
        for i, run in enumerate(doc["runs"]):
            result = replay_run(run, f"{doc['profile']}[{i}]")
            assert result.divergence is None, result.divergence
            padded += result.stats.num_padded_admissions
            refused += result.stats.num_padding_refusals
    assert padded >= 20 and refused >= 5, (padded, refused)


def _gate_minimal() -> dict:
    return load_trace(TRACE_DIR / "gate_minimal.json.gz")["runs"][0]


def test_the_issues_smallest_case_keeps_b_waiting():
    """Block 4, 13 blocks, max_model_len 48, budget 8: b (40 tokens, 10 blocks) waits
    while a (8 tokens) runs, because only 9 blocks are free at step 1."""
    run = _gate_minimal()
    step1 = next(e for e in run["events"] if e["op"] == "schedule" and e["step"] == 1)
    assert step1["tokens"] == [["a", 1]] and step1["waiting"] == ["b"] and step1["free"] == 9
    assert not any(e["op"] == "schedule" and e["preempted"] for e in run["events"])
    assert replay_run(run).divergence is None


def test_the_replay_sees_a_missing_gate():
    """The same trace with kvref's gate switched off diverges at step 1 (kvref
    would admit b, prefill it part way, then preempt it): the replay can fail."""
    run = copy.deepcopy(_gate_minimal())
    run["config"]["scheduler_reserve_full_isl"] = False
    result = replay_run(run)
    assert result.divergence and "step 1" in result.divergence, result.divergence
    assert result.divergent_steps > 1


def test_the_replay_sees_missing_speculative_padding(monkeypatch):
    """Replaying a speculation trace with k = 0 on the scheduler side (no padding to
    1 + k) but the same drafter diverges where vLLM padded a waiting request."""
    from kvref.verify import scheduler_replay

    doc = load_trace(TRACE_DIR / "ngram.json.gz")
    padded = [i for i, run in enumerate(doc["runs"])
              if any(e["op"] == "schedule" and any(
                  rid in e["new"] + e["resumed"] for rid in e["spec"]) for e in run["events"])]
    assert padded
    original = scheduler_replay.build_engine

    def without_padding(config):
        scheduler, runner = original(config)
        scheduler.num_spec_tokens = 0
        return scheduler, runner
    monkeypatch.setattr(scheduler_replay, "build_engine", without_padding)
    result = replay_run(doc["runs"][padded[0]])
    assert result.divergence is not None and result.divergent_steps > 0


def test_llm_defaults_are_the_ones_vllm_resolves_on_cpu():
    """The llm_defaults runs used the batch limits vLLM's own EngineArgs gives
    vllm.LLM on CPU; kvref's LLM resolves the same ones (no torch model needed)."""
    from kvref.entrypoints.llm import resolve_batch_limits

    doc = load_trace(TRACE_DIR / "llm_defaults.json.gz")
    for L, chunked, tokens, seqs, want_tokens, want_seqs in doc["llm_defaults_grid"]:
        assert resolve_batch_limits("cpu", L, tokens, seqs, chunked) == (want_tokens, want_seqs), \
            (L, chunked, tokens, seqs)
    for run in doc["runs"]:
        config = run["config"]
        assert config["llm_defaults"]
        assert resolve_batch_limits("cpu", config["max_model_len"]) == (
            config["max_num_batched_tokens"], config["max_num_seqs"]) == (4096, 256)


# -- KV connector runs: vLLM's scheduler driving the simulated connector -----------


def _connector_counts() -> dict:
    """What the connector runs exercised, counted from vLLM's recorded calls."""
    counts: dict[str, int] = {}

    def add(key, n=1):
        counts[key] = counts.get(key, 0) + n
    for path in CONNECTOR_TRACES:
        doc = load_trace(path)
        for run in doc["runs"]:
            config = run["config"]
            add(f"policy {config['connector']['policy']}")
            add("async scheduling" if config["async_scheduling"] else "sync scheduling")
            external: set[str] = set()
            for event in run["events"]:
                if event["op"] == "schedule":
                    add("preempted with external tokens",
                        sum(r in external for r in event["preempted"]))
                if event["op"] == "abort":
                    add("aborted stalls")
                for call in event["conn"]:
                    if call[0] == "get_num_new_matched_tokens":
                        n, load_async = call[3]
                        add("ask again" if n is None else "async load" if load_async
                            else "sync load" if n else "no external hit")
                    elif call[0] == "update_state_after_alloc" and call[3]:
                        external.add(call[1])
                    elif call[0] == "request_finished" and call[4][0]:
                        add("producer holds")
                    elif call[0] == "update_connector_output" and call[3]:
                        add(f"failed loads under {config['connector']['policy']}")
                    elif call[0] == "build_connector_meta":
                        for blocks, load_async, delay, failed in call[1]["loads"].values():
                            if load_async and failed and failed[0] == blocks[0]:
                                add("async loads failing in their first block")
                            if load_async and delay >= 4:
                                add("loads landing 4+ steps later")
                for call in event["kv"]:
                    if call[0] == "alloc" and call[6] > 0:
                        add("admissions with reserved_blocks"
                            if call[8] is not None else "refusals with reserved_blocks")
                    elif call[0] == "pop":
                        add("deferred frees")
                    elif call[0] == "evict":
                        add("evictions of failed blocks")
                for batch in event.get("published", ()):
                    add("connector events published",
                        sum(e[0] == "BlockStored" and e[5] == "SIM" for e in batch))
    return counts


def test_the_connector_profiles_cover_what_the_issue_asks_for():
    """Sync and async loads, late loads, failures under both policies and before
    they land, producer holds, reserved_blocks deciding, preemption of requests
    with external tokens, deferred frees; sync and async scheduling."""
    counts = _connector_counts()
    for key, least in [("policy recompute", 20), ("policy fail", 10),
                       ("sync scheduling", 20), ("async scheduling", 20),
                       ("sync load", 50), ("async load", 50), ("ask again", 20),
                       ("loads landing 4+ steps later", 20),
                       ("failed loads under recompute", 10), ("failed loads under fail", 10),
                       ("async loads failing in their first block", 5),
                       ("producer holds", 30), ("admissions with reserved_blocks", 10),
                       ("refusals with reserved_blocks", 10),
                       ("preempted with external tokens", 10), ("deferred frees", 10),
                       ("evictions of failed blocks", 3), ("connector events published", 30)]:
        assert counts.get(key, 0) >= least, (key, counts.get(key, 0), counts)


def test_the_replay_sees_a_connector_divergence(monkeypatch):
    """The replay compares the connector's calls: kvref with the other failure
    policy, or without reserved_blocks, diverges from vLLM's recordings."""
    from kvref.verify import scheduler_replay

    def first_run_with(pred):
        for path in CONNECTOR_TRACES:
            for run in load_trace(path)["runs"]:
                if any(pred(c) for e in run["events"] for c in e["conn"] + e["kv"]):
                    return run
        raise AssertionError("no such run")

    failing = copy.deepcopy(first_run_with(
        lambda c: c[0] == "update_connector_output" and c[3]))
    policy = failing["config"]["connector"]["policy"]
    failing["config"]["connector"]["policy"] = "fail" if policy == "recompute" else "recompute"
    assert replay_run(failing).divergence is not None

    reserved = first_run_with(lambda c: c[0] == "alloc" and c[6] > 0 and c[8] is None)
    original = scheduler_replay.build_engine

    def no_reservation(config):
        scheduler, runner = original(config)
        scheduler._inflight_prefill_reserved_blocks = lambda: 0
        return scheduler, runner
    monkeypatch.setattr(scheduler_replay, "build_engine", no_reservation)
    result = replay_run(reserved)
    assert result.divergence is not None and result.divergent_steps > 0


def test_a_recorded_stall_is_the_head_of_line_block_and_kvref_stalls_alike():
    """conn_async_sched_tight run 25: r0 answered "ask again" twice, so it waits in
    skipped_waiting ahead of everything; r1's and r2's asynchronous loads were
    admitted and landed, but each step the waiting loop looks at r0 first, r0's own
    load does not fit beside them, admission stops, and r1 and r2 are never
    promoted (vLLM 0.25.1 scheduler.py:917-925). Nothing runs until the run aborts
    (its rule: 12 idle iterations); kvref's replay of the file is identical."""
    run = load_trace(TRACE_DIR / "conn_async_sched_tight.json.gz")["runs"][25]
    abort = next(e for e in run["events"] if e["op"] == "abort")
    before = run["events"][:run["events"].index(abort)]
    landed = {r for e in before for c in e["conn"]
              if c[0] == "update_connector_output" and c[2] for r in c[2]}
    assert {"r1", "r2"} <= landed
    last_update = [e for e in before if e["op"] == "update"][-1]
    assert last_update["status"]["r1"] == last_update["status"]["r2"] == \
        "WAITING_FOR_REMOTE_KVS"
    refusals = [c for e in before[-10:] for c in e["kv"] if c[0] == "alloc"]
    assert refusals and all(c[1] == "r0" and c[8] is None for c in refusals)
