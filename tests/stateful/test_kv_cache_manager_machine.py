"""KVCacheManager driven the way vLLM's scheduler drives it, for every config class.

Requests (``r0``, ``r1``, ... in order of arrival, at most four at a time)
arrive with prompts that share a few system prompts, are admitted with a
prefix-cache lookup, prefill in chunks, decode (greedily, so equal prompts
decode equal tokens), speculate with draft tokens, get preempted, finish,
get aborted, lose blocks to a failed KV load; the prefix cache is evicted and
reset; whole scheduler steps run in between. The calls follow
``vllm/v1/core/sched/scheduler.py``: a new request hands its hit back to
``allocate_slots``, a running one passes none; after a successful allocation
the scheduler advances ``num_computed_tokens``; preemption frees the blocks,
marks the request PREEMPTED and restarts it from token 0; each step opens
with ``new_step_starts``.

The model remembers what each block was filled with (the whole prefix up to
the block's end, with its LoRA and cache salt), so a hit that serves the wrong
content is caught even when every count is right. With kvref's ``free``
changed to release a request head first, the shrunk failure reads (Hypothesis
also prints the three invariants after every step; left out here)::

    state = FullAttention()
    state.arrive(lora=None, own_tokens=0, salt=None, shared_prefix='sys-A', skip_cache_read=False)
    Draw 1 (request): 'r0'
    state.admit(data=data(...), num_tokens=5)
    Draw 2 (request): 'r0'
    state.abort(data=data(...))
    state.teardown()
    AssertionError: INV-EVICT-1: group 0's blocks were freed in the order [1, 2];
    a request frees its tail first, so its prefix stays cached longest

Run one config class with ``-k``, e.g. ``pytest tests/stateful -k HybridFullMamba``;
``--hypothesis-show-statistics`` shows how often admissions were refused,
hits found, requests preempted and cached blocks evicted.
"""

from __future__ import annotations

import sys

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref.verify.invariants import check

