"""``simulate`` with the CPU offload tier behind the device pool (``--kv-offloading-size``).

The tier is kvref's ``SimpleCPUOffloadConnector``: its scheduler half in the
scheduler, its worker half (no tensors, copies found done by a step count) in
the simulation's runner. Hand-made traces where the device pool evicts what a
later request needs: the host serves it, fewer prompt tokens are computed, the
causes still sum to the tokens computed (rules S1 and S5 of
``specs/simulate.md``), and nothing is held when the run ends.
"""

from __future__ import annotations

import json
import math

import pytest

from kvref.cli import main
from kvref.simulate import CAUSES, TraceRequest, pool_from_tokens, simulate
from kvref.simulate.attribution import MissLedger


def revisits(rounds=3, conversations=6):
    """Conversations of a 64-token prefix (4 blocks of 16) each, revisited in rounds;
    a pool of 11 blocks holds about two of them, so a revisit finds its prefix evicted."""
    reqs = []
    for rnd in range(rounds):
        for c in range(conversations):
            prefix = [10000 * (c + 1) + j for j in range(64)]
            tail = [7 + 10 * rnd + 100 * c + j for j in range(6)]
            reqs.append(TraceRequest(f"c{c}r{rnd}", 70, 4, 0.0, tokens=prefix + tail))
    return reqs


def check_sums_and_invariants(result, pool):
    assert set(result.misses_by_cause) == set(CAUSES)
    assert sum(result.misses_by_cause.values()) == result.prompt_tokens_computed
    # Everything finished: every device block is free (only the null block is not
    # counted), the tier holds no device block and no host block is referenced.
    assert result.free_gpu_blocks_at_end == pool.num_blocks - 1
    if result.num_cpu_blocks:
        assert result.tier_holds_at_end == 0
        assert result.free_cpu_blocks_at_end == result.num_cpu_blocks - 1


def test_the_host_serves_what_the_device_evicted():
    pool = pool_from_tokens(12)
    reqs = revisits()
    device = simulate(reqs, pool, arrivals="order")
    tiered = simulate(reqs, pool, arrivals="order", kv_offloading_size=1e-3)
    for r in (device, tiered):
        check_sums_and_invariants(r, pool)
        assert r.prompt_tokens == 18 * 70 and r.num_preemptions == 0
    # Without the tier: 12 revisits x 64 prefix tokens, evicted before reuse.
    assert device.misses_by_cause["evicted_before_reuse"] == 12 * 64
    assert device.prompt_tokens_computed == 18 * 70 and device.prompt_tokens_from_host == 0
    # With it: the 12 revisited prefixes come from the host, and only they.
    assert tiered.prompt_tokens_from_host == tiered.prompt_tokens_from_host_once == 12 * 64
    assert tiered.prompt_tokens_computed == 18 * 70 - 12 * 64
    assert tiered.misses_by_cause["evicted_before_reuse"] == 0
    assert tiered.misses_by_cause["first_occurrence"] == \
        device.misses_by_cause["first_occurrence"]
    # Each request's prompt: served by the device, loaded from the host, or computed.
    assert tiered.prompt_tokens == (tiered.prompt_tokens_cached_once
                                    + tiered.prompt_tokens_from_host_once
                                    + tiered.prompt_tokens_computed)
    # 6 conversations' 4 prefix blocks stored once each; 12 revisits load 4 each.
    assert tiered.host_blocks_stored == 6 * 4 and tiered.host_blocks_loaded == 12 * 4
    assert tiered.num_cpu_blocks > 1000


def test_a_host_of_one_block_runs_and_serves_nothing_here():
    """vLLM sizes the host pool max(1, ...) blocks; a tiny tier still runs. Its one
    block holds the last block stored, never a prefix's first, so no lookup hits."""
    pool = pool_from_tokens(12)
    tiny = simulate(revisits(), pool, arrivals="order", kv_offloading_size=1e-9)
    check_sums_and_invariants(tiny, pool)
    assert tiny.num_cpu_blocks == 1 and tiny.prompt_tokens_from_host == 0


def test_slower_copies_serve_the_same_tokens_after_longer_waits():
    """A load is waited for (WAITING_FOR_REMOTE_KVS): copies found done 5 steps after
    their launch serve the same tokens, and the engine takes more steps."""
    pool = pool_from_tokens(12)
    fast = simulate(revisits(), pool, arrivals="order", kv_offloading_size=1e-3)
    slow = simulate(revisits(), pool, arrivals="order", kv_offloading_size=1e-3,
                    kv_offload_copy_steps=5)
    check_sums_and_invariants(slow, pool)
    assert slow.prompt_tokens_from_host == fast.prompt_tokens_from_host == 12 * 64
    assert slow.num_steps > fast.num_steps


def test_stores_in_flight_at_the_end_land_before_the_run_ends():
    """One request of 40 + 10 tokens; its copies take 20 steps, longer than the
    request: the run steps on until they land, so nothing is held at the end."""
    pool = pool_from_tokens(12)
    r = simulate([TraceRequest("a", 40, 10, 0.0, tokens=list(range(100, 140)))], pool,
                 kv_offloading_size=1e-3, kv_offload_copy_steps=20)
    assert r.host_blocks_stored == 3                 # 40 + 9 confirmed tokens: 3 blocks
    check_sums_and_invariants(r, pool)


