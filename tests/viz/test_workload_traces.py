"""The workload traces verified on a real vLLM 0.25.1 (traces/README.md)."""

from pathlib import Path

import pytest

from kvref.verify.trace_replay import load_trace, replay
from kvref.viz.workloads import record_workload, workload_names

TRACES = Path(__file__).parent / "traces"


def test_every_workload_has_a_vllm_checked_trace():
    assert sorted(p.name for p in TRACES.glob("*.json.gz")) == sorted(
        f"kvref-{name}.json.gz" for name in workload_names())


@pytest.mark.parametrize("name", workload_names())
def test_vllm_checked_trace_replays_on_kvref(name):
    trace = load_trace(TRACES / f"kvref-{name}.json.gz")
    result = replay(trace, check_invariants=True)
    assert result.divergence is None, str(result.divergence)


@pytest.mark.parametrize("name", workload_names())
def test_the_workload_still_records_the_checked_ops(name):
    checked = load_trace(TRACES / f"kvref-{name}.json.gz")
    fresh = record_workload(name)
    assert fresh["header"] == checked["header"]
    diff = next((i for i, (a, b) in enumerate(zip(fresh["ops"], checked["ops"])) if a != b),
                None)
    assert diff is None and len(fresh["ops"]) == len(checked["ops"]), (
        f"{name} changed at op {diff}: re-record it and re-check it on vLLM (traces/README.md)")