from .backend import (
    LoRARequest,
    Request,
    RequestStatus,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from .configs import CONFIGS, ModelConfig
from .event_consumer import EventConsumer
from .manager_checks import ManagerChecks, ids
from .content_model import (
    SHARED_PREFIXES,
    Content,
    PoolObserver,
    fresh_tokens,
    greedy_next_token,
)

MAX_LIVE = 4      # requests in the system at once (waiting or running)


class SchedulerDrivesManager(ManagerChecks, RuleBasedStateMachine):
    """The machine; each subclass below fixes one ``config``."""

    config: ModelConfig

    def __init__(self) -> None:
        super().__init__()
        init_none_hash(sha256)
        cfg = self.config
        self.manager = cfg.make_manager()
        self.pool = self.manager.block_pool
        self.coordinator = self.manager.coordinator
        self.specs = cfg.specs
        self.live: dict[str, Request] = {}
        self.waiting: list[str] = []          # admission order; preempted go first
        self.running: list[str] = []
        self.arrivals = 0
        self.finished_since_reset = False
        self.conversations: dict[str, tuple] = {}  # finished -> (tokens, lora, salt)
        self.in_flight: list[tuple[dict, list]] = []       # popped, not yet freed blocks
        # What each block holds (see content_model.Content), and the one-to-one
        # map between contents and index keys that hashing must give.
        self.content: dict[int, Content] = {}
        self.key_of_content: dict[Content, bytes] = {}
        self.content_of_key: dict[bytes, Content] = {}
        # Mamba states written in this step are not readable until the step has
        # run; kvref (like vLLM) refuses hits on any key cached in this step.
        self.states_written_this_step: set[int] = set()
        self.keys_cached_this_step: set[bytes] = set()
        self.observer = PoolObserver(self.pool, on_reuse=lambda i: self.content.pop(i, None))
        self.consumer = EventConsumer()
        self.tables_seen: dict[str, list[list[int]]] = {}
        self.expected_stats = self._zero_stats()

    # ------------------------------------------------------------------ arrivals

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(shared_prefix=st.sampled_from(sorted(SHARED_PREFIXES)), own_tokens=st.integers(0, 12),
          lora=st.sampled_from([None, "sql-lora"]), salt=st.sampled_from([None, "tenant-1"]),
          skip_cache_read=st.sampled_from([False, False, False, True]))
    def arrive(self, shared_prefix, own_tokens, lora, salt, skip_cache_read):
        """A new request (r0, r1, ... in order of arrival): a shared system prompt,
        then ``own_tokens`` tokens of its own. Equal counts give equal tokens, so
        two prompts can coincide or one extend another. ``skip_cache_read``: the
        request may not read the prefix cache (it still fills it)."""
        self._add_request(SHARED_PREFIXES[shared_prefix] + fresh_tokens(own_tokens), lora, salt,
                          skip_cache_read)

    @precondition(lambda self: len(self.live) < MAX_LIVE and self.conversations)
    @rule(data=st.data(), new_tokens=st.integers(1, 8))
    def arrive_next_turn(self, data, new_tokens):
        """The next turn of a finished conversation: its prompt and answer, then more."""
        after = data.draw(st.sampled_from(sorted(self.conversations)), label="next turn of")
        tokens, lora, salt = self.conversations[after]
        self._add_request(tokens + fresh_tokens(new_tokens, 700), lora, salt)

    def _add_request(self, tokens, lora, salt, skip_cache_read=False):
        cfg = self.config
        name = f"r{self.arrivals}"
        self.arrivals += 1
        limit = 12 if cfg.encoder_tokens else cfg.max_model_len - 1
        tokens = tokens[:limit] or [600]
        hasher = get_request_block_hasher(cfg.hash_block_size, sha256) \
            if cfg.enable_caching else None
        self.live[name] = Request(name, tokens, block_hasher=hasher, cache_salt=salt,
                                  lora_request=LoRARequest(lora, 1) if lora else None,
                                  skip_reading_prefix_cache=skip_cache_read)
        self.waiting.append(name)

    # --------------------------------------------------------------- scheduling
    # A rule that acts on a request draws it from those it applies to; the
    # story shows the draw as "Draw 1 (request): 'r0'" just before the step.

    def _pick(self, data, names) -> str:
        return data.draw(st.sampled_from(sorted(names)), label="request")

    def _prefilling(self) -> list[str]:
        return [r for r in self.running if self._tokens_left(r) >= 2]

    def _decoding(self) -> list[str]:
        """Running requests that have just sampled a token (one token left to compute)."""
        return [r for r in self.running if self._tokens_left(r) == 1]

    @precondition(lambda self: self.live)
    @rule(prefill_tokens=st.integers(1, 16))
    def engine_step(self, prefill_tokens):
        """One whole scheduler step, as vLLM's ``schedule()`` runs it: a new step
        opens; running requests, oldest first, each compute up to
        ``prefill_tokens`` prompt tokens or decode one token, and when the pool
        cannot hold one, the most recently admitted running request is preempted
        and the allocation retried; then, unless someone was preempted, waiting
        requests are admitted in order until one does not fit."""
        self._start_step()
        preempted = False
        for name in list(self.running):
            while name in self.running:
                tokens = prefill_tokens if self._tokens_left(name) >= 2 else 1
                if self._run_step(name, tokens):
                    break
                self._preempt(self.running[-1])
                preempted = True
        if not preempted:
            for name in list(self.waiting):
                if not self._admit(name, prefill_tokens):
                    break
        if self.running:  # cascade attention asks how much of a prefix everyone shares
            first = self.running[0]
            common = self.manager.get_num_common_prefix_blocks(first)
            tables = self.manager.get_blocks(first).blocks
            assert len(common) == len(tables) and all(
                0 <= n <= len(t) for n, t in zip(common, tables)), \
                f"get_num_common_prefix_blocks({first}) = {common}, tables {tables}"

    def _start_step(self):
        """``new_step_starts``: Mamba states written so far become readable. The
        scheduler also collects the fresh full-attention blocks (to zero them)
        and the prefix cache stats of the last step."""
        self.manager.new_step_starts()
        self.states_written_this_step.clear()
        self.keys_cached_this_step.clear()
        fresh = self.manager.take_new_block_ids()
        assert set(fresh) <= set(self.observer.handed_out), (
            f"take_new_block_ids returned {fresh}; only {self.observer.handed_out} "
            "were allocated since the last step")
        self.observer.handed_out.clear()
        stats = self.manager.make_prefix_cache_stats()
        expected, self.expected_stats = self.expected_stats, self._zero_stats()
        actual = {k: getattr(stats, k) for k in expected}
        assert actual == expected, f"prefix cache stats {actual}, model {expected}"

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), num_tokens=st.integers(1, 16))
    def admit(self, data, num_tokens):
        """Schedule a waiting (or preempted) request: look up its cached prefix,
        then allocate for up to ``num_tokens`` more of its tokens."""
        self._admit(self._pick(data, self.waiting), num_tokens)

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data(), num_tokens=st.integers(1, 16))
    def prefill_chunk(self, data, num_tokens):
        """The next chunk of a running request's prompt: up to ``num_tokens`` tokens."""
        self._run_step(self._pick(data, self._prefilling()), num_tokens)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def decode(self, data):
        """One decode step: compute the last sampled token and sample the next."""
        self._run_step(self._pick(data, self._decoding()), 1)

    @precondition(lambda self: self.config.draft_tokens > 0 and self._decoding())
    @rule(data=st.data(), draft_tokens=st.integers(1, 3), accepted=st.integers(0, 3))
    def speculate(self, data, draft_tokens, accepted):
        """A decode step with draft tokens, ``accepted`` of which turn out right."""
        name = self._pick(data, self._decoding())
        drafts = min(draft_tokens, self.config.draft_tokens)
        self._run_step(name, 1, drafts=drafts, accepted=min(accepted, drafts))

    def _tokens_left(self, name) -> int:
        req = self.live[name]
        return req.num_tokens - req.num_computed_tokens

    def _admit(self, name, chunk) -> bool:
        """Prefix lookup, then allocation for the hit and up to ``chunk`` more
        tokens; False if the request has to keep waiting."""
        cfg, req = self.config, self.live[name]
        before = self._pool_state()
        hit, num_hit = self.manager.get_computed_blocks(req)
        assert self._pool_state() == before, "INV-HIT-4: a prefix lookup changed the pool"
        self._count_lookup(req, num_hit)
        self._check_hit(req, hit, num_hit)

        n = min(chunk, req.num_tokens - num_hit, cfg.max_num_batched_tokens)
        if cfg.mamba_align:
            uncached = getattr(self.coordinator, "num_uncached_common_prefix_tokens", 0)
            n = self._mamba_aligned_chunk(req, n, num_hit, uncached)
            if n <= 0:
                return False
        lookahead = cfg.lookahead
        others_scheduled = bool(self.running)
        watermark = self.manager.watermark_blocks if others_scheduled else 0
        needed = self.coordinator.get_num_blocks_to_allocate(
            request_id=name, num_tokens=min(num_hit + n + lookahead, cfg.max_model_len),
            new_computed_blocks=hit.blocks, num_encoder_tokens=cfg.encoder_tokens,
            total_computed_tokens=num_hit, num_tokens_main_model=num_hit + n)
        free_before = self.pool.get_num_free_blocks()
        state_not_written = self._hit_reads_unwritten_state(hit)

        self.observer.positions = {}
        new = self.manager.allocate_slots(
            req, n, num_new_computed_tokens=num_hit, new_computed_blocks=hit,
            num_lookahead_tokens=lookahead, num_encoder_tokens=cfg.encoder_tokens,
            has_scheduled_reqs=others_scheduled)
        self.observer.positions = None
        fits = needed + watermark <= free_before
        if new is None:
            event("admission refused")
            self._check_refusal(name, before)
            if needed > self.pool.num_gpu_blocks:  # kvref's "state cached in this step"
                assert self._hit_state_keys(hit) & self.keys_cached_this_step, (
                    f"{name} was refused as if its Mamba hit were cached in this step, "
                    "but that key was cached in an earlier step")
            assert not fits, (
                f"allocate_slots refused to admit {name}, though it needs {needed} blocks, "
                f"the watermark keeps {watermark} and {free_before} are free")
            return False
        assert fits, (f"allocate_slots admitted {name} needing {needed} blocks plus a "
                      f"watermark of {watermark} with only {free_before} free")
        assert not state_not_written, (
            f"INV-CONTENT-1: {name} was admitted on a Mamba state cached in this very "
            "step, which holds nothing until the step that computes it has run")
        event("admitted with a prefix hit" if num_hit else "admitted without a hit")
        self._check_hit_starts_tables(name, hit)
        self._note_keys_cached(before)
        self.waiting.remove(name)
        self.running.append(name)
        req.status = RequestStatus.RUNNING
        self._step_done(name, num_hit, n)
        return True

    def _run_step(self, name, num_tokens, drafts=0, accepted=0) -> bool:
        """Allocate for the request's next tokens and run them; False if refused."""
        cfg, req = self.config, self.live[name]
        computed = req.num_computed_tokens
        n = min(num_tokens, req.num_tokens - computed) + drafts
        n = min(n, cfg.max_num_batched_tokens, cfg.max_model_len - computed - 1)
        if cfg.mamba_align:
            n = self._mamba_aligned_chunk(req, n, computed, 0)
        if n <= 0:
            return True
        drafts = max(0, min(drafts, n - (req.num_tokens - computed)))
        accepted = min(accepted, drafts)
        before = self._pool_state()
        self.observer.positions = self._positions(name)
        new = self.manager.allocate_slots(req, n, num_lookahead_tokens=cfg.lookahead)
        self.observer.positions = None
        if new is None:
            event("running request refused")
            self._check_refusal(name, before, keeps_blocks=True)
            needed = self.coordinator.get_num_blocks_to_allocate(
                request_id=name, num_tokens=min(computed + n + cfg.lookahead, cfg.max_model_len),
                new_computed_blocks=self.manager.empty_kv_cache_blocks.blocks,
                num_encoder_tokens=0, total_computed_tokens=computed,
                num_tokens_main_model=computed + n)
            free = self.pool.get_num_free_blocks()
            assert needed > free, (
                f"allocate_slots refused running request {name} although the {needed} "
                f"blocks it needs are free ({free}); the watermark is for admissions only")
            return False
        self._note_keys_cached(before)
        self._step_done(name, computed, n, drafts, accepted)
        return True

    def _step_done(self, name, computed, n, drafts=0, accepted=0):
        """The step ran: tokens up to the verified ones are in the blocks, and a
        request that reached its end samples (its drafts: ``accepted`` right ones
        plus one more token)."""
        cfg, req = self.config, self.live[name]
        self._check_step_slots(name, computed, n)
        reached_end = computed + n - drafts == req.num_tokens
        req.num_computed_tokens = computed + n - (drafts - accepted)
        capped = False
        if reached_end:
            for _ in range(accepted + 1):
                req.append_output_token_ids(greedy_next_token(req.all_token_ids))
                if req.num_tokens >= cfg.max_model_len:
                    capped = True
                    break
        self._record_written_blocks(name)
        if capped:
            event("finished at max_model_len")
            self._finish(name, RequestStatus.FINISHED_LENGTH_CAPPED)

    def _mamba_aligned_chunk(self, req, n, computed, uncached) -> int:
        """The scheduler's cut for Mamba "align" mode: prefill chunks end on a
        block boundary (states are cached only there), except the last one."""
        if computed >= max(req.num_prompt_tokens, req.num_tokens - 1):
            return n
        bs = self.config.attention_block_size
        last = req.num_tokens - req.num_tokens % bs
        if self.config.use_eagle:
            last = max(last - bs, 0)
        end = computed + n
        if end < last:
            n = n // bs * bs
        elif computed < last < end:
            n = last - computed
        if uncached >= bs and n > uncached:
            n = uncached // bs * bs
        return n

    # ---------------------------------------------------------- leaving the GPU

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        """The scheduler needs room: free the request's blocks and requeue it first."""
        self._preempt(self._pick(data, self.running))

    def _preempt(self, name):
        event("preempted")
        req = self.live[name]
        self._free(name)
        self.running.remove(name)
        self.waiting.insert(0, name)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def finish(self, data):
        """The request sampled its stop token."""
        self._finish(self._pick(data, self._decoding()), RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def finish_while_step_in_flight(self, data):
        """Finish while the next step may still write its blocks (async
        scheduling): the blocks are popped now and freed when that step completes."""
        name = self._pick(data, self._decoding())
        req = self.live[name]
        positions = self._positions(name)
        tables = [list(t) for t in self.manager.get_blocks(name).blocks]
        req.status = RequestStatus.FINISHED_STOPPED
        popped = self.manager.pop_blocks_for_free(req)
        assert ids(popped) == [b.block_id for t in tables for b in t], \
            "pop_blocks_for_free must return every group's table, in order"
        self.in_flight.append((positions, popped))
        self._remember_conversation(name)
        self._forget(name)

    @precondition(lambda self: self.in_flight)
    @rule()
    def in_flight_step_completes(self):
        """The scheduler frees the popped blocks, tail first."""
        for positions, popped in self.in_flight:
            self.observer.positions = positions
            self.pool.free_blocks(reversed(popped))
            self.observer.positions = None
        self.in_flight.clear()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        """The client goes away in the middle of a running request."""
        self._finish(self._pick(data, self.running), RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), first_block=st.integers(0, 8))
    def kv_load_fails(self, data, first_block):
        """A KV connector reports the request's blocks from ``first_block`` on as
        bad: they are evicted from the prefix cache and the request fails."""
        name = self._pick(data, self.running)
        block_ids = self.manager.get_block_ids(name)[0][first_block:]
        self.manager.evict_blocks(set(block_ids))
        self._finish(name, RequestStatus.FINISHED_ERROR)

    def _finish(self, name, status):
        self.finished_since_reset = True
        self.live[name].status = status
        self._free(name)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            self._remember_conversation(name)
        self._forget(name)

    def _remember_conversation(self, name):
        req = self.live[name]
        lora = req.lora_request.lora_name if req.lora_request else None
        self.conversations[name] = (list(req.all_token_ids), lora, req.cache_salt)

    def _forget(self, name):
        for queue in (self.waiting, self.running):
            if name in queue:
                queue.remove(name)
        del self.live[name]
        self.tables_seen.pop(name, None)

    def _free(self, name):
        """``free`` releases every block the request holds, each group tail first."""
        holds = [list(t) for t in self.manager.get_blocks(name).blocks]
        refs_before = dict(self.observer.refs)
        self.observer.positions = self._positions(name)
        self.manager.free(self.live[name])
        self.observer.positions = None
        self.tables_seen.pop(name, None)
        assert not any(self.manager.get_blocks(name).blocks), \
            f"INV-FREE-1: {name} still holds blocks after free"
        for mgr in self.coordinator.single_type_managers:
            assert name not in mgr.req_to_blocks and name not in mgr.num_cached_block, \
                f"INV-FREE-1: a group manager still knows {name} after free"
        for table in holds:
            for block in table:
                if not block.is_null:
                    refs_before[block.block_id] -= 1
        assert refs_before == self.observer.refs, \
            f"INV-FREE-1: free({name}) must drop exactly one reference per block it held"

    # ------------------------------------------------------------ the prefix cache

    @precondition(lambda self: self._cached_block_ids())
    @rule(data=st.data())
    def evict_cached_block(self, data):
        """Drop one block from the prefix cache by id (it stays allocated if in use)."""
        block_id = data.draw(st.sampled_from(self._cached_block_ids()), label="block")
        self.manager.evict_blocks({block_id})

    def _cached_block_ids(self) -> list[int]:
        return sorted(self._hashes())

    @precondition(lambda self: self.finished_since_reset)
    @rule(preempt_running_first=st.booleans())
    def reset_prefix_cache(self, preempt_running_first):
        """Forget every cached prefix (after a weight update). With
        ``preempt_running_first`` the engine first pauses: in-flight steps
        complete and every running request is preempted, so it must succeed."""
        if preempt_running_first:
            self.in_flight_step_completes()
            for name in reversed(list(self.running)):
                self._preempt(name)
        self.finished_since_reset = False
        idle = not self.running and not self.in_flight
        assert self.manager.reset_prefix_cache() is idle, (
            "INV-RESET-1: reset_prefix_cache must succeed exactly when no block is in use "
            f"(running: {self.running}, in flight: {len(self.in_flight)})")
        if idle:
            self.expected_stats["reset"] = True
            assert len(self.pool.cached_block_hash_to_block) == 0, \
                "INV-RESET-1: the index is not empty after a reset"

    def _note_keys_cached(self, before):
        """Remember the keys an allocation just cached (``before``: ``_pool_state()``):
        blocks whose key changed, and blocks it handed out again (evicted, then
        perhaps cached anew under the very same key)."""
        hashes_before, handed_out_before = before[2], before[3]
        reused = set(self.observer.handed_out[handed_out_before:])
        self.keys_cached_this_step |= {key for i, key in self._hashes().items()
                                       if hashes_before.get(i) != key or i in reused}

    def _count_lookup(self, req, num_hit):
        if not self.config.enable_caching or req.skip_reading_prefix_cache:
            return
        prefix = "preempted_" if req.num_preemptions else ""
        self.expected_stats[prefix + "requests"] += 1
        self.expected_stats[prefix + "queries"] += req.num_tokens
        self.expected_stats[prefix + "hits"] += num_hit

    @staticmethod
    def _zero_stats() -> dict:
        return dict(reset=False, requests=0, queries=0, hits=0, preempted_requests=0,
                    preempted_queries=0, preempted_hits=0)

    # -------------------------------------------------------------- invariants
    # Hypothesis prints each invariant after each step of a shrunk story, so
    # they are few, named as statements, and each cites the spec ids it checks.

    @invariant()
    def every_block_is_accounted_for(self):
        """INV-MGR-1, INV-QUEUE-1/2/4/5, INV-EVICT-1/2, INV-POOL-3/5/6, no leaks:
        ref counts equal holders; the free queue, walked both ways, holds exactly
        the unreferenced blocks in the model's eviction order; the null block
        stays null; usage is the used fraction; nothing is held when nothing runs."""
        self._check_reference_counts()
        self._check_free_queue()
        self._check_null_block()
        self._check_usage_and_leaks()

    @invariant()
    def prefix_cache_tells_the_truth(self):
        """INV-CONTENT-1, INV-HASH-1/2, INV-EVT-1: every cached block holds the
        content its key names (keys and contents one to one), and a consumer of
        the KV events alone rebuilds the same index."""
        self._check_cached_contents()
        self._check_event_consumer()

    @invariant()
    def block_tables_are_consistent(self):
        """INV-MGR-1..9, INV-POOL-*, INV-QUEUE-*, INV-HASH-*: tables only grow or
        null out, waiting requests hold nothing, and kvref's own snapshot checker
        (kvref.verify.invariants.check) finds nothing."""
        self._check_tables_only_grow()
        for name in self.waiting:
            assert not any(self.manager.get_blocks(name).blocks), \
                f"INV-ALLOC-1/INV-FREE-1: waiting request {name} holds blocks"
        check(self.manager, popped_blocks=[popped for _, popped in self.in_flight])

    def teardown(self):
        """Drain: every request is aborted and in-flight frees land; then nothing
        may be held and the cache must reset."""
        if sys.exc_info()[0] is not None:
            return  # the run already failed; draining a broken state would report it twice
        for name in list(self.live):
            self._finish(name, RequestStatus.FINISHED_ABORTED)
        self.in_flight_step_completes()
        self.every_block_is_accounted_for()
        assert self.manager.reset_prefix_cache(), "INV-RESET-1: the final reset failed"
        self._check_event_consumer()
        assert not self.consumer.cached, "INV-EVT-1: events left cached hashes after a reset"


