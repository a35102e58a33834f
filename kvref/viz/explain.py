"""Why an op of a trace did what it did, in words (``kvref explain TRACE --op N``).

No vLLM counterpart. The trace is replayed up to op N; the state just before
the op is read to tell the decision the manager is about to make, then the op
runs and what changed is told::

    for line in explain(read_trace("chat.json"), 57):
        print(line)

* ``allocate_slots``: the gates in ``KVCacheManager.allocate_slots``' order
  (full-sequence gate, window freeing, capacity + watermark gate), with the
  blocks needed, free and short, as the manager itself weighed them
  (``kvref.viz.gates``: ``GateRecordingKVCacheManager.last_allocate_slots``);
  the blocks taken from the free queue and which cached ones that evicted.
* ``get_computed_blocks``: why the hit stopped where it did: the first block
  whose hash missed, the ``num_tokens - 1`` cap, a hybrid model's fixed point
  (each group's own hit vs the agreed one), EAGLE, alignment.
* ``free``: where each freed block went in the free queue, and why.
* ``reset_prefix_cache`` / ``evict_blocks``: what was forgotten or why not.
"""

from __future__ import annotations

from kvref.core.block_pool import BlockPool
from kvref.core.kv_cache_coordinator import HybridKVCacheCoordinator
from kvref.core.kv_cache_utils import BlockHashListWithBlockSize
from kvref.core.single_type_kv_cache_manager import SlidingWindowManager
from kvref.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvref.request import Request, RequestStatus
from kvref.verify.trace_replay import ALLOCATE_DEFAULTS
from kvref.viz.panels import describe_op
from kvref.viz.gates import AllocateSlotsGates
from kvref.viz.player import OpFacts, TracePlayer
from kvref.viz.tables import compress_ids, spec_label


def explain(trace: dict, op_index: int) -> list[str]:
    """Lines explaining op ``op_index`` of ``trace`` (``IndexError`` if out of range)."""
    player = TracePlayer(trace)
    if not 0 <= op_index < len(player.ops):
        raise IndexError(f"op {op_index} is out of range: the trace has ops 0.."
                         f"{len(player.ops) - 1}")
    player.seek(op_index)
    op = player.ops[op_index]
    lines = [f"op #{op_index} (step {player.step_of(op_index)}): {op['op']} "
             + " ".join(f"{k}={v}" for k, v in op.items()
                        if k not in ("op", "expect", "tag", "prompt", "tokens"))]
    before = _explain_before(player, op)
    queue_before = _queue(player)
    held_before = (player.manager.get_block_ids(op["req"])
                   if op["op"] == "free" and op.get("req") in player.requests else ())
    req = player.requests.get(op.get("req"))
    allocating = op["op"] == "allocate_slots" and req is not None and not _missing_hit(player, op)
    if allocating:
        status, free_hits = req.status, _free_hit_blocks(player, op)
        gates_before = player.manager.last_allocate_slots
    player.seek(op_index + 1)
    facts = player.facts[-1]
    lines.append("what happened: " + describe_op(facts))
    lines += before
    if allocating:
        # The manager's own numbers: a call that raised before its gates left none.
        gates = player.manager.last_allocate_slots
        lines += _allocate_gates(None if gates is gates_before else gates, status, op,
                                 free_hits, facts)
    lines += _explain_after(player, op, facts, queue_before, held_before)
    return lines


def _queue(player: TracePlayer) -> list:
    return [(b.block_id, b.block_hash is not None)
            for b in player.manager.block_pool.free_block_queue.get_all_free_blocks()]


def _explain_before(player: TracePlayer, op: dict) -> list[str]:
    name = op["op"]
    if name not in ("allocate_slots", "get_computed_blocks", "free", "reset_prefix_cache"):
        return []
    if name == "reset_prefix_cache":
        pool = player.manager.block_pool
        used = [b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt > 0]
        cached = sum(1 for b in pool.blocks if b.block_hash is not None)
        if used:
            return [f"reset needs every block free; {len(used)} are in use "
                    f"({compress_ids(used[:20])}{' …' if len(used) > 20 else ''}), so it "
                    "refuses and changes nothing"]
        return [f"no block is in use, so all {cached} cached hashes are dropped"]
    req = player.requests.get(op.get("req"))
    if req is None:
        return [f"request {op.get('req')!r} is unknown at this point of the trace"]
    if name == "allocate_slots":
        if _missing_hit(player, op):
            return ["new_computed_blocks='last' but no lookup came before"]
        return _allocate_inputs(op, req)
    if name == "get_computed_blocks":
        return _hit_reasons(player, req)
    blocks = player.manager.get_block_ids(req.request_id)
    return [f"{req.request_id} holds " + "; ".join(
        f"g{i}: {compress_ids(ids)}" for i, ids in enumerate(blocks))
        + f" (status {req.status.name})"]


