"""Workloads with no model: the engine's scheduler on a recording manager.

No vLLM counterpart. Each preset is a pool configuration and a stream of
requests; ``record_workload`` runs it on ``kvref.engine.Scheduler`` with the
``ModelFreeRunner`` (deterministic tokens, no torch) through a
``RecordingKVCacheManager``, so the result is a ``kvtrace/1`` trace: what
``kvref demo``, ``kvref viz`` and ``kvref record`` show, and a conformance test
that can be replayed on a real vLLM::

    trace = record_workload("chat", max_steps=20)
    print(trace["narration"]["3"])      # what the scheduler did in step 3

Presets (``WORKLOADS``), each answering a question people ask:

    chat        a shared system prompt: ref counts rise, most prompt tokens hit
    multi-turn  conversations that resend their history; one client puts a
                timestamp in its system prompt and never hits ("why does my
                multi-turn chat not hit?")
    rag         shared documents in different orders: only a shared *prefix* hits
    agent       agent loops whose context grows by tool results each call
    hybrid      full attention + sliding window: null blocks, hybrid hits
    pressure    a pool too small for the load: evictions and preemptions
                ("why was this block evicted first?")

The hand-narrated walk-throughs (``kvref.viz.walkthroughs``) are workloads too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvref.core.block_pool import BlockPool
from kvref.engine.core import engine_step
from kvref.engine.model_free_runner import ModelFreeRunner
from kvref.engine.sampling_params import SamplingParams
from kvref.engine.scheduler import Scheduler, StepRecord
from kvref.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvref.verify.trace_record import RecordingKVCacheManager, make_header

VOCAB = 1000


@dataclass
class Arrival:
    """A request that arrives at ``step``, or when request ``after`` finishes
    (then ``prompt`` is called with that request's full token list)."""

    request_id: str
    prompt: list[int] | Callable[[list[int]], list[int]]
    max_tokens: int
    step: int = 0
    after: str | None = None


@dataclass
class Preset:
    name: str
    description: str
    config: KVCacheConfig
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    arrivals: list[Arrival]
    max_num_seqs: int = 8
    watermark: float = 0.0
    notes: list[str] = field(default_factory=list)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def _full(num_blocks: int, block_size: int = 4) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size))])


def chat() -> Preset:
    rng = random.Random(1)
    system = _tokens(rng, 24)
    arrivals = [Arrival(f"user{i}", system + _tokens(rng, rng.randrange(5, 12)), 6, step=i)
                for i in range(8)]
    return Preset("chat", "8 users, one 24-token system prompt (6 blocks of 4)",
                  _full(64), 4, 128, 48, arrivals)


def multi_turn() -> Preset:
    rng = random.Random(2)
    system = _tokens(rng, 12)
    arrivals: list[Arrival] = []
    for c in range(3):
        stamp = c == 2                      # this client writes the time into its system prompt
        for turn in range(3):
            rid, prev = f"c{c}.t{turn}", f"c{c}.t{turn - 1}"
            message = _tokens(rng, 6)
            if turn == 0:
                head = system[:2] + [900 + turn] + system[3:] if stamp else system
                # c2 comes after the others are done: the pool is idle (usage 0%),
                # full of cached blocks, and still nothing hits.
                arrivals.append(Arrival(rid, head + message, 5, step=20 if stamp else c))
            elif stamp:
                # The client re-renders the history with a new time stamp at token 2.
                arrivals.append(Arrival(rid, lambda hist, m=message, t=turn:
                                        hist[:2] + [900 + t] + hist[3:] + m, 5, after=prev))
            else:
                arrivals.append(Arrival(rid, lambda hist, m=message: hist + m, 5, after=prev))
    return Preset("multi-turn", "3 chats x 3 turns; chat c2 (alone, later) stamps the time "
                  "into token 2",
                  _full(64), 4, 128, 48, arrivals,
                  notes=["c0 and c1 resend their history: each turn hits the last one's "
                         "full blocks; c2 changes token 2 every turn, so block 0's hash "
                         "differs and nothing after it can hit, although usage is 0% "
                         "and the pool is full of cached blocks"])


def rag() -> Preset:
    rng = random.Random(3)
    system = _tokens(rng, 8)
    docs = {name: _tokens(rng, 16) for name in "ABCD"}
    orders = ["AB", "AB", "BA", "AC", "AB", "CD", "DC", "AC"]
    arrivals = [Arrival(f"q{i}:{o}", system + docs[o[0]] + docs[o[1]] + _tokens(rng, 5), 4,
                        step=i) for i, o in enumerate(orders)]
    return Preset("rag", "8 queries over 2 of 4 shared 16-token documents, in varying order",
                  _full(64), 4, 128, 48, arrivals,
                  notes=["q2 has the same documents as q0 but in the order B, A: only the "
                         "8-token system prompt is a shared prefix"])


def agent() -> Preset:
    rng = random.Random(4)
    tools = _tokens(rng, 32)
    arrivals: list[Arrival] = []
    for a in range(2):
        task = _tokens(rng, 4)
        for it in range(4):
            rid, prev = f"agent{a}.{it}", f"agent{a}.{it - 1}"
            if it == 0:
                arrivals.append(Arrival(rid, tools + task, 3, step=a))
            else:
                observation = _tokens(rng, 5)
                arrivals.append(Arrival(rid, lambda hist, o=observation: hist + o, 3,
                                        after=prev))
    return Preset("agent", "2 agents sharing 32 tokens of tool descriptions, 4 calls each",
                  _full(64), 4, 160, 64, arrivals)


