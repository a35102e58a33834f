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
    connector   a decode engine whose prompts' KV comes from a remote prefill,
                asynchronously: blocks held uncached while a load is in flight
                (``delay_cache_blocks``), ``reserved_blocks`` for the prefills in
                flight, loads landing steps later, one failing and recomputed

The hand-narrated walk-throughs (``kvref.viz.walkthroughs``) are workloads too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvref.core.block_pool import BlockPool
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)
from kvref.engine.core import engine_step
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler, StepRecord
from kvref import RequestStatus
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
    # request id -> RemoteLoad: the prompts a remote prefill engine computed
    # (the workload then runs with a ``RemotePrefillConnector``).
    remote: dict[str, RemoteLoad] = field(default_factory=dict)
    long_prefill_token_threshold: int = 0     # > 0: longer prefills go in chunks of this


@dataclass(frozen=True)
class RemoteLoad:
    """A prompt the remote prefill engine computed: its KV lands ``steps`` steps
    after the load starts; with ``failed_block`` (an index into the request's
    blocks) that block's transfer fails."""

    steps: int
    failed_block: int | None = None


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


class RemotePrefillMetadata(KVConnectorMetadata):
    """The loads the scheduler started this step: request id -> (block ids, plan)."""

    def __init__(self, loads: dict[str, tuple[list[int], RemoteLoad]]) -> None:
        self.loads = loads


class RemotePrefillConnector(KVConnectorBase_V1):
    """A decode engine's connector to a remote prefill engine, moving no tensors.

    No vLLM counterpart (it plays the part of a P/D connector such as NIXL's).
    The scheduler half offers every planned prompt's uncached tokens as an
    asynchronous external hit; the worker half lands each load the planned
    number of steps later, reporting a planned failed block among the
    invalid blocks. Nothing is copied: the workload shows what the scheduler and
    the KV cache manager do while KV is in flight, which needs no KV values
    (kvref's real transfers are the P2P, example and CPU-offload connectors).
    Plan: ``kv_connector_extra_config={"remote": {request id: RemoteLoad}}``.
    """

    def __init__(self, kv_transfer_config, role, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        self._plan: dict[str, RemoteLoad] = kv_transfer_config.get_from_extra_config(
            "remote", {})
        self._local_hit: dict[str, int] = {}          # scheduler: asked, not yet allocated
        self._started: set[str] = set()               # scheduler: loads already planned
        self._pending: dict[str, tuple[list[int], RemoteLoad]] = {}
        self._in_flight: dict[str, list] = {}         # worker: [steps left, blocks, plan]
        self._load_errors: set[int] = set()

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        rid = request.request_id
        if rid not in self._plan or rid in self._started:
            return 0, False                   # computed here (or loaded once already)
        self._local_hit[rid] = num_computed_tokens
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens == 0:
            return
        (block_ids,) = blocks.get_block_ids()
        self._started.add(rid)
        self._pending[rid] = (list(block_ids), self._plan[rid])

    def build_connector_meta(self, scheduler_output) -> RemotePrefillMetadata:
        meta, self._pending = RemotePrefillMetadata(self._pending), {}
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return False, None                    # a consumer sends nothing back

    # -- worker side ---------------------------------------------------------------

    def start_load_kv(self, **kwargs) -> None:
        for rid, (block_ids, load) in self._get_connector_metadata().loads.items():
            self._in_flight[rid] = [load.steps, block_ids, load]

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass                                  # the loads are asynchronous: nothing to wait on

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass                                  # a decode engine saves nothing

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        landed = set()
        for rid, flight in list(self._in_flight.items()):
            flight[0] -= 1
            if flight[0] > 0:
                continue
            del self._in_flight[rid]
            landed.add(rid)
            _, block_ids, load = flight
            if load.failed_block is not None:
                self._load_errors.add(block_ids[load.failed_block])
        return None, landed or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


KVConnectorFactory.register_connector("RemotePrefillConnector", __name__,
                                      "RemotePrefillConnector")


def connector() -> Preset:
    rng = random.Random(7)
    system = _tokens(rng, 16)
    plan = [  # request id, prompt, arrival step, its remote load (None: computed here)
        ("d0", system + _tokens(rng, 9), 0, RemoteLoad(6)),
        ("d1", _tokens(rng, 22), 0, RemoteLoad(2)),
        ("d2", _tokens(rng, 19), 1, RemoteLoad(2, failed_block=2)),
        ("d3", system + _tokens(rng, 6), 1, RemoteLoad(2)),
        ("local", _tokens(rng, 70), 3, None),
        ("d4", _tokens(rng, 14), 4, RemoteLoad(2)),
        ("d5", system + _tokens(rng, 11), 8, RemoteLoad(1)),
    ]
    return Preset("connector", "a decode engine: 6 prompts' KV from a remote prefill "
                  "(asynchronous loads, one failing), 1 long prompt computed here",
                  _full(48), 4, 96, 32,
                  [Arrival(rid, prompt, 4, step=at) for rid, prompt, at, _ in plan],
                  remote={rid: load for rid, _, _, load in plan if load},
                  long_prefill_token_threshold=16,
                  notes=["a load in flight holds its blocks uncached (delay_cache_blocks): "
                         "d3 shares d0's 16-token system prompt but arrives while d0's KV "
                         "is still loading, so it hits nothing; d5 comes after it landed "
                         "and hits it",
                         "d4's load is admitted while the local prompt's prefill is in "
                         "flight: reserved_blocks keeps what that prefill still needs",
                         "d2's block 2 fails to load: kv_load_failure_policy='recompute' "
                         "caches the 2 blocks before it and computes the rest here"])


PRESETS: dict[str, Callable[[], Preset]] = {
    "chat": chat, "multi-turn": multi_turn, "rag": rag, "agent": agent,
    "hybrid": hybrid, "pressure": pressure, "connector": connector,
}


def narrate_step(record: StepRecord, total_blocks: int, pool: BlockPool | None = None,
                 connector_parts: tuple[list[str], set[str]] = ([], set())) -> str:
    """One step of the scheduler in words, from its ``StepRecord``.

    With ``pool`` (the block pool as the step leaves it) the free-block count is
    the one the step's picture shows: after the finished requests gave their
    blocks back, split as the grid splits it (empty, cached and evictable).
    ``connector_parts``: sentences about KV loads, and the admitted requests
    they already tell of (those whose load landed)."""
    extra, told = connector_parts
    parts = []
    for rid in [r for r in record.admitted if r not in told]:
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
    parts.extend(extra)
    if pool is None:
        parts.append(f"{record.num_free_blocks} of {total_blocks} blocks free after scheduling")
    else:
        free = pool.get_num_free_blocks()
        cached = sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                     if b.block_hash is not None)
        parts.append(f"{free} of {total_blocks} blocks free at the end of the step "
                     f"({free - cached} empty, {cached} cached and evictable)")
    return f"Step {record.step}: " + "; ".join(parts) + "."