def test_preempted_requests_resume_from_the_host_and_the_sums_hold():
    """Twelve requests in a pool of 16 blocks: preemptions. A resumed request's
    own blocks, evicted from the device, come back from the host; tokens loaded
    from it are never attributed, and what is computed again is
    recompute_after_preemption."""
    reqs = [TraceRequest(f"p{i}", 30, 30, 0.5 * (i // 6),
                         tokens=list(range(1000 * (i % 6 + 1), 1000 * (i % 6 + 1) + 30)))
            for i in range(12)]
    pool = pool_from_tokens(17)
    device = simulate(reqs, pool, arrivals="timestamps", max_model_len=64)
    tiered = simulate(reqs, pool, arrivals="timestamps", max_model_len=64,
                      kv_offloading_size=1e-3)
    for r in (device, tiered):
        check_sums_and_invariants(r, pool)
        assert r.num_preemptions > 0
    assert tiered.prompt_tokens_from_host > tiered.prompt_tokens_from_host_once > 0
    assert tiered.prompt_tokens_computed < device.prompt_tokens_computed
    assert tiered.misses_by_cause["recompute_after_preemption"] < \
        device.misses_by_cause["recompute_after_preemption"]


def test_the_ledger_gives_tokens_loaded_from_the_host_no_cause():
    """Rule S5 by hand: a 64-token prompt, 16 hit on the device, 32 loaded from the
    host; the cuts (A, F, S, T) = (16, 16, 48, 60) start after the load."""
    ledger = MissLedger()
    ledger.admit("r", 64, (16, 16, 16, 48, 60), True, from_host=32)
    assert ledger.hit_once["r"] == 16 and ledger.host_once["r"] == 32
    ledger.computed_tokens("r", 48, 64)
    assert dict(ledger.by_cause) == {"shared_prefix_ends_inside_block": 12,
                                     "first_occurrence": 4}
    # Preempted and resumed with nothing cached: the loaded tokens are computed
    # now, and count as recomputation, like the device hit's.
    ledger.computed_tokens("r", 0, 64)
    assert ledger.by_cause["recompute_after_preemption"] == 64
    assert sum(ledger.by_cause.values()) == 16 + 64


@pytest.mark.parametrize("size", [0, -1.0, math.nan, math.inf, "8"])
def test_bad_sizes_are_refused(size):
    with pytest.raises(ValueError, match="kv_offloading_size is the host tier's size in GiB"):
        simulate(revisits(1), pool_from_tokens(12), kv_offloading_size=size)


def test_bad_copy_steps_and_no_prefix_caching_are_refused():
    with pytest.raises(ValueError, match="kv_offload_copy_steps must be an integer >= 1"):
        simulate(revisits(1), pool_from_tokens(12), kv_offloading_size=1, kv_offload_copy_steps=0)
    with pytest.raises(ValueError, match="needs prefix caching"):
        simulate(revisits(1), pool_from_tokens(12), kv_offloading_size=1,
                 enable_prefix_caching=False)


def test_a_mamba_hybrid_with_a_host_tier_is_refused():
    from kvref.simulate import NAMED_SHAPES

    pool = pool_from_tokens(400, shape=NAMED_SHAPES["nemotron-h-8b-like"])
    with pytest.raises(ValueError, match="Mamba hybrid is not simulated yet"):
        simulate(revisits(1), pool, kv_offloading_size=1)


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_reports_the_tier_in_its_json(capsys):
    code, out, err = run(capsys, "simulate", "conversation", "--max-requests", "30",
                         "--arrivals", "order", "--kv-cache-tokens", "20000",
                         "--max-model-len", "20000", "--max-output-tokens", "4",
                         "--model", "llama-3-8b-like", "--kv-offloading-size", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    # 4 GiB of 2 MiB blocks (16 tokens x 128 KiB): 2,048 host blocks.
    assert doc["num_cpu_blocks"] == 2048 and doc["kv_offloading_size"] == 4.0
    assert sum(doc["misses_by_cause"].values()) == doc["prompt_tokens_computed"]
    assert doc["prompt_tokens"] == (doc["prompt_tokens_cached_once"]
                                    + doc["prompt_tokens_from_host_once"]
                                    + doc["prompt_tokens_computed"])
    assert doc["host_blocks_stored"] > 0


@pytest.mark.parametrize("args,message", [
    (["--kv-offloading-size", "0"], "must be a positive number, got 0.0"),
    (["--kv-offloading-size", "-2"], "must be a positive number"),
    (["--kv-offloading-size", "1", "--kv-offload-copy-steps", "0"], "integer >= 1"),
    (["--kv-offload-copy-steps", "3"], "--kv-offload-copy-steps needs --kv-offloading-size"),
    (["--kv-offloading-size", "1", "--no-enable-prefix-caching"], "needs prefix caching"),
    (["--kv-offloading-size", "1", "--sweep", "kv-cache-tokens=1e5,inf"], "runs one trace"),
])
def test_bad_tier_flags_are_one_line(capsys, args, message):
    code, out, err = run(capsys, "simulate", "conversation", "--max-requests", "3",
                         "--kv-cache-tokens", "20000", "--max-model-len", "20000", *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