class FullAttention(SchedulerDrivesManager):
    config = CONFIGS["full"]


class SlidingWindow(SchedulerDrivesManager):
    config = CONFIGS["sliding_window"]


class ChunkedLocal(SchedulerDrivesManager):
    config = CONFIGS["chunked_local"]


class ChunkedLocalOnly(SchedulerDrivesManager):
    config = CONFIGS["chunked_local_only"]


class MambaAll(SchedulerDrivesManager):
    config = CONFIGS["mamba_all"]


class MambaAlign(SchedulerDrivesManager):
    config = CONFIGS["mamba_align"]


class MambaAlignOnly(SchedulerDrivesManager):
    config = CONFIGS["mamba_align_only"]


class CrossAttention(SchedulerDrivesManager):
    config = CONFIGS["cross_attention"]


class HybridFullSlidingWindow(SchedulerDrivesManager):
    config = CONFIGS["hybrid_full_swa"]


class HybridFullMamba(SchedulerDrivesManager):
    config = CONFIGS["hybrid_full_mamba"]


class HybridFullMambaDifferentBlockSizes(SchedulerDrivesManager):
    config = CONFIGS["hybrid_full_mamba_diff_block_sizes"]


class HybridDifferentBlockSizes(SchedulerDrivesManager):
    config = CONFIGS["hybrid_diff_block_sizes"]


