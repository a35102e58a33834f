"""Replay every recorded vLLM v0.25.1 trace; kvref must answer exactly as vLLM did.

Each trace (``traces/<config class>/*.json.gz``) is one test: a divergence
fails it with the op, the field and both values. See README.md here.
"""

from pathlib import Path

import pytest

from kvref.verify.trace_replay import find_traces, load_trace, replay

TRACE_DIR = Path(__file__).parent / "traces"
TRACES = list(find_traces([TRACE_DIR]))
CONFIG_CLASSES = sorted(p.name for p in TRACE_DIR.iterdir() if p.is_dir())


def test_every_config_class_has_traces():
    assert CONFIG_CLASSES == [
        "chunked_local", "cross_attention", "eagle", "full", "hybrid_diff_block_sizes",
        "hybrid_full_mamba", "hybrid_full_swa", "mamba_align", "mamba_all",
        "no_caching", "retention", "swa"]
    assert len(TRACES) == 230


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_trace_replays_identically(path):
    """Identical answers, and every snapshot invariant (specs/) holds after each op."""
    trace = load_trace(path)
    result = replay(trace, check_invariants=True)
    assert result.divergence is None, f"{path.name}: {result.divergence}"
    assert result.num_ops == len(trace["ops"])


RETENTION_TRACES = sorted((TRACE_DIR / "retention").glob("*.json.gz"))


@pytest.mark.parametrize("path", RETENTION_TRACES,
                         ids=lambda p: p.name.removesuffix(".json.gz"))
def test_retention_trace_needs_its_interval(path):
    """Recorded with VLLM_PREFIX_CACHE_RETENTION_INTERVAL set: replayed as if
    it were unset, kvref caches more blocks than vLLM did and diverges, so each
    of these traces really exercises the interval."""
    trace = load_trace(path)
    assert isinstance(trace["header"]["prefix_cache_retention_interval"], int)
    del trace["header"]["prefix_cache_retention_interval"]
    assert replay(trace).divergence is not None


def test_replay_ignores_the_shell_variable(monkeypatch):
    """A trace without the header key was recorded with the variable unset;
    the replayer says so explicitly, whatever the variable is here."""
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "0")
    dense = next(p for p in TRACES if "hybrid_full_swa-" in p.name
                 and "retention" not in p.name)
    assert replay(load_trace(dense)).divergence is None