def hybrid() -> Preset:
    rng = random.Random(5)
    system = _tokens(rng, 16)
    config = KVCacheConfig(64, [KVCacheGroupSpec(["full"], FullAttentionSpec(4)),
                                KVCacheGroupSpec(["swa"], SlidingWindowSpec(4, 8))])
    arrivals = [Arrival(f"r{i}", system + _tokens(rng, rng.randrange(4, 10)), 8, step=2 * i)
                for i in range(5)]
    return Preset("hybrid", "full attention + sliding window 8 sharing one pool",
                  config, 4, 96, 32, arrivals,
                  notes=["the window group keeps only the blocks its window reads: older "
                         "ones become the null block and go back to the pool"])


def pressure() -> Preset:
    rng = random.Random(6)
    arrivals = [Arrival(f"r{i}", _tokens(rng, rng.randrange(18, 30)), 14, step=i // 2)
                for i in range(8)]
    return Preset("pressure", "8 long requests on a 24-block pool", _full(25), 4, 64, 32,
                  arrivals, max_num_seqs=6, watermark=0.04)


PRESETS: dict[str, Callable[[], Preset]] = {
    "chat": chat, "multi-turn": multi_turn, "rag": rag, "agent": agent,
    "hybrid": hybrid, "pressure": pressure,
}


def narrate_step(record: StepRecord, total_blocks: int, pool: BlockPool | None = None) -> str:
    """One step of the scheduler in words, from its ``StepRecord``.

    With ``pool`` (the block pool as the step leaves it) the free-block count is
    the one the step's picture shows: after the finished requests gave their
    blocks back, split as the grid splits it (empty, cached and evictable)."""
    parts = []
    for rid in record.admitted:
        hit = record.prefix_hit_tokens.get(rid, 0)
        parts.append(f"{rid} admitted, {hit} prompt tokens from the cache" if hit
                     else f"{rid} admitted, no prefix hit")
    for rid in record.resumed:
        parts.append(f"{rid} resumed ({record.prefix_hit_tokens.get(rid, 0)} tokens hit)")
    if record.preempted:
        parts.append("preempted (pool full): " + ", ".join(record.preempted))
    decoding = [r for r, n in record.num_scheduled_tokens.items()
                if r not in record.admitted and r not in record.resumed]
    if decoding:
        parts.append(f"{len(decoding)} running")
    if record.finished:
        parts.append("finished: " + ", ".join(record.finished))
    if pool is None:
        parts.append(f"{record.num_free_blocks} of {total_blocks} blocks free after scheduling")
    else:
        free = pool.get_num_free_blocks()
        cached = sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                     if b.block_hash is not None)
        parts.append(f"{free} of {total_blocks} blocks free at the end of the step "
                     f"({free - cached} empty, {cached} cached and evictable)")
    return f"Step {record.step}: " + "; ".join(parts) + "."


def record_workload(name: str, max_steps: int | None = None, seed: str = "0",
                    on_step: Callable[[int], None] | None = None) -> dict:
    """Run a preset (or a walk-through) and return its ``kvtrace/1`` trace.

    ``max_steps`` stops early (requests still running are left as they are);
    ``on_step(k)`` is called after each step (for progress bars).
    """
    from kvref.viz.walkthroughs import WALKTHROUGHS

    if name in WALKTHROUGHS:
        return WALKTHROUGHS[name]().record(max_steps, seed, on_step)
    if name not in PRESETS:
        raise KeyError(name)
    preset = PRESETS[name]()
    header = make_header(preset.config, max_model_len=preset.max_model_len,
                         scheduler_block_size=preset.block_size,
                         hash_block_size=preset.block_size,
                         max_num_batched_tokens=preset.max_num_batched_tokens,
                         watermark=preset.watermark, none_hash_seed=seed)
    recorder = RecordingKVCacheManager(header)
    scheduler = Scheduler(recorder, max_num_batched_tokens=preset.max_num_batched_tokens,
                          max_num_seqs=preset.max_num_seqs)
    runner = ModelFreeRunner(vocab_size=VOCAB)
    waiting = list(preset.arrivals)
    live: dict = {}                         # request id -> EngineRequest
    done: dict[str, list[int]] = {}         # finished request id -> all its tokens
    narration: dict[int, str] = {}
    total = preset.config.num_blocks - 1
    step = clock = 0
    while waiting or scheduler.has_unfinished_requests():
        if max_steps is not None and step >= max_steps:
            break
        for arrival in [a for a in waiting if (a.after is None and a.step <= clock)
                        or (a.after is not None and a.after in done)]:
            waiting.remove(arrival)
            prompt = arrival.prompt(done[arrival.after]) if callable(arrival.prompt) \
                else arrival.prompt
            live[arrival.request_id] = scheduler.new_request(
                arrival.request_id, prompt,
                SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True))
        clock += 1
        if not scheduler.has_unfinished_requests():
            continue                    # idle until the next arrival: no step
        engine_step(scheduler, runner)
        for rid in scheduler.step_records[-1].finished:
            done[rid] = list(live[rid].all_token_ids)
        recorder.sync_requests()
        # What vLLM's scheduler does when it makes its stats after a step.
        recorder.take_events()
        recorder.make_prefix_cache_stats()
        narration[step] = narrate_step(scheduler.step_records[-1], total,
                                       recorder.manager.block_pool)
        if on_step:
            on_step(step)
        step += 1
    return recorder.finish_trace(
        name=f"kvref-{name}", config_class=f"kvref-workload-{name}",
        generator={"workload": name, "description": preset.description,
                   "max_steps": max_steps, "notes": preset.notes},
        narration=narration)


def workload_names() -> list[str]:
    from kvref.viz.walkthroughs import WALKTHROUGHS

    return list(WALKTHROUGHS) + list(PRESETS)
