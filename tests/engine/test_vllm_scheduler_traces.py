"""vLLM 0.25.1's own Scheduler and AsyncScheduler, replayed on kvref: 0 divergent steps.

``vllm_scheduler_traces/*.json.gz`` were recorded by
``tools/record_vllm_scheduler.py`` from vLLM's real schedulers (README.md
there). Each profile file is one test; every run in it must replay with
identical decisions, tokens and block tables, and the manager's invariants
hold after every engine iteration. vLLM is not needed here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kvref.verify.scheduler_replay import load_trace, replay_run

TRACE_DIR = Path(__file__).parent / "vllm_scheduler_traces"
TRACES = sorted(TRACE_DIR.glob("*.json.gz"))


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


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_profile_replays_with_zero_divergent_steps(path):
    doc = load_trace(path)
    results = [replay_run(run, f"{doc['profile']}[{i}]") for i, run in enumerate(doc["runs"])]
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
    from kvref.engine.llm import resolve_batch_limits

    doc = load_trace(TRACE_DIR / "llm_defaults.json.gz")
    for L, chunked, tokens, seqs, want_tokens, want_seqs in doc["llm_defaults_grid"]:
        assert resolve_batch_limits("cpu", L, tokens, seqs, chunked) == (want_tokens, want_seqs), \
            (L, chunked, tokens, seqs)
    for run in doc["runs"]:
        config = run["config"]
        assert config["llm_defaults"]
        assert resolve_batch_limits("cpu", config["max_model_len"]) == (
            config["max_num_batched_tokens"], config["max_num_seqs"]) == (4096, 256)