class HybridDifferentBlockSizesWindowFirst(SchedulerDrivesManager):
    config = CONFIGS["hybrid_diff_block_sizes_swa_first"]


class HybridDifferentBlockSizesFinerWindow(SchedulerDrivesManager):
    config = CONFIGS["hybrid_diff_block_sizes_finer_window"]


class NoPrefixCaching(SchedulerDrivesManager):
    config = CONFIGS["no_caching"]


class Eagle(SchedulerDrivesManager):
    config = CONFIGS["eagle"]


class EagleHybridFullSlidingWindow(SchedulerDrivesManager):
    config = CONFIGS["eagle_hybrid_full_swa"]


class EagleHybridDifferentBlockSizes(SchedulerDrivesManager):
    config = CONFIGS["eagle_hybrid_diff_block_sizes"]


class HybridFullMambaRetention(SchedulerDrivesManager):
    config = CONFIGS["hybrid_full_mamba_retention"]


class HybridFullWindowRetainLatest(SchedulerDrivesManager):
    config = CONFIGS["hybrid_full_swa_retain_latest"]


class MambaMultiTokenPrediction(SchedulerDrivesManager):
    config = CONFIGS["mamba_mtp"]


class MambaAlignMultiTokenPrediction(SchedulerDrivesManager):
    config = CONFIGS["mamba_align_mtp"]


