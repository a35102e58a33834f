"""Play a ``kvtrace/1`` trace forwards and backwards, op by op or step by step.

No vLLM counterpart. The visualizer, ``kvref explain`` and ``kvref demo`` all
look at a trace through a ``TracePlayer``: it replays the ops on a kvref
manager (``kvref.verify.trace_replay.TraceReplayer``) up to any position and
remembers, for each op it ran, what it did (``OpFacts``: the blocks it evicted,
whether a ``free`` was a preemption, the prefix hit it found, its events)::

    player = TracePlayer(read_trace("chat.json"))
    player.seek_step(3)                 # the state at the end of step 3
    player.manager.usage, player.facts[-1].evicted

A step is what one ``new_step_starts`` op opens (vLLM's scheduler calls it at
the start of every ``schedule()``); a trace without it has one step per op.
Position ``p`` means ops ``0 .. p-1`` have run; going back replays from the start.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, field

from kvref.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
from kvref.request import Request
from kvref.verify.trace_replay import TRACE_FORMAT, MalformedTrace, TraceReplayer
from kvref.viz.gates import GateRecordingKVCacheManager


class _GateRecordingReplayer(TraceReplayer):
    """The pictures tell allocate_slots' gates as the manager weighed them."""

    manager_class = GateRecordingKVCacheManager


class TraceError(ValueError):
    """The trace file cannot be used: missing, unreadable, not kvtrace/1, malformed."""


# The project's other trace formats, and what replays each: ``kvref replay`` meets
# them beside kvtrace/1 files (tests/conformance holds both) and skips them with a note.
# Any other format is bad input.
OTHER_FORMATS = {
    "blockpooltrace/1": "tests/conformance/test_block_pool_traces.py replays them",
    "kvref-vllm-scheduler-trace/1": "python3 -m kvref.verify.scheduler_replay replays them",
}


class OtherFormatError(TraceError):
    """The file is one of the project's other trace formats (``OTHER_FORMATS``)."""

    def __init__(self, message: str, trace_format: str) -> None:
        super().__init__(message)
        self.trace_format = trace_format


def read_trace(path: str) -> dict:
    """Load and sanity-check a trace file; ``TraceError`` with a one-line reason."""
    try:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except json.JSONDecodeError as exc:
        # str(exc) reads "Unterminated string starting at: line 9 column 5 (char 2993)".
        raise TraceError(f"{path}: not valid JSON ({exc}); truncated or not a trace?") from None
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from None
    check_trace_shape(trace, str(path))
    return trace


def check_trace_shape(trace: dict, where: str = 'trace') -> None:
    """The parts every reader relies on: format, header, a list of ops with names."""
    if not isinstance(trace, dict):
        raise TraceError(f"{where}: a kvtrace/1 trace is a JSON object, "
                         f"found a {type(trace).__name__}")
    if trace.get("format") in OTHER_FORMATS:
        raise OtherFormatError(f"{where}: not a {TRACE_FORMAT} trace "
                               f"(format={trace['format']!r})", trace["format"])
    if trace.get("format") != TRACE_FORMAT:
        raise TraceError(f"{where}: not a {TRACE_FORMAT} trace "
                         f"(format={trace.get('format')!r})")
    header, ops = trace.get("header"), trace.get("ops")
    if not isinstance(header, dict) or not all(k in header for k in ("num_blocks", "groups",
                                                                     "manager", "hash")):
        raise TraceError(f"{where}: header must be an object with num_blocks, groups, "
                         "manager and hash")
    if not isinstance(ops, list) or not all(isinstance(op, dict) and isinstance(op.get("op"), str)
                                            for op in ops):
        raise TraceError(f"{where}: ops must be a list of objects, each with an \"op\" name")


