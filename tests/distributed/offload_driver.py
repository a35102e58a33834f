"""One small scheduler loop around a CPU offload tier, for kvref's and vLLM's alike.

No vLLM counterpart. ``tools/record_vllm_offload.py`` runs it on vLLM 0.25.1's
own ``KVCacheManager``, ``SimpleCPUOffloadScheduler`` and
``SimpleCPUOffloadWorker`` (its copy backend replaced by a clock); the replay
test runs it on kvref's ``KVCacheManager`` and ``SimpleCPUOffloadConnector``.
This file imports neither: the caller passes a ``backend`` with

* ``manager``: a ``KVCacheManager`` (one group, prefix caching on);
* ``request(req_id, tokens)``: a request hashing its blocks;
* ``scheduler_half`` / ``workers``: the tier's scheduler half and one worker
  half per rank, worker ``w``'s copies found done ``latency(w, kind, event)``
  polls after their launch (its own polls);
* ``output(finished_recving, worker_meta)``: a ``KVConnectorOutput``.

The workers' reports are merged as vLLM's ``KVOutputAggregator`` merges them
(``vllm/distributed/kv_transfer/kv_connector/utils.py:65-170``): a request is
in ``finished_recving`` once every worker has reported it, and the store
reports are summed with ``aggregate``, the first worker's as the accumulator.
The loop is a plain FCFS scheduler in vLLM's order (running first, then
waiting; chunked prefill under a token budget; the newest running request
preempted when blocks run out; an asynchronous load waits, then its blocks
are cached), with optional asynchronous scheduling (a step's sampled token is
processed after the next step is scheduled, as a placeholder meanwhile). Each
step records the tier's answers and plans; both sides must record the same.
"""

from __future__ import annotations

import random
from types import SimpleNamespace


def latency(workload: dict, worker: int, kind: str, event: int) -> int:
    """Polls after its launch at which worker ``worker`` finds a copy done."""
    table = workload["latencies"]
    return table[(2 * event + (kind == "store") + 7 * worker) % len(table)]


def draw_workload(seed: int, lazy: bool, async_scheduling: bool, hybrid: bool = False,
                  world_size: int = 1) -> dict:
    """A seeded workload: prompts that share prefixes, arrivals, lengths, latencies.
    ``hybrid``: a full-attention group and a sliding-window one (window 8)."""
    rng = random.Random(seed)
    block_size = 4
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(6, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(50)
                                         for _ in range(rng.choice([0, 1, 3, 4, 6]))]
        if rng.random() < 0.5 and requests:        # a later turn repeats an earlier prompt
            prompt = list(rng.choice(requests)["prompt"])
        requests.append(dict(req_id=f"r{i}", prompt=prompt or [1, 2],
                             arrival=rng.randint(0, 30), max_tokens=rng.randint(1, 6)))
    return dict(seed=seed, lazy=lazy, async_scheduling=async_scheduling, world_size=world_size,
                groups=["full", "sliding"] if hybrid else ["full"], sliding_window=8,
                block_size=block_size, num_gpu_blocks=rng.randint(8, 14) * (2 if hybrid else 1),
                num_cpu_blocks=rng.randint(4, 30), token_budget=rng.choice([8, 12, 16]),
                latencies=[rng.choice([0, 1, 1, 1, 2, 3]) for _ in range(400)],
                requests=requests)


class SortedSet(set):
    """A set that iterates in sorted order. Both tiers free a finished load's blocks
    in the order they iterate ``finished_recving``, which for a plain set of strings
    changes with the interpreter's hash seed."""

    def __iter__(self):
        return iter(sorted(set.__iter__(self)))


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 50


