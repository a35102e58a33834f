"""Record vLLM 0.25.1's own CPU offload tier, step by step, over seeded workloads.

No vLLM counterpart. Runs ``tests/distributed/offload_driver.py`` (a small FCFS
scheduler loop) on vLLM's ``KVCacheManager``, ``SimpleCPUOffloadScheduler``
(``vllm/v1/simple_kv_offload/manager.py``) and ``SimpleCPUOffloadWorker``
(``worker.py``) on CPU. The worker is vLLM's, with its copy backend replaced by
a clock: a copy launched at the worker's n-th ``get_finished`` is found done at
poll ``n + latency`` (the workload draws each event's latency, 0 included:
vLLM's copy thread can finish before the poll). Every step records the hits
the tier offers, its load and store plans (events, device and host block ids),
what the worker reported done, and both pools' free counts.
``tests/distributed/test_offload_vs_vllm.py`` replays the same workloads on
kvref's tier without vLLM and requires the same records.

    /root/.cache/vllm-oracle/bin/python tools/record_vllm_offload.py \\
        tests/distributed/vllm_offload_traces.json.gz --runs 64
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent


def load_driver():
    spec = importlib.util.spec_from_file_location(
        "offload_driver", ROOT / "tests" / "distributed" / "offload_driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Clock:
    """One worker's polls so far."""

    def __init__(self) -> None:
        self.polls = 0


class ClockEvent:
    def __init__(self, clock: Clock, ready: int) -> None:
        self.clock, self.ready = clock, ready

    def query(self) -> bool:
        return self.clock.polls >= self.ready

    def record(self, stream=None) -> None:
        pass


class ClockCopyBackend:
    """vLLM's DmaCopyBackend.launch_copy's contract, copying nothing."""

    def __init__(self, clock: Clock, latency) -> None:
        self.clock, self.latency = clock, latency

    def launch_copy(self, src_blocks, dst_blocks, is_store, event_idx, events_list,
                    wait_event=None) -> None:
        kind = "store" if is_store else "load"
        ready = self.clock.polls + self.latency(kind, event_idx)
        events_list.append((event_idx, ClockEvent(self.clock, ready)))


class CountingWorker:
    """Advances the clock once per get_finished, then asks vLLM's worker."""

    def __init__(self, worker, clock: Clock) -> None:
        self.worker, self.clock = worker, clock

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def get_finished(self, finished_req_ids):
        self.clock.polls += 1
        return self.worker.get_finished(finished_req_ids)


def vllm_backend(workload: dict, driver) -> SimpleNamespace:
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVCacheTensor,
                                            SlidingWindowSpec)
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm.sampling_params import SamplingParams
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    torch.cuda.current_stream = lambda *args, **kwargs: None    # the stores' wait, on CPU
    bs = workload["block_size"]
    attn = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = [FullAttentionSpec(**attn) if kind == "full" else
             SlidingWindowSpec(**attn, sliding_window=workload["sliding_window"])
             for kind in workload["groups"]]
    names = [f"layer.{i}" for i in range(len(specs))]
    page = specs[0].page_size_bytes
    # One tensor shared by one layer of each group, as vLLM lays a hybrid model out.
    config = KVCacheConfig(
        num_blocks=workload["num_gpu_blocks"],
        kv_cache_tensors=[KVCacheTensor(size=workload["num_gpu_blocks"] * page,
                                        shared_by=names)],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in zip(names, specs)])
    vllm_config = SimpleNamespace(
        kv_events_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1,
                                        world_size=workload["world_size"]),
        model_config=SimpleNamespace(max_model_len=512),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=workload["token_budget"]))
    cpu_bytes = workload["num_cpu_blocks"] * page
    manager = KVCacheManager(config, max_model_len=512, scheduler_block_size=bs,
                             hash_block_size=bs, enable_caching=True)
    tier = SimpleCPUOffloadScheduler(vllm_config, config, cpu_bytes, scheduler_block_size=bs,
                                     hash_block_size=bs, lazy_offload=workload["lazy"])
    tier.bind_gpu_block_pool(manager.block_pool)
    workers = []
    for rank in range(workload["world_size"]):
        worker = SimpleCPUOffloadWorker(vllm_config, config, cpu_bytes)
        clock = Clock()
        worker._backend = ClockCopyBackend(
            clock, lambda kind, event, rank=rank: driver.latency(workload, rank, kind, event))
        worker._store_compute_done = ClockEvent(clock, 0)
        workers.append(CountingWorker(worker, clock))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256)

    def request(req_id, tokens):
        return Request(req_id, tokens, SamplingParams(max_tokens=64), None,
                       arrival_time=0.0, block_hasher=hasher)

    def output(recving, worker_meta):
        return KVConnectorOutput(finished_recving=recving,
                                 kv_connector_worker_meta=worker_meta)

    return SimpleNamespace(manager=manager, scheduler_half=tier, workers=workers,
                           request=request, output=output)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", type=int, default=64, help="workloads: eager/lazy, sync/async, one group/hybrid")
    args = parser.parse_args(argv)
    driver = load_driver()
    runs = []
    for seed in range(args.runs):
        workload = driver.draw_workload(seed, lazy=seed % 2 == 1,
                                        async_scheduling=seed % 4 >= 2,
                                        hybrid=seed % 8 >= 4,
                                        world_size=2 if seed % 16 >= 8 else 1)
        try:
            records = driver.Driver(vllm_backend(workload, driver), workload).run()
        except RuntimeError as e:        # the loop's own stall (no reserved blocks): dropped
            print(f"run {seed + 1}/{args.runs}: dropped ({e})", file=sys.stderr)
            continue
        runs.append(dict(workload=workload, records=records))
        print(f"run {seed + 1}/{args.runs}: {len(records)} steps", file=sys.stderr)
    import vllm
    data = dict(vllm_version=vllm.__version__, source="tools/record_vllm_offload.py",
                runs=runs)
    with gzip.open(args.out, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    print(f"{args.out}: {len(runs)} runs, {sum(len(r['records']) for r in runs)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
