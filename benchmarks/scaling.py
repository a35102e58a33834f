"""Per-call cost of the three hot calls as the pool grows, pool build time, bytes per block.

No vLLM counterpart (benchmark harness). A readable KV layer must still cost
the same per call whether the pool holds a thousand blocks or a million: a
scheduler calls ``get_computed_blocks``, ``allocate_slots`` and ``free`` for
every request, and a real GPU pool has 1e5-1e6 blocks. Any work proportional
to the pool (scanning blocks, copying lists) shows up here as growth.

The workload, on one full-attention group (block size 16, caching on):
requests of 65 tokens (one of 8 shared 48-token system prompts, 16 own
tokens, 1 more) arrive in batches of 32. Per batch: ``get_computed_blocks``
for each (timed together), ``allocate_slots`` for each with its hit (timed
together), then ``free`` of the previous batch (timed together); timing a
batch, not a call, keeps the clock's own cost out of the figure. Requests
are built before the clock starts.

    side = sides.get_side("kvref")
    per_call_cost(side, 100_000, 2000)["per_call"]["free"]   # [wall ns, cpu ns]
"""

from __future__ import annotations

import gc
import time
import tracemalloc

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
BATCH = 32
NUM_SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_TOKENS = 3 * BLOCK_SIZE
OWN_TOKENS = BLOCK_SIZE + 1
CALLS = ("get_computed_blocks", "allocate_slots", "free")


def _prompt(i: int) -> list[int]:
    system = i % NUM_SYSTEM_PROMPTS
    shared = [system * 1000 + t for t in range(SYSTEM_PROMPT_TOKENS)]
    own = [100_000 + i * OWN_TOKENS + t for t in range(OWN_TOKENS)]
    return shared + own


def _clock() -> tuple[int, int]:
    return time.perf_counter_ns(), time.process_time_ns()


def per_call_cost(side, num_blocks: int, num_requests: int) -> dict:
    """Mean ``[wall ns, cpu ns]`` per call of each of ``CALLS``, the pool build
    time, and the free blocks left at the end (a check that the workload ran)."""
    gc.collect()
    t0 = _clock()
    built = side.full_attention(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN)
    t1 = _clock()
    m = built.manager
    requests = [built.request_factory({"req": f"r{i}", "prompt": _prompt(i)})()
                for i in range(num_requests)]
    totals = {name: [0, 0, 0] for name in CALLS}   # wall ns, cpu ns, calls

    def timed(name, fn, batch):
        start = _clock()
        for item in batch:
            fn(*item)
        end = _clock()
        entry = totals[name]
        entry[0] += end[0] - start[0]
        entry[1] += end[1] - start[1]
        entry[2] += len(batch)

    previous: list = []
    hits: list = []

    def lookup(req):
        hits.append(m.get_computed_blocks(req))

    def allocate(req, hit):
        blocks, num_hit = hit
        if m.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks) is None:
            raise RuntimeError(f"pool of {num_blocks} blocks is too small for the workload")

    gc.collect()
    for first in range(0, num_requests, BATCH):
        batch = requests[first:first + BATCH]
        hits.clear()
        timed("get_computed_blocks", lookup, [(r,) for r in batch])
        timed("allocate_slots", allocate, list(zip(batch, hits)))
        timed("free", m.free, [(r,) for r in previous])
        previous = batch
    timed("free", m.free, [(r,) for r in previous])
    return {"build_wall": (t1[0] - t0[0]) / 1e9, "build_cpu": (t1[1] - t0[1]) / 1e9,
            "per_call": {name: [w / n, c / n] for name, (w, c, n) in totals.items()},
            # every request was freed: all but the null block must be free again
            "num_free_after": m.block_pool.get_num_free_blocks()}


def bytes_per_block(side, num_blocks: int) -> float:
    """Python heap bytes the manager holds per pool block (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = side.full_attention(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del built
    return (after - before) / num_blocks