@dataclass
class OpFacts:
    """What one op did, read off the states before and after it."""

    index: int
    op: dict
    observed: dict                     # {"ret"?, "raises"?, "state"}
    freed_status: str | None = None    # free: the request's status when freed
    evicted: list[int] = field(default_factory=list)    # cached blocks reused by an allocation
    uncached: list[int] = field(default_factory=list)   # hashes dropped by reset/evict_blocks
    newly_cached: list[int] = field(default_factory=list)
    hit_tokens: int | None = None      # get_computed_blocks: tokens hit
    query_tokens: int | None = None    # get_computed_blocks: the request's tokens
    touched: list[int] = field(default_factory=list)    # blocks whose ref count, hash or
                                                        # free-queue membership changed

    @property
    def is_preemption(self) -> bool:
        # vLLM's scheduler frees a preempted request while it is still RUNNING;
        # a finished one has its finished status first.
        return self.op["op"] == "free" and self.freed_status == "RUNNING"


@dataclass
class StepStats:
    """The pool at the end of one step, and the prefix-cache totals so far."""

    step: int
    usage: float
    evictable_cached: int
    free: int
    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class TracePlayer:
    """A trace, replayed up to ``position`` on a kvref manager."""

    def __init__(self, trace: dict) -> None:
        check_trace_shape(trace)
        self.trace = trace
        self.ops: list[dict] = trace["ops"]
        starts = [i for i, op in enumerate(self.ops) if op["op"] == "new_step_starts"]
        if not starts:
            self.steps = [(i, i + 1) for i in range(len(self.ops))]
        else:
            bounds = ([0] if starts[0] > 0 else []) + starts + [len(self.ops)]
            self.steps = list(zip(bounds[:-1], bounds[1:]))
        self.narration: dict[int, str] = {int(k): v for k, v in
                                          (trace.get("narration") or {}).items()}
        self._restart()

    def _restart(self) -> None:
        try:
            self.replayer = _GateRecordingReplayer(self.trace["header"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"cannot build a manager from the trace header: "
                             f"{type(exc).__name__}: {exc}") from None
        self.position = 0
        self.facts: list[OpFacts] = []
        self.history: list[StepStats] = []
        self._queries = self._hits = 0                      # vLLM's counters
        self._preempted_queries = self._preempted_hits = 0  # counted apart, as vLLM's
        self._state = self.replayer.initial_observation()["state"]
        # block id -> the ops that touched it; cached block id -> its parent in the
        # hash chain (hex hash, or None for a request's first block); request -> its ops.
        self.touches: dict[int, list[int]] = {}
        self.parents: dict[int, str | None] = {}
        # block id -> (op, event type) of the KV cache events about it, attributed to
        # the op that queued them; (event hash, group) -> the block that holds it.
        self.kv_events: dict[int, list[tuple[int, str]]] = {}
        self._event_owner: dict[tuple, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.request_ops: dict[str, list[int]] = {}

    @property
    def manager(self):
        return self.replayer.manager

    @property
    def requests(self):
        return self.replayer.requests

    def step_of(self, op_index: int) -> int:
        """The step an op belongs to."""
        for k, (start, end) in enumerate(self.steps):
            if start <= op_index < end:
                return k
        raise IndexError(f"op {op_index} out of range 0..{len(self.ops) - 1}")

    @property
    def current_step(self) -> int:
        """The step whose last op ran most recently (-1 before any op)."""
        return -1 if self.position == 0 else self.step_of(self.position - 1)

    def seek(self, position: int) -> None:
        """Run or rewind so exactly the first ``position`` ops have run."""
        if not 0 <= position <= len(self.ops):
            raise IndexError(f"position {position} out of range 0..{len(self.ops)}")
        if position < self.position:
            self._restart()
        while self.position < position:
            self._apply()

    def seek_op(self, op_index: int) -> None:
        """The state right after op ``op_index``."""
        if not 0 <= op_index < len(self.ops):
            raise IndexError(f"op {op_index} out of range 0..{len(self.ops) - 1}")
        self.seek(op_index + 1)

    def seek_step(self, step: int) -> None:
        """The state at the end of step ``step``."""
        if not 0 <= step < len(self.steps):
            raise IndexError(f"step {step} out of range 0..{len(self.steps) - 1}")
        self.seek(self.steps[step][1])

    def step_facts(self, step: int | None = None) -> list[OpFacts]:
        """The facts of the ops of a step that have run (default: the current step)."""
        step = self.current_step if step is None else step
        if step < 0:
            return []
        start, end = self.steps[step]
        return self.facts[start:min(end, self.position)]

    def _apply(self) -> None:
        index = self.position
        op = self.ops[index]
        before = self._state
        req = self.replayer.requests.get(op.get("req")) if "req" in op else None
        status = req.status.name if req is not None else None
        num_tokens = req.num_tokens if req is not None else None
        # vLLM counts a preempted request's lookups apart (kvref.stats.PrefixCacheStats).
        preempted = req is not None and getattr(req, "num_preemptions", 0) > 0
        queued = len(self.manager.block_pool.kv_event_queue)
        try:
            observed = self.replayer.run(op)
        except MalformedTrace as exc:
            raise TraceError(f"op #{index} {op['op']}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TraceError(f"op #{index} {op['op']}: malformed op "
                             f"({type(exc).__name__}: {exc})") from None
        after = observed["state"]
        facts = OpFacts(index, op, observed)
        hashed_before, hashed_after = set(before["hashed"]), set(after["hashed"])
        facts.newly_cached = sorted(hashed_after - hashed_before)
        facts.touched = _touched(before, after)
        for block_id in facts.touched:
            self.touches.setdefault(block_id, []).append(index)
        for block_id in hashed_before - hashed_after:
            self.parents.pop(block_id, None)
        events = [] if op["op"] == "take_events" else \
            self.manager.block_pool.kv_event_queue[queued:]
        hashed_now = self._follow_hashes(index, facts.touched, events, hashed_before)
        if req is not None:
            self.request_ops.setdefault(req.request_id, []).append(index)
            self._remember_parents(req, hashed_now)
        elif op["op"] == "add_request":
            self.request_ops.setdefault(op["req"], []).append(index)
        ret = observed.get("ret")
        if op["op"] == "allocate_slots" and ret:
            facts.evicted = [b for group in ret for b in group if b in hashed_before]
        elif op["op"] in ("reset_prefix_cache", "evict_blocks"):
            facts.uncached = sorted(hashed_before - hashed_after)
        elif op["op"] == "free":
            facts.freed_status = status
        elif op["op"] == "get_computed_blocks" and ret is not None:
            facts.hit_tokens = ret["num_computed_tokens"]
            facts.query_tokens = num_tokens
            if preempted:
                self._preempted_queries += num_tokens
                self._preempted_hits += facts.hit_tokens
            else:
                self._queries += num_tokens
                self._hits += facts.hit_tokens
        self.facts.append(facts)
        self._state = after
        self.position += 1
        step = self.step_of(index)
        if self.position == self.steps[step][1]:
            self.history.append(self._step_stats(step))

    def _follow_hashes(self, index: int, touched: list[int], events: list,
                       hashed_before: set[int]) -> list[int]:
        """Keep each block's hash, and say which KV events of op ``index`` are about
        which block (events carry hashes in vLLM's form: by default the low 64 bits
        as an int). Returns the blocks that got a (new) hash in this op: also one
        evicted and cached again within the op, which the digests cannot tell."""
        pool = self.manager.block_pool

        def event_key(key):
            return (maybe_convert_block_hash(get_block_hash(key), pool._int_event_hashes),
                    get_group_id(key))

        changes = [(b, self._hash_of.get(b), pool.blocks[b].block_hash) for b in touched
                   if pool.blocks[b].block_hash != self._hash_of.get(b)]
        stored_now = {event_key(new): b for b, _, new in changes if new is not None}
        for ev in events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                blocks = sorted(hashed_before)
            else:
                owners = stored_now if kind == "BlockStored" else self._event_owner
                blocks = [owners[(h, ev.group_idx)] for h in ev.block_hashes
                          if (h, ev.group_idx) in owners]
            for block_id in blocks:
                self.kv_events.setdefault(block_id, []).append((index, kind))
        for b, old, new in changes:
            if old is not None and self._event_owner.get(event_key(old)) == b:
                del self._event_owner[event_key(old)]
            if new is None:
                self._hash_of.pop(b, None)
            else:
                self._hash_of[b] = new
        self._event_owner.update(stored_now)
        return [b for b, _, new in changes if new is not None]

    def _remember_parents(self, req: Request, newly_cached: list[int]) -> None:
        """A block's parent is the hash before its own in the request that cached it."""
        if not newly_cached:
            return
        pool = self.manager.block_pool
        new = set(newly_cached)
        for stm in self.manager.coordinator.single_type_managers:
            blocks = stm.req_to_blocks.get(req.request_id, [])
            hashes = pool._hashes_at_block_size(req, stm.block_size)
            for i, block in enumerate(blocks):
                if block.block_id in new:
                    self.parents[block.block_id] = hashes[i - 1].hex() if i else None

    def _step_stats(self, step: int) -> StepStats:
        pool = self.manager.block_pool
        evictable = sum(1 for b in pool.free_block_queue.get_all_free_blocks()
                        if b.block_hash is not None)
        return StepStats(step, pool.get_usage(), evictable, pool.get_num_free_blocks(),
                         self._queries, self._hits)


def _touched(before: dict, after: dict) -> list[int]:
    """Blocks whose ref count, hash or free-queue membership differ between two digests."""
    ref_before, ref_after = dict(map(tuple, before["ref"])), dict(map(tuple, after["ref"]))
    changed = {b for b in ref_before.keys() | ref_after.keys()
               if ref_before.get(b) != ref_after.get(b)}
    changed |= set(before["hashed"]) ^ set(after["hashed"])
    changed |= set(before["free"]) ^ set(after["free"])
    return sorted(changed)


@dataclass
class TraceSummary:
    """Totals over a whole trace (what ``kvref demo`` ends with), named as
    ``kvref.stats`` names them: ``queries`` and ``hits`` are vLLM's counters
    (requests never preempted), the preempted requests' apart;
    ``served_once`` is each request's hit at its first admission."""

    num_ops: int
    num_steps: int
    num_requests: int
    queries: int
    hits: int
    prompt_tokens_saved: int           # hits of every admission that got its blocks
    evictions: int
    preemptions: int
    preempted_queries: int = 0
    preempted_hits: int = 0
    prompt_tokens: int = 0
    served_once: int = 0

    @property
    def served_once_ratio(self) -> float:
        return self.served_once / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def summarize(trace: dict) -> TraceSummary:
    """Replay the whole trace and add up hits, evictions and preemptions.

    ``prompt_tokens_saved`` counts hit tokens of lookups the following
    ``allocate_slots`` accepted (a refused admission saves nothing)."""
    player = TracePlayer(trace)
    player.seek(len(player.ops))
    pending: dict[str, int] = {}
    first_admission: dict[str, int] = {}
    saved = 0
    for facts in player.facts:
        op = facts.op
        if facts.hit_tokens is not None:
            pending[op["req"]] = facts.hit_tokens
        elif op["op"] == "allocate_slots" and op["req"] in pending:
            hit = pending.pop(op["req"])
            if facts.observed.get("ret") is None:
                continue                            # refused: no room, tried again later
            # Admitted: the lookup's hit counts only if its blocks were passed in.
            used = hit if op.get("new_computed_blocks") == "last" else 0
            saved += used
            first_admission.setdefault(op["req"], used)
    added = [op for op in player.ops if op["op"] == "add_request"]
    return TraceSummary(
        num_ops=len(player.ops), num_steps=len(player.steps), num_requests=len(added),
        queries=player._queries, hits=player._hits, prompt_tokens_saved=saved,
        evictions=sum(len(f.evicted) for f in player.facts),
        preemptions=sum(1 for f in player.facts if f.is_preemption),
        preempted_queries=player._preempted_queries, preempted_hits=player._preempted_hits,
        prompt_tokens=sum(len(op.get("prompt", ())) for op in added),
        served_once=sum(first_admission.values()))