TestFullAttention = FullAttention.TestCase
TestSlidingWindow = SlidingWindow.TestCase
TestChunkedLocal = ChunkedLocal.TestCase
TestChunkedLocalOnly = ChunkedLocalOnly.TestCase
TestMambaAll = MambaAll.TestCase
TestMambaAlign = MambaAlign.TestCase
TestMambaAlignOnly = MambaAlignOnly.TestCase
TestCrossAttention = CrossAttention.TestCase
TestHybridFullSlidingWindow = HybridFullSlidingWindow.TestCase
TestHybridFullMamba = HybridFullMamba.TestCase
TestHybridFullMambaDifferentBlockSizes = HybridFullMambaDifferentBlockSizes.TestCase
TestHybridDifferentBlockSizes = HybridDifferentBlockSizes.TestCase
TestHybridDifferentBlockSizesWindowFirst = HybridDifferentBlockSizesWindowFirst.TestCase
TestHybridDifferentBlockSizesFinerWindow = HybridDifferentBlockSizesFinerWindow.TestCase
TestNoPrefixCaching = NoPrefixCaching.TestCase
TestEagle = Eagle.TestCase
TestEagleHybridFullSlidingWindow = EagleHybridFullSlidingWindow.TestCase
TestEagleHybridDifferentBlockSizes = EagleHybridDifferentBlockSizes.TestCase
TestHybridFullMambaRetention = HybridFullMambaRetention.TestCase
TestHybridFullWindowRetainLatest = HybridFullWindowRetainLatest.TestCase
TestMambaMultiTokenPrediction = MambaMultiTokenPrediction.TestCase
TestMambaAlignMultiTokenPrediction = MambaAlignMultiTokenPrediction.TestCase