def _missing_hit(player: TracePlayer, op: dict) -> bool:
    """The op hands over the last lookup's hit, but there was no lookup."""
    return op.get("new_computed_blocks", ALLOCATE_DEFAULTS["new_computed_blocks"]) == "last" \
        and player.replayer.last_hit.get(op.get("req")) is None


def _allocate_inputs(op: dict, req: Request) -> list[str]:
    """The call's token counts, read before it runs."""
    kw = {k: op.get(k, default) for k, default in ALLOCATE_DEFAULTS.items()}
    n, ext = op["num_new_tokens"], kw["num_external_computed_tokens"]
    return [f"{req.request_id}: {req.num_computed_tokens} tokens computed, "
            f"{kw['num_new_computed_tokens']} from this step's prefix hit, {n} new"
            + (f", {ext} loaded externally" if ext else "")
            + (f", {kw['num_lookahead_tokens']} lookahead" if kw["num_lookahead_tokens"] else "")]


def _free_hit_blocks(player: TracePlayer, op: dict) -> int:
    """Hit blocks the call will take off the free queue (cached, held by nobody)."""
    if op.get("new_computed_blocks", ALLOCATE_DEFAULTS["new_computed_blocks"]) != "last":
        return 0
    hit = player.replayer.last_hit.get(op.get("req"))
    if hit is None:
        return 0
    return sum(1 for g in hit.blocks for b in g if not b.is_null and b.ref_cnt == 0)


def _allocate_gates(gates: AllocateSlotsGates | None, status: RequestStatus, op: dict,
                    free_hits: int, facts: OpFacts) -> list[str]:
    """The gates as the manager weighed them (``kvref.viz.gates``)."""
    if gates is None:
        raised = facts.observed.get("raises")
        return [f"allocate_slots stopped before its gates ({raised or 'no gate was reached'}):"
                " nothing to compute and nothing to load is a ValueError"]
    watermark, free = gates.watermark_blocks, gates.num_free_blocks
    lines = []
    if watermark:
        lines.append(f"watermark: a {status.name.lower()} request must leave "
                     f"{watermark} block(s) free while others are scheduled")
    if gates.full_sequence_blocks is not None:
        needed = gates.full_sequence_blocks
        if gates.refused_by == "full-sequence":
            return lines + [f"REFUSED by the full-sequence gate: the whole request needs "
                            f"{needed} blocks + {watermark} watermark = {needed + watermark}, "
                            f"{free} are free: short by {needed + watermark - free} "
                            "(nothing was freed or allocated)"]
        lines.append(f"full-sequence gate passed: {needed} + {watermark} <= {free} free")
    if gates.num_freed_blocks:
        lines.append(f"the attention window let go of {gates.num_freed_blocks} block(s) first "
                     "(they become null blocks in the table), even if the call then fails")
    needed, available = gates.num_blocks_needed, gates.num_available_blocks
    reserved_blocks = op.get("reserved_blocks", ALLOCATE_DEFAULTS["reserved_blocks"])
    free_after = available + reserved_blocks
    what = f"{needed} block{'' if needed == 1 else 's'}"
    if free_hits:
        what += f" (incl. {free_hits} free cached hit block(s) it takes off the free queue)"
    reserved = f" - {reserved_blocks} reserved" if reserved_blocks else ""
    if gates.refused_by == "capacity":
        lines.append(f"REFUSED by the capacity gate: needs {what} + {watermark} watermark, "
                     f"{free_after} free{reserved}: short by {needed + watermark - available}")
    else:
        lines.append(f"capacity gate passed: needs {what} + {watermark} watermark, "
                     f"{free_after} free{reserved}")
    return lines