class Driver:
    def __init__(self, backend, workload: dict) -> None:
        self.b, self.w = backend, workload
        self.waiting: list = []
        self.skipped: list = []              # loading (vLLM's skipped_waiting): looked at first
        self.running: list = []
        self.state: dict[str, dict] = {}     # req_id -> {req, loading, outputs, max}
        self.finished_ids: set[str] = set()
        self.landed: set[str] = set()
        self.in_flight = None                # async scheduling: the step not processed yet
        self.recv_left: dict[str, int] = {}  # workers yet to report a request's load
        self.records: list[dict] = []

    # -- scheduling --------------------------------------------------------------

    def _alloc(self, req, n, **kw):
        return self.b.manager.allocate_slots(req, n, **kw)

    def schedule(self, step: int) -> tuple:
        m, tier = self.b.manager, self.b.scheduler_half
        budget = self.w["token_budget"]
        scheduled: dict[str, int] = {}
        new_reqs, cached, hits, preempted = [], [], {}, []
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue
            before = [len(ids) for ids in m.get_block_ids(req.request_id)]
            n = min(budget, req.num_tokens + req.num_output_placeholders
                    - req.num_computed_tokens)
            if n <= 0:
                continue
            while self._alloc(req, n) is None:
                victim = self.running.pop()
                m.free(victim)
                victim.num_computed_tokens = 0
                victim.num_output_placeholders = 0     # its sampled tokens are dropped
                self.state[victim.request_id]["preempted"] = True
                self.waiting.insert(0, victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                continue
            new_ids = tuple(list(ids[n:]) for ids, n in zip(m.get_block_ids(req.request_id),
                                                             before))
            cached.append((req.request_id, new_ids, False, req.num_computed_tokens))
            scheduled[req.request_id] = n
            budget -= n
        for req in self.skipped + self.waiting:
            st = self.state[req.request_id]
            if budget <= 0:
                break
            if st.get("loading"):
                if req.request_id not in self.landed:
                    continue
                self.landed.discard(req.request_id)
                st["loading"] = False
                m.cache_blocks(req, req.num_computed_tokens)
                if req.num_computed_tokens == req.num_tokens:
                    req.num_computed_tokens -= 1
            if req.num_computed_tokens == 0:
                blocks, n_local = m.get_computed_blocks(req)
                n_ext, load_async = tier.get_num_new_matched_tokens(req, n_local)
                hits[req.request_id] = [n_local, n_ext, load_async]
                if load_async and n_ext:
                    if self._alloc(req, 0, num_new_computed_tokens=n_local,
                                   new_computed_blocks=blocks,
                                   num_external_computed_tokens=n_ext,
                                   delay_cache_blocks=True) is None:
                        break
                    tier.update_state_after_alloc(req, m.get_blocks(req.request_id), n_ext)
                    req.num_computed_tokens = n_local + n_ext
                    st["loading"] = True
                    self.waiting.remove(req)
                    self.skipped.append(req)
                    continue
                n = min(budget, req.num_tokens - n_local)
                if self._alloc(req, n, num_new_computed_tokens=n_local,
                               new_computed_blocks=blocks) is None:
                    break
                tier.update_state_after_alloc(req, m.get_blocks(req.request_id), 0)
                req.num_computed_tokens = n_local
            else:                                  # its load landed
                n = min(budget, req.num_tokens - req.num_computed_tokens)
                if self._alloc(req, n) is None:
                    break
                tier.update_state_after_alloc(req, m.get_blocks(req.request_id), 0)
            (self.skipped if req in self.skipped else self.waiting).remove(req)
            self.running.append(req)
            ids = tuple(list(g) for g in m.get_block_ids(req.request_id))
            if st.pop("preempted", False):
                cached.append((req.request_id, ids, True, req.num_computed_tokens))
            else:
                new_reqs.append(SimpleNamespace(req_id=req.request_id, block_ids=ids,
                                                num_computed_tokens=req.num_computed_tokens))
            scheduled[req.request_id] = n
            budget -= n
        out = SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
                resumed_req_ids={c[0] for c in cached if c[2]},
                num_computed_tokens=[c[3] for c in cached]),
            num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
            preempted_req_ids=set(preempted), finished_req_ids=self.finished_ids)
        self.finished_ids = set()
        meta = tier.build_connector_meta(out)
        out.samples = set()
        for req_id, n in scheduled.items():
            req = self.state[req_id]["req"]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                out.samples.add(req_id)
                if self.w["async_scheduling"]:
                    req.num_output_placeholders += 1
        return out, meta, hits, preempted

    # -- one step ----------------------------------------------------------------

    def step(self, step: int) -> None:
        for spec in self.w["requests"]:
            if spec["arrival"] == step:
                req = self.b.request(spec["req_id"], list(spec["prompt"]))
                self.state[spec["req_id"]] = dict(req=req, max=spec["max_tokens"], outputs=0)
                self.waiting.append(req)
        out, meta, hits, preempted = self.schedule(step)
        recving, worker_meta = set(), None
        for i, worker in enumerate(self.b.workers):
            worker.bind_connector_metadata(meta)
            _, done = worker.get_finished(out.finished_req_ids)
            report = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            for req_id in sorted(done or ()):
                left = self.recv_left.pop(req_id, len(self.b.workers)) - 1
                if left:
                    self.recv_left[req_id] = left
                else:
                    recving.add(req_id)
            if i == 0 or worker_meta is None:
                worker_meta = report
            elif report:
                worker_meta = worker_meta.aggregate(report)
        record = dict(step=step, hits=hits, preempted=sorted(preempted),
                      scheduled=dict(out.num_scheduled_tokens),
                      load=[meta.load_event, list(meta.load_gpu_blocks),
                            list(meta.load_cpu_blocks)],
                      store=[meta.store_event, list(meta.store_gpu_blocks),
                             list(meta.store_cpu_blocks)],
                      finished_recving=sorted(recving or ()),
                      stores_done=sorted(worker_meta.completed_store_events.items())
                      if worker_meta else [])
        output = self.b.output(SortedSet(recving) if recving else None, worker_meta)
        if self.w["async_scheduling"]:
            previous, self.in_flight = self.in_flight, (out, output)
            if previous is not None:
                self.update(*previous)
        else:
            self.update(out, output)
        record["cpu_free"] = self.b.scheduler_half.cpu_block_pool.get_num_free_blocks()
        record["gpu_free"] = self.b.manager.block_pool.get_num_free_blocks()
        self.records.append(record)

    def update(self, out, output) -> None:
        for req_id in out.num_scheduled_tokens:
            st = self.state[req_id]
            req = st["req"]
            if req not in self.running or req_id not in out.samples:
                continue                           # preempted since, or still prefilling
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            req.append_output_token_ids(next_token(list(req.all_token_ids)))
            st["outputs"] += 1
            if st["outputs"] >= st["max"]:
                self.running.remove(req)
                ids = self.b.manager.get_block_ids(req_id)
                if len(ids) > 1:
                    self.b.scheduler_half.request_finished_all_groups(req, ids)
                else:
                    self.b.scheduler_half.request_finished(req, ids[0])
                self.b.manager.free(req)
                self.finished_ids.add(req_id)
        self.landed |= set(output.finished_recving or ())
        self.b.scheduler_half.update_connector_output(output)

    def run(self, max_steps: int = 200) -> list[dict]:
        last_arrival = max(r["arrival"] for r in self.w["requests"])
        idle = 0
        for step in range(max_steps):
            self.step(step)
            # (A lazy tier stores on every step, so in-flight stores do not count;
            # three idle steps let the last ones land.)
            busy = self.running or self.waiting or self.skipped or self.finished_ids
            idle = 0 if busy or step <= last_arrival else idle + 1
            if idle == 3:
                return self.records
        raise RuntimeError(f"workload {self.w['seed']} did not finish in {max_steps} steps")
