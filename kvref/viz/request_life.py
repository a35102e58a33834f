"""One request's whole life, drawn from a real run of the engine's scheduler.

No vLLM counterpart. ``request_life()`` runs a small workload on
``kvref.engine.Scheduler`` (model-free runner, no torch) and follows request
``A`` from the moment it arrives to the moment the last of its cached blocks
is evicted: arrival, prefix hit, chunked prefill, decode, preemption, resume,
finish, its blocks cached in the free queue, evicted by a later request. Each
stage is a claim checked against the scheduler's records and the manager's
pool as it happens (``LifeError`` if one is false), so the picture in the
docs/pictures.md (``render_request_life``, checked by ``tests/viz/test_request_life.py``)
cannot drift from what the code does::

    print(render_request_life(request_life()))

The workload, on a 11-block pool (10 to allocate) of 4-token blocks with a
token budget of 8 per step: ``W`` (a shared 8-token prefix plus one token)
runs first and leaves its 2 full blocks cached; ``L``, a long decode, is
admitted next; ``A`` (the same prefix plus 12 tokens of its own, 6 to
generate) arrives third, so it is the last admitted when the pool runs dry;
``E``, arriving after ``A`` finishes, needs every free block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.engine.core import engine_step
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler
from kvref.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvref.request import RequestStatus
from kvref.viz.tables import compress_ids

BLOCK = 4
NUM_BLOCKS = 11
BUDGET = 8
PREFIX = list(range(100, 108))                    # 2 full blocks, shared by W and A
STAGES = ("arrives", "prefix hit", "prefill chunk", "decode", "preempted", "resumed",
          "finished", "cached", "evicted")


class LifeError(AssertionError):
    """The picture claims something the run contradicts."""


@dataclass
class LifeRow:
    step: int
    stage: str
    computed: str            # "14/20": A's computed tokens / its tokens
    blocks: str              # A's blocks (or the blocks it left cached)
    what: str


@dataclass
class RequestLife:
    rows: list[LifeRow] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)

    def stages(self) -> list[str]:
        seen = []
        for row in self.rows:
            for stage in row.stage.split(" + "):
                if stage not in seen:
                    seen.append(stage)
        return seen


def _check(life: RequestLife, holds: bool, text: str) -> None:
    if not holds:
        raise LifeError(f"request life: {text} does not hold")
    life.claims.append(text)


def request_life() -> RequestLife:
    """Run the workload and record request A's life, checking every stage."""
    manager = KVCacheManager(
        KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["attn"], FullAttentionSpec(BLOCK))]),
        max_model_len=64, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
        max_num_batched_tokens=BUDGET)
    scheduler = Scheduler(manager, max_num_batched_tokens=BUDGET, max_num_seqs=4)
    runner = ModelFreeRunner(vocab_size=1000)
    pool = manager.block_pool
    life = RequestLife()

    def new(rid, prompt, max_tokens):
        return scheduler.new_request(rid, prompt,
                                     SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def blocks_of(rid) -> list[int]:
        return list(manager.get_block_ids(rid)[0]) if rid in manager.coordinator \
            .single_type_managers[0].req_to_blocks else []

    a = e = None
    w_blocks: list[int] = []
    left: dict[int, object] = {}          # block id -> the hash A left it with
    last_ids: list[int] = []
    prefill_chunks = decodes = 0
    running_order: list[str] = []
    for step in range(60):
        if step == 0:
            new("W", PREFIX + [1], 1)
        if step == 2:
            new("L", list(range(300, 310)), 14)
        if step == 3:
            a = new("A", PREFIX + list(range(200, 212)), 6)
            life.rows.append(LifeRow(step, "arrives", f"0/{a.num_tokens}", "-",
                                     f"A: {a.num_prompt_tokens} prompt tokens, the first 8 "
                                     "shared with W"))
            _check(life, a.status == RequestStatus.WAITING and not blocks_of("A"),
                   "A arrives waiting, holding no block")
        if a is not None and a.is_finished() and e is None:
            e = new("E", list(range(400, 400 + BLOCK * (NUM_BLOCKS - 1) - 2)), 1)
        if not scheduler.has_unfinished_requests():
            break
        before = a.num_computed_tokens if a is not None else 0
        engine_step(scheduler, runner)
        record = scheduler.step_records[-1]
        order_before = list(running_order)
        running_order = [r for r in running_order if r not in record.preempted
                         and r not in record.finished]
        running_order += record.admitted + record.resumed
        if step == 1:
            w_blocks = [b.block_id for b in pool.blocks if b.block_hash is not None]
            _check(life, len(w_blocks) == 2, "W finished and left its 2 full blocks cached")
        if a is None:
            continue
        ids = blocks_of("A")
        shown = f"{a.num_computed_tokens}/{a.num_tokens}"
        cached = sum(1 for b in ids if pool.blocks[b].block_hash is not None)
        held = f"{compress_ids(ids)} ({cached} cached)" if ids else "-"
        n = record.num_scheduled_tokens.get("A", 0)
        if "A" in record.admitted:
            hit = record.prefix_hit_tokens["A"]
            _check(life, hit == 8 and ids[:2] == w_blocks,
                   "A's prefix hit is W's 2 cached blocks, 8 tokens")
            _check(life, n < a.num_prompt_tokens - hit,
                   "A's prefill does not fit one step's budget: it is chunked")
            prefill_chunks += 1
            life.rows.append(LifeRow(step, "prefix hit + prefill chunk", shown, held,
                                     f"admitted: {hit} tokens from the cache "
                                     f"(blocks {compress_ids(ids[:2])}), {n} computed"))
        elif "A" in record.resumed:
            hit = record.prefix_hit_tokens["A"]
            own = ids[2:hit // BLOCK]
            _check(life, hit > 8 and own, "on resume A hits more than W's prefix: some of "
                                          "its own blocks were still cached")
            life.rows.append(LifeRow(step, "resumed", shown, held,
                                     f"admitted again: {hit} tokens from the cache (W's "
                                     f"prefix and its own {compress_ids(own)}), {n} "
                                     "recomputed"))
        elif "A" in record.preempted:
            _check(life, a.status == RequestStatus.PREEMPTED and not ids
                   and a.num_computed_tokens == 0,
                   "preempted A holds no block and will recompute from 0")
            _check(life, record.preempted == ["A"] and order_before[-1] == "A"
                   and before > 0 and "L" in record.num_scheduled_tokens,
                   "A, the last-admitted running request, is the victim when L needs a block")
            life.rows.append(LifeRow(step, "preempted", shown, "-",
                                     "L needs a block and none is free: A, admitted last, "
                                     "is preempted; its blocks go back to the pool"))
        elif n and a.num_computed_tokens - n < a.num_prompt_tokens \
                and not a.output_token_ids[1:] and before < a.num_prompt_tokens:
            prefill_chunks += 1
            life.rows.append(LifeRow(step, "prefill chunk", shown, held,
                                     f"{n} more prompt tokens computed"))
        elif n == 1 and not a.is_finished():
            decodes += 1
            if not life.rows or life.rows[-1].stage != "decode":
                life.rows.append(LifeRow(step, "decode", shown, held, "1 token a step"))
            else:
                last = life.rows[-1]
                last.computed, last.blocks = shown, held
                last.what = f"1 token a step (steps {last.step}-{step})"
        if "A" in record.finished:
            left = {b: pool.blocks[b].block_hash for b in last_ids
                    if pool.blocks[b].block_hash is not None}
            _check(life, all(pool.blocks[b].ref_cnt == 0 for b in last_ids),
                   "finished A's blocks are all free")
            _check(life, len(left) == a.num_tokens // BLOCK,
                   "its full blocks stay cached (evictable) in the free queue")
            life.rows.append(LifeRow(step, "finished + cached", "-",
                                     f"{compress_ids(sorted(left))} (free, cached: ○)",
                                     f"{len(a.output_token_ids)} tokens generated; its "
                                     f"{len(left)} full blocks stay hittable until reused"))
        elif ids:
            last_ids = ids
        if left and e is not None and "E" in record.num_scheduled_tokens:
            gone = sorted(b for b, h in left.items() if pool.blocks[b].block_hash != h)
            if gone:
                for b in gone:
                    del left[b]
                life.rows.append(LifeRow(step, "evicted", "-",
                                         compress_ids(sorted(left)) if left else "-",
                                         f"E's new blocks reuse {compress_ids(gone)}: A's "
                                         "hashes are dropped"
                                         + ("" if left else "; nothing of A is cached")))
                if not left:
                    break
    _check(life, prefill_chunks >= 2, "A's prompt took at least two chunks")
    _check(life, decodes >= 2, "A decoded token by token")
    _check(life, not left and any(r.stage == "evicted" for r in life.rows),
           "E's allocation evicted every block A left cached")
    missing = [s for s in STAGES if not any(s in r.stage for r in life.rows)]
    _check(life, not missing, f"every stage was drawn (missing: {missing})")
    return life


def render_request_life(life: RequestLife) -> str:
    """The life as a plain-text table (what docs/pictures.md shows)."""
    head = ("step", "stage", "A computed", "A's blocks", "what happened")
    rows = [head] + [(str(r.step), r.stage, r.computed, r.blocks, r.what) for r in life.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4]))
                     + "  " + row[4])
    return "\n".join(line.rstrip() for line in lines)


if __name__ == "__main__":
    print(render_request_life(request_life()))