def _hit_reasons(player: TracePlayer, req: Request) -> list[str]:
    m = player.manager
    coordinator, pool = m.coordinator, m.block_pool
    if not m.enable_caching:
        return ["prefix caching is off: never a hit"]
    if req.skip_reading_prefix_cache:
        return [f"{req.request_id} skips reading the prefix cache: no hit by request"]
    n, cap = req.num_tokens, req.num_tokens - 1
    hash_bs = coordinator.hash_block_size
    lines = [f"{req.request_id} has {n} tokens; {len(req.block_hashes)} full blocks of "
             f"{hash_bs} have hashes{'' if n % hash_bs == 0 else ' (the partial last block has none)'}. "
             f"A hit may cover at "
             f"most num_tokens - 1 = {cap} tokens: the last token is computed for its logits"]
    groups = m.kv_cache_config.kv_cache_groups
    own = {}
    if isinstance(coordinator, HybridKVCacheCoordinator):
        _, lengths = coordinator.find_longest_cache_hit_per_group(req.block_hashes, cap)
        own = dict(enumerate(lengths))
    for gid, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec):
            continue
        bs = spec.block_size
        hashes = req.block_hashes if bs == hash_bs else \
            BlockHashListWithBlockSize(req.block_hashes, hash_bs, bs)
        leading = 0
        while leading < len(hashes) and pool.get_cached_block(hashes[leading], [gid]):
            leading += 1
        if leading < len(hashes):
            num_cached = _num_cached(pool)
            pool_state = (f"the pool holds {num_cached} cached blocks, "
                          f"{_num_cached(pool, free_only=True)} of them free: the cache is "
                          "not empty, it holds other prefixes" if num_cached else
                          "the pool holds no cached block yet")
            lines.append(f"g{gid} (full, blocks of {bs}): blocks 0..{leading - 1} are cached; "
                         f"block {leading} (tokens {leading * bs}-{(leading + 1) * bs - 1}) "
                         "missed: no cached block has its hash. Hashes chain over every "
                         "earlier token (and LoRA, salt, images), so one different token "
                         "anywhere before makes this and every later block miss"
                         if leading else
                         f"g{gid} (full, blocks of {bs}): block 0 (tokens 0-{bs - 1}) missed: "
                         "no cached block has its hash, so nothing of this prefix is cached "
                         f"({pool_state})")
            lines.append(_why_never_cached(player, req, leading, bs))
        else:
            lines.append(f"g{gid} (full, blocks of {bs}): all {leading} hashed blocks are "
                         "cached")
        if leading * bs > cap:
            lines.append(f"the cap allows {cap // bs} whole blocks ({cap // bs * bs} tokens): "
                         f"block {cap // bs} is cached but recomputed"
                         + (" (the prompt is a whole number of blocks, so a whole block "
                            "is recomputed, not one token)" if n % bs == 0 else ""))
        break
    for gid, length in own.items():
        lines.append(f"g{gid} ({spec_label(groups[gid].kv_cache_spec)}) alone would hit "
                     f"{length} tokens")
    if own:
        lines.append("a hybrid hit must be served by every group: the groups shrink the "
                     "length in turn until none shrinks it (the fixed point)")
        shortest = min(own, key=own.get)
        if own[shortest] < max(own.values()):
            spec = groups[shortest].kv_cache_spec
            why = ""
            if isinstance(spec, SlidingWindowSpec):
                need = SlidingWindowManager.num_contiguous_blocks_for_hit(
                    spec.sliding_window, spec.block_size, use_eagle=False)
                why = (f": a window hit must end right after {need} cached window blocks "
                       "in a row, and no such run ends further right")
            lines.append(f"g{shortest} ({spec_label(spec)}) is what limits the hit to "
                         f"{own[shortest]} tokens{why}")
    if m.use_eagle:
        lines.append("EAGLE: the last block of a hit is dropped so its draft is recomputed")
    if coordinator.scheduler_block_size != min(g.kv_cache_spec.block_size for g in groups):
        lines.append(f"hits are multiples of scheduler_block_size "
                     f"{coordinator.scheduler_block_size} (the LCM of the block sizes)")
    return lines


