#!/usr/bin/env python3
"""Publish, or record, vLLM 0.25.1's own KV events over ZMQ, for ``kvref watch``'s tests.

Runs in the vLLM oracle environment (``tools/setup_vllm_venv.py``); imports
nothing of kvref, so no kvref change can alter what vLLM sends. A small
scheduler loop drives vLLM's real ``KVCacheManager`` (events enabled) and,
after every step, publishes what ``take_events()`` returned as vLLM's
scheduler does (``vllm/v1/core/sched/scheduler.py:1802-1816``: one
``KVEventBatch(ts=time.time(), events=...)`` per step with events) through
vLLM's own ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py:278``).

    # live: publish to a watcher bound at ENDPOINT, keep the replay socket
    # open until a line (or EOF) arrives on stdin; the truth goes to stdout
    /root/.cache/vllm-oracle/bin/python tools/record_vllm_kv_events.py \\
        --publish tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558
    # record the publisher's frames, byte for byte, with the truth beside them
    /root/.cache/vllm-oracle/bin/python tools/record_vllm_kv_events.py \\
        --record tests/watch/recorded/vllm_kv_events.json.gz

Recording subscribes to the publisher over a loopback socket and fetches every
batch through vLLM's replay socket (``kv_events.py:448``), so no batch is lost
to ZMQ's slow-joiner window. The file (``kvevents/1``):

- ``workloads``: one entry per model (``full``: one full-attention group;
  ``hybrid``: full attention plus a Mamba group in ``align`` mode, whose stores
  are sparse, ``tutorials/11_kv_events.py``; ``swa``: full attention plus a
  sliding window of 8 tokens; ``bytes-hashes``: one full-attention group, events
  with 32-byte hashes), each with
- ``frames``: the publisher's multipart messages ``[topic, seq, payload]``,
  hex, in sequence order;
- ``checkpoints``: after batch ``after_seq``, the pool's prefix-cache index as
  events name it (``[group, hash, copies]``, from vLLM's
  ``cached_block_hash_to_block``; a bytes hash as hex) and ``probes``:
  ``[prompt, hit tokens]`` as vLLM's ``get_computed_blocks`` answers for a new
  request with that prompt.

Runs with ``PYTHONHASHSEED=0`` when recording (it re-executes itself so) so
that a re-recording gives the same hashes; the watcher does not need the seed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from collections import Counter, deque
from pathlib import Path

BLOCK_SIZE = 4
SLIDING_WINDOW = 8
WORKLOADS = {
    "full": {"groups": ["full"], "num_blocks": 40, "seed": 11, "num_requests": 40},
    "hybrid": {"groups": ["full", "mamba"], "num_blocks": 80, "seed": 12, "num_requests": 30},
    "swa": {"groups": ["full", "sliding_window"], "num_blocks": 60, "seed": 14,
            "num_requests": 30},
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: events carry the whole 32-byte hashes
    # (vllm/v1/core/kv_cache_utils.py:79-82); the file writes them as hex.
    "bytes-hashes": {"groups": ["full"], "num_blocks": 24, "seed": 13, "num_requests": 20,
                     "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}},
}


def vllm_modules() -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (get_block_hash, get_group_id,
                                             get_request_block_hasher, init_none_hash,
                                             maybe_convert_block_hash)
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec, SlidingWindowSpec)
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    return dict(locals())


class Driver:
    """A few requests through vLLM's KVCacheManager, a step at a time (lesson 11's loop)."""

    def __init__(self, v: dict, workload: dict) -> None:
        self.v = v
        specs = []
        for kind in workload["groups"]:
            if kind == "full":
                specs.append(v["FullAttentionSpec"](block_size=BLOCK_SIZE, num_kv_heads=1,
                                                    head_size=1, dtype=v["torch"].float16))
            elif kind == "sliding_window":
                specs.append(v["SlidingWindowSpec"](block_size=BLOCK_SIZE, num_kv_heads=1,
                                                    head_size=1, dtype=v["torch"].float16,
                                                    sliding_window=SLIDING_WINDOW))
            else:
                specs.append(v["MambaSpec"](block_size=BLOCK_SIZE, shapes=((1,),),
                                            dtypes=(v["torch"].float16,),
                                            mamba_cache_mode="align"))
        self.align = "mamba" in workload["groups"]
        config = v["KVCacheConfig"](
            num_blocks=workload["num_blocks"], kv_cache_tensors=[],
            kv_cache_groups=[v["KVCacheGroupSpec"]([f"layer.{i}"], s)
                             for i, s in enumerate(specs)])
        self.manager = v["KVCacheManager"](config, max_model_len=1024,
                                           scheduler_block_size=BLOCK_SIZE,
                                           hash_block_size=BLOCK_SIZE, enable_caching=True,
                                           enable_kv_cache_events=True)
        self.hasher = v["get_request_block_hasher"](BLOCK_SIZE, v["sha256"])
        self.rng = random.Random(workload["seed"])
        self.num_requests = workload["num_requests"]

    def request(self, rid: str, tokens: list[int]):
        return self.v["Request"](rid, list(tokens), self.v["SamplingParams"](max_tokens=64),
                                 None, block_hasher=self.hasher)

    def pool_index(self) -> list[list]:
        v, counts = self.v, Counter()
        for key, value in self.manager.block_pool.cached_block_hash_to_block._cache.items():
            copies = len(value) if isinstance(value, dict) else 1
            h = v["maybe_convert_block_hash"](v["get_block_hash"](key))
            counts[(v["get_group_id"](key), h.hex() if isinstance(h, bytes) else h)] += copies
        return sorted([g, h, n] for (g, h), n in counts.items())

    def aligned_chunk(self, req, computed: int, n: int) -> int:
        """vLLM's scheduler cuts Mamba-align prefill chunks on block boundaries."""
        if computed >= max(req.num_prompt_tokens, req.num_tokens - 1):
            return n
        last_cache = req.num_tokens - req.num_tokens % BLOCK_SIZE
        if computed + n < last_cache:
            return n // BLOCK_SIZE * BLOCK_SIZE
        if computed < last_cache < computed + n:
            return last_cache - computed
        return n

    def checkpoint(self, checkpoint, seq: int, systems: list, finished: list) -> None:
        """The pool's index, and vLLM's hit for each probe prompt, after batch ``seq``."""
        probes = [s + [7, 7, 7, 7, 7] for s in systems] + \
                 [list(r.all_token_ids) + [5] for r in finished[-3:]]
        if finished:
            tokens = list(finished[-1].all_token_ids)
            probes += [tokens[:k] + [5] for k in range(BLOCK_SIZE, len(tokens), BLOCK_SIZE)]
            # whole blocks: the num_tokens - 1 cap costs the last one (lesson 02)
            probes += [tokens[:k] for k in range(BLOCK_SIZE, len(tokens), 2 * BLOCK_SIZE)]
        answers = [[p, self.manager.get_computed_blocks(self.request("probe", p))[1]]
                   for p in probes]
        checkpoint(seq, self.pool_index(), answers)

    def run(self, publish, checkpoint) -> int:
        """Serve the workload; ``publish(events)`` per step with events,
        ``checkpoint(seq, index, probes)`` every few batches. Returns the batch count."""
        rng, manager = self.rng, self.manager
        systems = [[1000 * s + t for t in range(rng.randrange(8, 25))] for s in range(4)]
        waiting = deque()
        for i in range(self.num_requests):
            prompt = rng.choice(systems) + [rng.randrange(1, 999)
                                            for _ in range(rng.randrange(1, 13))]
            if i % 5 == 3:      # a bare system prompt, whole blocks: its last block is
                bare = rng.choice(systems)                 # recomputed, a second copy
                prompt = bare[:len(bare) // BLOCK_SIZE * BLOCK_SIZE]
            waiting.append((self.request(f"req-{i}", prompt), rng.randrange(1, 9)))
        running, finished, seq = [], [], -1
        reset_after = self.num_requests // 2     # then an idle pool: reset_prefix_cache
        while waiting or running:
            if len(finished) >= reset_after and not running:
                reset_after = self.num_requests + 1
                if not manager.reset_prefix_cache():         # emits AllBlocksCleared
                    raise SystemExit("reset_prefix_cache refused on an idle pool")
            manager.new_step_starts()
            left = 12
            # Half way, admit nothing until the running requests are done.
            admit = 0 if len(finished) >= reset_after else 3 - len(running)
            for item in list(running) + list(waiting)[:admit]:
                req, max_out = item
                new = item not in running
                hit, num_hit = manager.get_computed_blocks(req) if new else (None, 0)
                computed = req.num_computed_tokens + num_hit
                n = min(req.num_tokens - computed, left)
                if self.align and n > 0:
                    n = self.aligned_chunk(req, computed, n)
                if n <= 0:
                    continue
                if manager.allocate_slots(req, n, num_hit, hit) is None:
                    continue
                if new:
                    waiting.remove(item)
                    running.append(item)
                    req.status = self.v["RequestStatus"].RUNNING
                req.num_computed_tokens = computed + n
                left -= n
                if req.num_computed_tokens == req.num_tokens:
                    req.append_output_token_ids(rng.randrange(1, 999))
                    if req.num_tokens - req.num_prompt_tokens == max_out:
                        manager.free(req)
                        running.remove(item)
                        finished.append(req)
            events = manager.take_events()
            if not events:
                continue
            publish(events)
            seq += 1
            if seq % 5 == 0:
                self.checkpoint(checkpoint, seq, systems, finished)
        self.checkpoint(checkpoint, seq, systems, finished)        # after the last batch
        return seq + 1


def serve(v: dict, workload: dict, endpoint: str, replay_endpoint: str | None):
    """Publish one workload through vLLM's ZmqEventPublisher; return (publisher,
    batch count, checkpoints)."""
    publisher = v["ZmqEventPublisher"](0, endpoint=endpoint, replay_endpoint=replay_endpoint)
    checkpoints = []
    driver = Driver(v, workload)
    saved = {name: os.environ.get(name) for name in workload.get("env", {})}
    os.environ.update(workload.get("env", {}))
    try:
        count = driver.run(
            lambda events: publisher.publish(v["KVEventBatch"](ts=time.time(), events=events)),
            lambda seq, index, probes: checkpoints.append(
                {"after_seq": seq, "index": index, "probes": probes}))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    return publisher, count, checkpoints


def record(v: dict, name: str, workload: dict) -> dict:
    import zmq
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = port + 1
    publisher, count, checkpoints = serve(v, workload, f"tcp://127.0.0.1:{port}",
                                          f"tcp://127.0.0.1:{replay_port}")
    deadline = time.time() + 30
    while publisher._event_queue.qsize() and time.time() < deadline:
        time.sleep(0.05)
    # Every batch, from the publisher's replay buffer (the live socket may have
    # missed the first ones while connecting).
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = []
    while True:
        if not dealer.poll(10_000):
            raise SystemExit(f"{name}: the replay socket stopped answering")
        _, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        frames.append([publisher._topic_bytes.hex(), seq.hex(), payload.hex()])
    publisher.shutdown()
    dealer.close(0)
    sub.close(0)
    if len(frames) != count:
        raise SystemExit(f"{name}: published {count} batches, replay gave {len(frames)}")
    print(f"{name}: {count} batches, {len(checkpoints)} checkpoints", file=sys.stderr)
    return {"groups": workload["groups"], "block_size": BLOCK_SIZE, "frames": frames,
            "checkpoints": checkpoints}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--publish", metavar="ENDPOINT")
    mode.add_argument("--record", metavar="PATH", type=Path)
    parser.add_argument("--replay-endpoint")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="full")
    args = parser.parse_args()
    if args.record and os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    v = vllm_modules()
    if args.record:
        data = {"format": "kvevents/1", "vllm": "0.25.1",
                "tool": "tools/record_vllm_kv_events.py",
                "workloads": {name: record(v, name, w) for name, w in WORKLOADS.items()}}
        args.record.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, separators=(",", ":")) + "\n"
        if args.record.suffix == ".gz":
            args.record.write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            args.record.write_text(text)
        return 0
    publisher, count, checkpoints = serve(v, WORKLOADS[args.workload], args.publish,
                                          args.replay_endpoint)
    print(json.dumps({"batches": count, "checkpoints": checkpoints}), flush=True)
    sys.stdin.readline()            # keep the replay socket up until the watcher is done
    publisher.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
