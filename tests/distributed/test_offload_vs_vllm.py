"""kvref's CPU offload tier plans what vLLM 0.25.1's plans, step by step.

``vllm_offload_traces.json.gz`` was recorded by ``tools/record_vllm_offload.py``
from vLLM's own ``SimpleCPUOffloadScheduler`` and ``SimpleCPUOffloadWorker``
(CPU, copies replaced by a clock) driven by ``offload_driver.py``; here the
same driver runs kvref's ``KVCacheManager`` and ``SimpleCPUOffloadConnector``
with the same copy latencies, and every step must match: the hits offered,
the load and store plans (events, device and host block ids), what the worker
found done, and both pools' free blocks. vLLM is not needed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, SlidingWindowSpec, get_request_block_hasher, init_none_hash,
                   sha256)
from kvref.kv_cache_interface import KVCacheTensor
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.distributed.kv_transfer.kv_connector.v1 import KVConnectorOutput, KVConnectorRole
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector)

from .offload_driver import Driver, latency

TRACES = Path(__file__).with_name("vllm_offload_traces.json.gz")


def load_runs() -> list[dict]:
    with gzip.open(TRACES, "rt") as f:
        data = json.load(f)
    assert data["vllm_version"] == "0.25.1"
    return data["runs"]


RUNS = load_runs()


class ClockedTier(SimpleCPUOffloadConnector):
    """kvref's tier whose copies (worker ``rank``'s) are found done after the
    workload's latencies."""

    workload: dict = {}
    rank = 0

    def _copy_latency(self, kind: str, event: int) -> int:
        return latency(self.workload, self.rank, kind, event)


def kvref_backend(workload: dict) -> SimpleNamespace:
    init_none_hash(sha256)
    bs = workload["block_size"]
    specs = [FullAttentionSpec(bs, num_kv_heads=1, head_size=8, dtype="float32")
             if kind == "full" else
             SlidingWindowSpec(bs, num_kv_heads=1, head_size=8, dtype="float32",
                               sliding_window=workload["sliding_window"])
             for kind in workload["groups"]]
    names = [f"layer.{i}" for i in range(len(specs))]
    spec = specs[0]
    config = KVCacheConfig(
        workload["num_gpu_blocks"],
        [KVCacheGroupSpec([name], s) for name, s in zip(names, specs)],
        [KVCacheTensor(workload["num_gpu_blocks"] * spec.page_size_bytes, names)])
    manager = KVCacheManager(config, max_model_len=512, scheduler_block_size=bs,
                             hash_block_size=bs)
    transfer = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "cpu_bytes_to_use": workload["num_cpu_blocks"] * spec.page_size_bytes
            * workload["world_size"],
            "world_size": workload["world_size"],
            "lazy_offload": workload["lazy"],
            "max_num_batched_tokens": workload["token_budget"]})
    tier = ClockedTier(transfer, KVConnectorRole.SCHEDULER, config)
    tier.bind_gpu_block_pool(manager.block_pool)
    workers = []
    for rank in range(workload["world_size"]):
        worker = ClockedTier(transfer, KVConnectorRole.WORKER, config)
        worker.workload, worker.rank = workload, rank
        worker.register_kv_caches({})         # the plans are compared, not the bytes
        workers.append(worker)
    hasher = get_request_block_hasher(bs, sha256)

    def request(req_id, tokens):
        req = Request(req_id, tokens, block_hasher=hasher)
        req.num_output_placeholders = 0
        return req

    def output(recving, worker_meta):
        return KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta)

    return SimpleNamespace(manager=manager, scheduler_half=tier, workers=workers,
                           request=request, output=output)


def normalise(records: list[dict]) -> list[dict]:
    """JSON's view (tuples as lists, keys as strings), as the recording holds it."""
    return json.loads(json.dumps(records))


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "seed{seed}-{mode}{sched}".format(
    seed=r["workload"]["seed"], mode="lazy" if r["workload"]["lazy"] else "eager",
    sched="-async" if r["workload"]["async_scheduling"] else "")
    + ("-hybrid" if len(r["workload"]["groups"]) > 1 else "")
    + ("-2workers" if r["workload"]["world_size"] > 1 else ""))
def test_kvref_tier_plans_what_vllm_planned(run):
    workload = run["workload"]
    got = normalise(Driver(kvref_backend(workload), workload).run())
    want = run["records"]
    for mine, theirs in zip(got, want):
        assert mine == theirs, f"step {theirs['step']} differs from vLLM's"
    assert len(got) == len(want)


def test_the_recordings_cover_what_the_timing_is_about():
    """Stores, loads, late completions and preemptions occur, in every mode."""
    steps = [s for r in RUNS for s in r["records"]]
    assert sum(bool(s["store"][1]) for s in steps) > 100
    assert sum(bool(s["load"][1]) for s in steps) > 10
    assert any(s["finished_recving"] for s in steps)
    assert any(s["preempted"] for s in steps)
    for lazy in (False, True):
        for groups in (["full"], ["full", "sliding"]):
            runs = [r for r in RUNS if r["workload"]["lazy"] == lazy
                    and r["workload"]["groups"] == groups]
            assert any(s["load"][1] for r in runs for s in r["records"]), (lazy, groups)
            assert {r["workload"]["async_scheduling"] for r in runs} == {False, True}
    # Stores reported done later than planned, and some in the step that launched them.
    gaps = set()
    for run in RUNS:
        planned = {s["store"][0]: s["step"] for s in run["records"] if s["store"][0] >= 0}
        gaps |= {s["step"] - planned[e] for s in run["records"] for e, _ in s["stores_done"]}
    assert 0 in gaps and max(gaps) >= 2
    # With two workers, a store reported by one worker in one step and by the
    # other in a later one (hittable only then).
    split = [e for run in RUNS if run["workload"]["world_size"] == 2
             for e in {e for s in run["records"] for e, n in s["stores_done"] if n == 1}
             if sum(n for s in run["records"] for e2, n in s["stores_done"] if e2 == e) == 2]
    assert split