def _why_never_cached(player: TracePlayer, req: Request, block: int, bs: int) -> str:
    """Compare with the earlier request sharing the most leading tokens."""
    mine = list(req.all_token_ids)
    best_req, best = None, -1
    for other in player.requests.values():
        if other is req:
            continue
        common = 0
        for a, b in zip(mine, other.all_token_ids):
            if a != b:
                break
            common += 1
        if common > best:
            best_req, best = other, common
    if best_req is None:
        return "no earlier request in this trace: nothing could have been cached for it"
    rid = best_req.request_id
    if best >= (block + 1) * bs:
        return (f"{rid} has the same tokens through block {block}, but that block is not "
                "cached now: it was evicted or reset since, or never computed (a "
                "request's last sampled token is never computed)")
    if best == best_req.num_tokens:
        return (f"the closest earlier request, {rid}, is a prefix of this one: it ends "
                f"after {best} tokens, inside block {best // bs}, so that block was never "
                "full and never cached (typical of a chat's next turn)")
    return (f"the closest earlier request, {rid}, shares only the first {best} tokens: "
            f"token {best} differs (block {best // bs}), and from there on every hash "
            "differs (compared by token ids; a LoRA, cache salt or image also changes "
            "hashes)")


def _num_cached(pool: BlockPool, free_only: bool = False) -> int:
    return sum(1 for b in pool.blocks if b.block_hash is not None
               and not (free_only and b.ref_cnt > 0))


def _explain_after(player: TracePlayer, op: dict, facts: OpFacts,
                   queue_before: list[tuple[int, bool]],
                   held_before: tuple[list[int], ...]) -> list[str]:
    name, ret = op["op"], facts.observed.get("ret")
    lines: list[str] = []
    if name == "get_computed_blocks" and ret is not None:
        lines.append(f"agreed hit: {ret['num_computed_tokens']} tokens, blocks "
                     + "; ".join(f"g{i}: {compress_ids(g)}" for i, g in enumerate(ret["blocks"])))
    elif name == "allocate_slots" and ret:
        taken = [b for g in ret for b in g if b != 0]
        head = [bid for bid, _ in queue_before[:len(taken)]]
        lines.append(f"new blocks come from the head of the free queue: {compress_ids(taken)}"
                     + ("" if sorted(taken) == sorted(head) else " (after the hit blocks "
                        "were taken out of it)"))
        if facts.evicted:
            positions = [i for i, (bid, _) in enumerate(queue_before) if bid in facts.evicted]
            unhashed_ahead = sum(1 for bid, hashed in queue_before[:max(positions) + 1]
                                 if not hashed)
            lines.append(f"evicted cached block(s) {compress_ids(facts.evicted)}: they were at "
                         f"queue position(s) {', '.join(map(str, positions))}, behind {unhashed_ahead} "
                         "unhashed block(s). Freed cached blocks join the tail, so the least "
                         "recently freed one is evicted first; their hashes are dropped")
        elif any(hashed for _, hashed in queue_before[:len(taken)]):
            lines.append("no cached block was evicted")
        if facts.newly_cached:
            lines.append(f"now cached (full blocks computed): {compress_ids(facts.newly_cached)}")
    elif name == "free":
        after = {bid: hashed for bid, hashed in _queue(player)}
        before_ids = {bid for bid, _ in queue_before}
        freed = [bid for bid in after if bid not in before_ids]
        cached = [b for b in freed if after[b]]
        plain = [b for b in freed if not after[b]]
        kind = "preempted (recompute later)" if facts.is_preemption else "finished"
        lines.append(f"{op['req']} {kind}. Freed tail first: cached block(s) "
                     f"{compress_ids(cached) if cached else 'none'} join the TAIL of the free queue "
                     "(evicted last, still hittable); unhashed block(s) "
                     f"{compress_ids(plain) if plain else 'none'} go to the HEAD (nobody can hit them)")
        blocks = player.manager.block_pool.blocks
        shared = sorted({b for g in held_before for b in g
                         if b != 0 and blocks[b].ref_cnt > 0})
        if shared:
            lines.append(f"block(s) {compress_ids(shared)} stay in use: other requests still "
                         "hold them (their ref count only went down)")
    elif name in ("reset_prefix_cache", "evict_blocks"):
        lines.append(f"hashes dropped: {compress_ids(facts.uncached) if facts.uncached else 'none'}; the free "
                     "queue keeps its order")
    return lines
