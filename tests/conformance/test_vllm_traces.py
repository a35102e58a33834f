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
        "no_caching", "prompt_embeds", "retention", "rswa", "sink", "swa"]
    assert len(TRACES) == 254


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


def _first(trace, predicate):
    return next(i for i, op in enumerate(trace["ops"]) if predicate(op))


def _is_null_in_rswa_table(trace):
    rswa = [g for g, group in enumerate(trace["header"]["groups"]) if group["kind"] == "rswa"]
    return lambda op: op["op"] == "get_block_ids" and any(
        0 in op["expect"]["ret"][g] for g in rswa)


def _stored_with_embeds_key(op):
    return op["op"] == "take_events" and any(
        ev["type"] == "BlockStored" and any(keys and len(keys[-1]) == 64
                                            for keys in ev["extra_keys"] or [])
        for ev in op["expect"]["ret"])


def test_each_new_class_fails_on_a_perturbed_observation_of_its_feature():
    """What each class is about is compared: an R-SWA table's gap (null blocks),
    the sink blocks missing from the free count, the embeddings' hash in an event."""
    rswa = load_trace(TRACE_DIR / "rswa" / "rswa-00001.json.gz")
    i = _first(rswa, _is_null_in_rswa_table(rswa))
    kinds = [group["kind"] for group in rswa["header"]["groups"]]
    table = rswa["ops"][i]["expect"]["ret"][kinds.index("rswa")]
    table[table.index(0)] = 999                       # as if the gap block were kept
    assert replay(rswa).divergence.index == i

    sink = load_trace(TRACE_DIR / "sink" / "sink-00001.json.gz")
    sink_blocks = sink["header"]["groups"][0]["sink_len"] // sink["header"]["groups"][0][
        "block_size"]
    sink["expect_init"]["num_free_blocks"] += sink_blocks  # as if no sink were held
    assert replay(sink).divergence.path == "init.num_free_blocks"

    embeds = load_trace(TRACE_DIR / "prompt_embeds" / "prompt_embeds-00001.json.gz")
    i = _first(embeds, _stored_with_embeds_key)
    event = next(ev for ev in embeds["ops"][i]["expect"]["ret"] if ev["type"] == "BlockStored"
                 and any(keys and len(keys[-1]) == 64 for keys in ev["extra_keys"] or []))
    keys = next(keys for keys in event["extra_keys"] if keys and len(keys[-1]) == 64)
    keys[-1] = "0" * 64                               # another embeddings hash
    result = replay(embeds)
    assert result.divergence.index == i and "extra_keys" in result.divergence.path