class NarrationError(AssertionError):
    """A workload's narration said something the manager's state contradicts."""


class _LoadNarrator:
    """The ``connector`` workload's sentences about KV loads, each checked against
    the manager when it is written (``NarrationError`` if one is false)."""

    def __init__(self, scheduler: Scheduler, recorder: RecordingKVCacheManager) -> None:
        self.scheduler = scheduler
        self.manager = recorder.manager
        self.block_size = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups[0] \
            .kv_cache_spec.block_size
        self.loading: set[str] = set()            # WAITING_FOR_REMOTE_KVS after the last step

    def _cached(self, block_ids: list[int]) -> list[bool]:
        blocks = self.manager.block_pool.blocks
        return [blocks[b].block_hash is not None for b in block_ids]

    def _check(self, step: int, claim: str, holds: bool) -> str:
        if not holds:
            raise NarrationError(f"connector step {step}: the narration claims {claim!r}, "
                                 "which the manager state contradicts")
        return claim

    def step(self, step: int, live: dict, ops: list[dict], core_step) -> tuple[list[str],
                                                                                set[str]]:
        parts: list[str] = []
        told: set[str] = set()
        record = self.scheduler.step_records[-1]
        for rid in record.admitted:
            if rid not in self.loading:
                continue
            told.add(rid)
            (ids,) = self.manager.get_block_ids(rid)
            request = live[rid]
            n = record.num_scheduled_tokens[rid]
            done = request.num_computed_tokens - n
            cached = [op["num_computed_tokens"] for op in ops
                      if op["op"] == "cache_blocks" and op["req"] == rid]
            full = cached[0] // self.block_size if cached else 0
            parts.append(self._check(
                step, f"{rid}'s load ended: its first {full} full block{'s' * (full != 1)} "
                f"now cached, {n} token{'s' * (n != 1)} computed here from token {done}",
                len(cached) == 1 and all(self._cached(ids[:full]))))
        now = {rid for rid, r in live.items() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        for rid in sorted(now - self.loading, key=list(live).index):
            request = live[rid]
            (ids,) = self.manager.get_block_ids(rid)
            hit = record.prefix_hit_tokens.get(rid, 0)
            alloc = next(op for op in ops if op["op"] == "allocate_slots"
                         and op["req"] == rid and op.get("delay_cache_blocks"))
            external = alloc["num_external_computed_tokens"]
            reserved = alloc.get("reserved_blocks", 0)
            held = ids[hit // self.block_size:]
            text = (f"{rid} loads {external} prompt tokens from the remote prefill "
                    f"({hit} hit here): its {len(held)} blocks held uncached until they land")
            if reserved:
                text += f" (admitted with reserved_blocks={reserved} for prefills in flight)"
            parts.append(self._check(step, text, request.num_computed_tokens == hit + external
                                     and not any(self._cached(held))))
        output = core_step.model_runner_output.kv_connector_output
        for block_id in sorted(output.invalid_block_ids if output else ()):
            rid = next(r for r in now if block_id in self.manager.get_block_ids(r)[0])
            request = live[rid]
            index = self.manager.get_block_ids(rid)[0].index(block_id)
            parts.append(self._check(
                step, f"block {block_id} of {rid} failed to load: {rid} keeps the "
                f"{index} blocks before it and recomputes from token {index * self.block_size}",
                request.num_computed_tokens == index * self.block_size))
        landed = sorted(output.finished_recving or ()) if output else []
        if landed:
            parts.append(self._check(step, "load landed: " + ", ".join(landed)
                                     + " (cached when next scheduled)",
                                     set(landed) <= now
                                     and set(landed) <= self.scheduler.finished_recving_kv_req_ids))
        arrived = self.scheduler.finished_recving_kv_req_ids
        order = list(live).index
        waits = sorted((now & arrived) - set(landed), key=order)
        if waits:
            parts.append(self._check(step, "landed, waiting for a turn to be scheduled: "
                                     + ", ".join(waits), set(waits) <= now))
        still = sorted((now & self.loading) - arrived, key=order)
        if still:
            parts.append(self._check(step, "still loading: " + ", ".join(still),
                                     all(live[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
                                         for r in still)))
        self.loading = now
        return parts, told


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
    transfer = None
    if preset.remote:
        transfer = KVTransferConfig(kv_connector="RemotePrefillConnector",
                                    kv_role="kv_consumer", kv_load_failure_policy="recompute",
                                    kv_connector_extra_config={"remote": preset.remote})
    # The toy connector takes one KV cache group: say so, as a vLLM user would
    # (left unset, the engine would decide the same and log vLLM's warning).
    scheduler = Scheduler(recorder, max_num_batched_tokens=preset.max_num_batched_tokens,
                          max_num_seqs=preset.max_num_seqs, kv_transfer_config=transfer,
                          long_prefill_token_threshold=preset.long_prefill_token_threshold,
                          disable_hybrid_kv_cache_manager=True if transfer else None)
    runner = ModelFreeRunner(vocab_size=VOCAB, kv_connector=transfer and
                             KVConnectorFactory.create_connector(
                                 transfer, KVConnectorRole.WORKER, preset.config))
    loads = _LoadNarrator(scheduler, recorder) if transfer else None
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
        first_op = len(recorder.ops)
        core_step = engine_step(scheduler, runner)
        for rid in scheduler.step_records[-1].finished:
            done[rid] = list(live[rid].all_token_ids)
        recorder.sync_requests()
        # (The scheduler took the step's KV events in update_from_output.)
        # What vLLM's scheduler does when it makes its stats after a step.
        recorder.make_prefix_cache_stats()
        parts = loads.step(step, live, recorder.ops[first_op:], core_step) if loads \
            else ([], set())
        narration[step] = narrate_step(scheduler.step_records[-1], total,
                                       recorder.manager.block_pool, parts)
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
