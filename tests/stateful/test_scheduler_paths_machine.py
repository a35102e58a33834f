"""The paths of vLLM's ``Scheduler.schedule()`` that the manager machine skips.

``SchedulerDrivesManager`` (``test_kv_cache_manager_machine.py``) drives the
manager one request at a time. This machine adds the whole step as vLLM
0.25.1's scheduler runs it (``specs/scheduler.md``), and checks kvref's answers
against an exact model (``exact_model.py``), not only against safety:

- ``schedule``: one step with a token budget shared by every request,
  ``max_num_seqs``, ``long_prefill_token_threshold`` (chunks that stop
  mid-block), FCFS or PRIORITY preemption (which can un-schedule a request
  already scheduled in this step), ``full_sequence_must_fit`` with and without
  a watermark, and a KV connector: external tokens loaded with the step, or an
  asynchronous load (``delay_cache_blocks``, ``reserved_blocks``);
- ``kv_load_lands``: an asynchronous load lands (``cache_blocks``) or fails and
  is recomputed from a block boundary;
- ``arrive_with_extras``: requests that differ only in LoRA, cache salt or an
  image, and a priority;
- every finish with a connector runs ``remove_skipped_blocks`` first.

The exact model checks, after every call: the null prefix of every window and
chunk table (INV-SKIP-1), whether ``allocate_slots`` succeeds (INV-ALLOC-3),
which block ids it hands out (INV-ALLOC-4), what ``take_new_block_ids``
reports (INV-ALLOC-5), which positions are cached (INV-CACHE-1, and with a
retention interval or a coarser alignment which of them are hashed, INV-CACHE-2), and every
request's hash chain with its extra keys (INV-CHAIN-2). All the manager
machine's rules and checks run here too.

With the window skipping one token fewer than vLLM (``n - w`` for ``n - w +
1``), every safety invariant still holds; one shrunk story (invariant calls
left out) reads::

    state = WindowAtBlockEdges()
    state.arrive(lora=None, own_tokens=0, salt=None, shared_prefix='none', skip_cache_read=False)
    state.arrive_with_extras(image=None, image_at=0, image_len=1, lora=None, own_tokens=0,
                             priority=0, salt=None, shared_prefix='sys-A')
    Draw 1 (request): 'r1'
    state.admit(data=data(...), num_tokens=8)
    Draw 2 (request): 'r1'
    state.abort(data=data(...))
    AssertionError: INV-SKIP-1: after remove_skipped_blocks at finish, group 0 of r1
    has nulls at [] for 8 computed tokens; vLLM skips 4 tokens: nulls at [0]

Run one class with ``-k``, e.g. ``pytest tests/stateful -k WindowAtBlockEdges``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvref import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

from .backend import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
    get_request_block_hasher,
    kv_cache_utils,
    sha256,
)
from .configs import ModelConfig
from .exact_model import (
    cdiv,
    expected_extra_keys,
    is_hashed_by_caching,
    is_plain_full_attention,
    predict_allocation,
    skipped_tokens,
)
from .content_model import SHARED_PREFIXES, Content, fresh_tokens
from .test_kv_cache_manager_machine import SchedulerDrivesManager

IMAGE_TOKEN = 7     # every placeholder token of an image has this id, as in vLLM


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's knobs (vLLM's ``SchedulerConfig`` and connector)."""

    model: ModelConfig
    policy: str = "fcfs"                      # or "priority"
    max_num_seqs: int = 3
    long_prefill_token_threshold: int = 0     # 0: no cap per chunk
    full_sequence_must_fit: bool = False      # scheduler_reserve_full_isl
    connector: bool = False


@dataclass
class RemoteLoad:
    """An asynchronous KV load: where the loaded blocks start, and whether it landed."""

    first_loaded_block: int
    ready: bool = False


class SchedulerPaths(SchedulerDrivesManager):
    """The machine; each subclass fixes ``settings`` (and so ``config``)."""

    settings: SchedulerSettings

    def __init__(self) -> None:
        super().__init__()
        self.remote: dict[str, RemoteLoad] = {}      # WAITING_FOR_REMOTE_KVS, holding blocks
        self.priority: dict[str, int] = {}
        self.arrival: dict[str, int] = {}
        self.cached_upto: dict[str, list[int]] = {}  # INV-CACHE-1's f, per group
        self.hit_upto: dict[str, list[int]] = {}     # INV-CACHE-2's h, per group
        self.uncached_by_evict: set[int] = set()
        self.cached_unwritten: set[int] = set()      # INV-SCHED-1's vLLM defect
        self.step_handout: list[list[int]] = [[] for _ in self.specs]
        self.chain_checked: dict[str, tuple[int, bytes | None]] = {}
        evict = self.pool.evict_blocks

        def evict_blocks(block_ids):
            self.uncached_by_evict |= {i for i in block_ids
                                       if self.pool.blocks[i].block_hash is not None}
            evict(block_ids)

        self.pool.evict_blocks = evict_blocks
        forget_content = self.observer.on_reuse

        def on_reuse(block_id):
            forget_content(block_id)
            self.uncached_by_evict.discard(block_id)
            self.cached_unwritten.discard(block_id)

        self.observer.on_reuse = on_reuse

    # ------------------------------------------------------------------ arrivals

    @precondition(lambda self: len(self.live) < 4)
    @rule(shared_prefix=st.sampled_from(sorted(SHARED_PREFIXES)), own_tokens=st.integers(0, 12),
          lora=st.sampled_from([None, "sql-lora"]), salt=st.sampled_from([None, "tenant-1"]),
          image=st.sampled_from([None, "img-a", "img-b"]), image_at=st.integers(0, 8),
          image_len=st.integers(1, 6), priority=st.integers(0, 2))
    def arrive_with_extras(self, shared_prefix, own_tokens, lora, salt, image, image_at,
                           image_len, priority):
        """A request whose own tokens may hold an image (placeholder tokens, all
        ``IMAGE_TOKEN``, identified by the image): two requests with equal token
        ids but different images, LoRA or salt must share exactly the blocks
        before the first one whose extra keys differ."""
        prefix = SHARED_PREFIXES[shared_prefix]
        tokens = prefix + fresh_tokens(own_tokens)
        features = []
        if image is not None and image_at < own_tokens:
            offset = len(prefix) + image_at
            length = min(image_len, own_tokens - image_at)
            tokens[offset:offset + length] = [IMAGE_TOKEN] * length
            features.append(MultiModalFeatureSpec(image, PlaceholderRange(offset, length)))
        self._new_request(tokens, lora, salt, False, features, priority)

    def _add_request(self, tokens, lora, salt, skip_cache_read=False):
        # Later arrivals more urgent: a PRIORITY victim is then often a request
        # already scheduled earlier in the step.
        self._new_request(tokens, lora, salt, skip_cache_read, [], 2 - self.arrivals % 3)

    def _new_request(self, tokens, lora, salt, skip_cache_read, features, priority):
        cfg = self.config
        name = f"r{self.arrivals}"
        self.arrival[name] = self.arrivals
        self.priority[name] = priority
        self.arrivals += 1
        tokens = tokens[:cfg.max_model_len - 1] or [600]
        features = [f for f in features if f.mm_position.offset + f.mm_position.length
                    <= len(tokens)]
        self.live[name] = Request(
            name, tokens, block_hasher=get_request_block_hasher(cfg.hash_block_size, sha256),
            cache_salt=salt, lora_request=LoRARequest(lora, 1) if lora else None,
            mm_features=features, skip_reading_prefix_cache=skip_cache_read)
        self.waiting.append(name)

    def _content_of(self, req, group, index) -> Content:
        """A block's content: the prefix up to its end, an image's placeholders
        standing for the image (``(identifier, index in the image)``)."""
        end = (index + 1) * self.specs[group].block_size
        prefix = list(req.all_token_ids[:end])
        for feature in req.mm_features:
            start = feature.mm_position.offset
            for t in range(start, min(start + feature.mm_position.length, end)):
                prefix[t] = (feature.identifier, t - start)
        lora = req.lora_request.lora_name if req.lora_request else None
        return Content(group, lora, req.cache_salt, tuple(prefix))

    # --------------------------------------------------------------- one step

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def schedule(self, data):
        """One ``Scheduler.schedule()``: running requests first, each its next
        chunk within the shared budget (preempting when the pool is full), then,
        unless someone was preempted, waiting requests while budget and
        ``max_num_seqs`` allow; then the step runs."""
        s, cfg = self.settings, self.config
        self._start_step()
        self.step_handout = [[] for _ in self.specs]
        budget = cfg.max_num_batched_tokens
        threshold = s.long_prefill_token_threshold
        scheduled: dict[str, tuple[int, int]] = {}
        cached_now: dict[str, set[int]] = {}
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            name = self.running[i]
            req = self.live[name]
            n = req.num_tokens - req.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, cfg.max_model_len - 1 - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while True:
                outcome = self._allocate(name, n)
                if outcome is not None:
                    break
                victim = self._victim()
                if victim in scheduled:
                    event("preemption un-scheduled a request of this step")
                    budget += scheduled.pop(victim)[1]
                    self._unschedule(victim, cached_now.pop(victim))
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim == name:
                    break
            if outcome is None:
                break
            scheduled[name] = (req.num_computed_tokens, n)
            cached_now[name] = outcome
            budget -= n
            i += 1
        if not preempted:
            while budget > 0 and len(self.running) < s.max_num_seqs:
                name = self._next_waiting()
                if name is None:
                    break
                admitted = self._admit_waiting(name, budget, data)
                if admitted is None:
                    break
                if admitted[1] > 0:
                    scheduled[name] = admitted
                    budget -= admitted[1]
        assert sum(n for _, n in scheduled.values()) <= cfg.max_num_batched_tokens
        self._check_new_block_ids()
        for name, (computed, n) in scheduled.items():
            if name in self.live:
                self._step_done(name, computed, n)
                if name in self.live:
                    self._note_cached(name, self.live[name].num_computed_tokens)

    def _victim(self) -> str:
        if self.settings.policy == "priority":
            return max(self.running, key=lambda r: (self.priority[r], self.arrival[r]))
        return self.running[-1]

    def _next_waiting(self) -> str | None:
        """FCFS: requests back from a KV load first (loads still in flight are
        passed over), then the queue; PRIORITY: the smallest (priority, arrival)."""
        ready = [r for r, load in self.remote.items() if load.ready]
        candidates = ready + self.waiting
        if not candidates:
            return None
        if self.settings.policy == "priority":
            return min(candidates, key=lambda r: (self.priority[r], self.arrival[r]))
        return candidates[0]

    def _admit_waiting(self, name, budget, data) -> tuple[int, int] | None:
        """Admit one waiting request (``None``: refused, stop admitting); returns
        ``(computed, scheduled tokens)``, 0 tokens for an asynchronous load."""
        s, req = self.settings, self.live[name]
        hit, local, ext, load_async = self.manager.empty_kv_cache_blocks, 0, 0, False
        if req.num_computed_tokens == 0:
            before = self._pool_state()
            hit, local = self.manager.get_computed_blocks(req)
            assert self._pool_state() == before, "INV-HIT-4: a prefix lookup changed the pool"
            self._count_lookup(req, local)
            self._check_hit(req, hit, local)
            if s.connector:
                ext, load_async = self._connector_lookup(req, local, data)
        computed = req.num_computed_tokens + local + ext
        n = 0
        if not load_async:
            n = req.num_tokens - computed
            if 0 < s.long_prefill_token_threshold < n:
                n = s.long_prefill_token_threshold
            n = min(n, budget)
        reserved = self._reserved_blocks() if load_async else 0
        outcome = self._allocate(name, n, hit=hit, num_hit=local, ext=ext,
                                 load_async=load_async, reserved=reserved,
                                 full_sequence_must_fit=s.full_sequence_must_fit)
        if outcome is None:
            event("admission refused")
            return None
        self._check_hit_starts_tables(name, hit)
        if name in self.remote:
            del self.remote[name]
        else:
            self.waiting.remove(name)
        req.num_computed_tokens = computed
        if load_async:
            event("asynchronous KV load started")
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            first = [max(skipped_tokens(spec, computed) // spec.block_size, len(h))
                     for spec, h in zip(self.specs, hit.blocks)]
            self.remote[name] = RemoteLoad(max(first))
            return (computed, 0)
        event("admitted with external tokens" if ext else "admitted")
        req.status = RequestStatus.RUNNING
        self.running.append(name)
        return (computed, n)

    def _connector_lookup(self, req, local, data) -> tuple[int, bool]:
        """A KV connector's ``get_num_new_matched_tokens``: nothing, some tokens
        loaded with this step, or (a fresh prompt) the rest of the prompt loaded
        asynchronously."""
        mode = data.draw(st.sampled_from(["none", "sync", "async"]), label="connector")
        fresh = req.num_preemptions == 0 and req.num_tokens == req.num_prompt_tokens
        whole = req.num_prompt_tokens - local
        if any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for s in self.specs):
            # Loading the whole prompt would null the window's blocks for the
            # full length, then recompute the last token with some of them gone
            # (see specs/scheduler.md): load all but the last token instead.
            whole -= 1
        if mode == "async" and fresh and whole > 0:
            return whole, True
        room = req.num_tokens - 1 - local
        if mode == "sync" and room > 0:
            return data.draw(st.integers(1, room), label="external tokens"), False
        return 0, False

    def _reserved_blocks(self) -> int:
        """What vLLM's scheduler promises to prefills in flight (KV loads not
        landed, prompts not fully computed): their whole sequence's blocks, with
        the admission cap, as the coordinator counts them."""
        cfg = self.config
        inflight = list(self.remote) + [r for r in self.running
                                        if self.live[r].num_computed_tokens
                                        < self.live[r].num_prompt_tokens]
        total = 0
        for name in inflight:
            req = self.live[name]
            full = min(req.num_tokens, cfg.max_model_len)
            total += self.coordinator.get_num_blocks_to_allocate(
                request_id=name, num_tokens=full,
                new_computed_blocks=self.manager.empty_kv_cache_blocks.blocks,
                num_encoder_tokens=0, total_computed_tokens=req.num_computed_tokens,
                num_tokens_main_model=full, apply_admission_cap=True)
        return total

    # ---------------------------------------------------------- the exact model

    def _allocate(self, name, n, hit=None, num_hit=0, ext=0, load_async=False,
                  reserved=0, full_sequence_must_fit=False) -> set[int] | None:
        """``allocate_slots`` with the exact model's answer checked; returns the
        block ids it cached, or None when refused."""
        cfg, req = self.config, self.live[name]
        hit = hit if hit is not None else self.manager.empty_kv_cache_blocks
        tables = [list(t) for t in self.manager.get_blocks(name).blocks]
        allocated_before = name in self.cached_upto
        has_scheduled = bool(self.running)
        prediction = predict_allocation(
            specs=self.specs, tables=tables, hits=hit.blocks, request=req,
            num_new_tokens=n, num_hit=num_hit, num_external=ext,
            free_queue=list(self.observer.free_list), max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            watermark_blocks=int(cfg.watermark * cfg.num_blocks),
            has_scheduled_reqs=has_scheduled, full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved, allocated_before=allocated_before)
        before = self._pool_state()
        handed_before = len(self.observer.handed_out)
        self.observer.positions = self._positions(name)
        new = self.manager.allocate_slots(
            req, n, num_new_computed_tokens=num_hit, new_computed_blocks=hit,
            num_external_computed_tokens=ext, delay_cache_blocks=load_async,
            full_sequence_must_fit=full_sequence_must_fit, reserved_blocks=reserved,
            has_scheduled_reqs=has_scheduled)
        self.observer.positions = None
        T = prediction.total_computed
        assert (new is not None) == prediction.fits, (
            f"INV-ALLOC-3: allocate_slots({name}, {n}, hit {num_hit}, external {ext}, "
            f"reserved {reserved}, full_sequence_must_fit={full_sequence_must_fit}) "
            f"returned {'None' if new is None else 'blocks'}; vLLM "
            f"{'admits' if prediction.fits else 'refuses'} ({prediction.why or 'it fits'})")
        if new is None:
            if not prediction.why.startswith("the whole request"):
                self._check_skipped(name, T, "a refused allocate_slots")
            self._check_refusal(name, before, keeps_blocks=allocated_before)
            return None
        self._check_skipped(name, T, "allocate_slots")
        got = self.observer.handed_out[handed_before:]
        expected = prediction.sequence
        assert got == expected, (
            f"INV-ALLOC-4: allocate_slots for {name} handed out {got}; vLLM hands out "
            f"{prediction.handed_out} (per group: the free queue's head after the window "
            "frees and the hit's touches, external blocks first)")
        for g, ids in enumerate(prediction.handed_out):
            self.step_handout[g] += ids
        if not allocated_before:
            self.cached_upto[name] = [max(skipped_tokens(spec, T) // spec.block_size, len(h))
                                      for spec, h in zip(self.specs, hit.blocks)]
            self.hit_upto[name] = [len(h) for h in hit.blocks]
        if not load_async:
            self._note_cached(name, min(T + n, req.num_tokens))
        # Cached by this call: a new key, or a block handed out again (evicted,
        # then perhaps cached anew under the very same key in this call).
        cached_now = {i for i, h in self._hashes().items()
                      if before[2].get(i) != h or i in got}
        # The step writes these blocks before any attention of the same step
        # reads them, so a request admitted later in this step may hit them.
        for g, table in enumerate(self.manager.get_blocks(name).blocks):
            for p, block in enumerate(table):
                if block.block_id in cached_now:
                    self.content.setdefault(block.block_id, self._content_of(req, g, p))
        return cached_now

    def _note_cached(self, name, num_tokens):
        """INV-CACHE-1: caching has covered ``num_tokens`` tokens of ``name``."""
        upto = self.cached_upto.setdefault(name, [0] * len(self.specs))
        for g, spec in enumerate(self.specs):
            upto[g] = max(upto[g], num_tokens // spec.block_size)

    def _check_skipped(self, name, num_computed, when):
        """INV-SKIP-1: nulls at exactly the positions vLLM's window or chunk skips."""
        for g, (spec, table) in enumerate(zip(self.specs, self.manager.get_blocks(name).blocks)):
            if not isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                continue
            skipped = skipped_tokens(spec, num_computed)
            k = min(skipped // spec.block_size, len(table))
            nulls = [p for p, b in enumerate(table) if b.is_null]
            if k:
                event(f"window or chunk freed blocks ({type(spec).__name__})")
            assert nulls == list(range(k)), (
                f"INV-SKIP-1: after {when}, group {g} of {name} has nulls at {nulls} for "
                f"{num_computed} computed tokens; vLLM skips {skipped} tokens: "
                f"nulls at {list(range(k))}")

    def _check_new_block_ids(self):
        """INV-ALLOC-5: the fresh full-attention blocks, group by group, exactly."""
        expected = [b for g, spec in enumerate(self.specs) if is_plain_full_attention(spec)
                    for b in self.step_handout[g]]
        fresh = self.manager.take_new_block_ids()
        assert fresh == expected, (
            f"INV-ALLOC-5: take_new_block_ids() returned {fresh}; this step handed "
            f"{expected} to full-attention groups")
        self.step_handout = [[] for _ in self.specs]

    def _unschedule(self, victim, cached_now):
        """INV-SCHED-1: the victim's step never runs, yet what its allocation
        cached stays cached (vLLM 0.25.1 defect): the model keeps the content
        their keys name (recorded at allocation) and marks them never written."""
        for table in self.manager.get_blocks(victim).blocks:
            for block in table:
                if block.block_id in cached_now and block.block_hash is not None:
                    self.cached_unwritten.add(block.block_id)

    def _check_hit(self, req, hit, num_hit):
        super()._check_hit(req, hit, num_hit)
        # The manager machine's admissions allocate without _allocate: note the hit here.
        self.hit_upto[req.request_id] = [len(h) for h in hit.blocks]
        if any(b.block_id in self.cached_unwritten for blocks in hit.blocks for b in blocks):
            event("vLLM defect: hit on a block cached by an un-scheduled step")

    # ------------------------------------------------------------ KV connector

    @precondition(lambda self: any(not load.ready for load in self.remote.values()))
    @rule(data=st.data(), fails=st.booleans())
    def kv_load_lands(self, data, fails):
        """An asynchronous load lands: its blocks are cached now (``cache_blocks``).
        If it ``fails``, the request is cut back to the first bad block and
        recomputes from there (vLLM's ``recompute`` policy): nothing if that is
        block 0."""
        name = data.draw(st.sampled_from(sorted(r for r, load in self.remote.items()
                                                if not load.ready)), label="request")
        req, load = self.live[name], self.remote[name]
        computed = req.num_computed_tokens
        bs = self.config.scheduler_block_size
        if fails:
            # The first bad block is a loaded one, and recomputing from it must
            # not need a block the window already dropped.
            starts = [b * bs for b in range(load.first_loaded_block, cdiv(computed, bs))
                      if all(skipped_tokens(spec, b * bs) // spec.block_size
                             >= skipped_tokens(spec, computed) // spec.block_size
                             for spec in self.specs)]
            if starts:
                event("asynchronous KV load failed")
                req.num_computed_tokens = computed = data.draw(st.sampled_from(starts),
                                                               label="first bad token")
        self._record_written_blocks(name)
        load.ready = True
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        if computed == 0:
            self._free(name)
            self.cached_upto.pop(name, None)
            del self.remote[name]
            self.waiting.insert(0, name)
            return
        self.manager.cache_blocks(req, computed)
        self._note_cached(name, computed)
        if computed == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1   # recompute the last token

    def _finish(self, name, status):
        """With a connector, vLLM first frees what the window no longer needs."""
        if self.settings.connector and name in self.cached_upto:
            req = self.live[name]
            self.observer.positions = self._positions(name)
            self.manager.remove_skipped_blocks(name, req.num_computed_tokens,
                                               req.num_prompt_tokens)
            self.observer.positions = None
            self._check_skipped(name, req.num_computed_tokens, "remove_skipped_blocks at finish")
        super()._finish(name, status)

    # ------------------------------------------------ the manager machine's hooks

    def _run_step(self, name, num_tokens, drafts=0, accepted=0) -> bool:
        ok = super()._run_step(name, num_tokens, drafts, accepted)
        if ok and name in self.live:
            self._note_cached(name, self.live[name].num_computed_tokens)
        return ok

    def _admit(self, name, chunk) -> bool:
        ok = super()._admit(name, chunk)
        if ok and name in self.live:
            self._note_cached(name, self.live[name].num_computed_tokens)
        return ok

    def _preempt(self, name):
        self.cached_upto.pop(name, None)
        super()._preempt(name)

    def _forget(self, name):
        super()._forget(name)
        for table in (self.cached_upto, self.hit_upto, self.remote, self.chain_checked):
            table.pop(name, None)

    def _check_usage_and_leaks(self):
        if not self.remote:  # a KV load in flight holds blocks while nothing runs
            super()._check_usage_and_leaks()

    @precondition(lambda self: self.finished_since_reset)
    @rule(preempt_running_first=st.booleans())
    def reset_prefix_cache(self, preempt_running_first):
        """As the manager machine's, but a request waiting on a KV load holds
        blocks too, so the reset must fail while one does."""
        if preempt_running_first:
            self.in_flight_step_completes()
            for name in reversed(list(self.running)):
                self._preempt(name)
        self.finished_since_reset = False
        idle = not self.running and not self.in_flight and not self.remote
        assert self.manager.reset_prefix_cache() is idle, (
            "INV-RESET-1: reset_prefix_cache must succeed exactly when no block is in use")
        if idle:
            self.expected_stats["reset"] = True

    # -------------------------------------------------------------- invariants

    @invariant()
    def exact_caching_and_hashing(self):
        """INV-CACHE-1, INV-CACHE-2, INV-CHAIN-2: each request's blocks are
        cached exactly up to where vLLM caches them, hashed below that exactly
        where vLLM's mask keeps them, and its hashes are the spec's chain with
        LoRA on every block, each image on the blocks it overlaps, the salt on
        block 0."""
        alignment = self.coordinator.scheduler_block_size
        interval = self.coordinator.retention_interval
        for name, upto in self.cached_upto.items():
            tables = self.manager.get_blocks(name).blocks
            hits = self.hit_upto.get(name, [0] * len(tables))
            for g, (table, f) in enumerate(zip(tables, upto)):
                use_eagle = self.coordinator.single_type_managers[g].use_eagle
                for p, block in enumerate(table):
                    if block.is_null:
                        continue
                    hashed = block.block_hash is not None
                    kept = p < hits[g] or is_hashed_by_caching(
                        self.specs[g], p, alignment=alignment, retention_interval=interval,
                        num_prompt_tokens=self.live[name].num_prompt_tokens,
                        use_eagle=use_eagle)
                    assert hashed or p >= f or not kept \
                        or block.block_id in self.uncached_by_evict, (
                        f"INV-CACHE-1: block {block.block_id} at position {p} of {name}'s "
                        f"group {g} is full of computed tokens (vLLM has cached {f} "
                        "positions) but has no hash")
                    assert kept or not hashed, (
                        f"INV-CACHE-2: block {block.block_id} at position {p} of {name}'s "
                        f"group {g} is hashed, but vLLM's mask (retention interval "
                        f"{interval}, prompt {self.live[name].num_prompt_tokens} tokens, "
                        f"hit {hits[g]} blocks) leaves that position out")
                    assert not hashed or p < f, (
                        f"INV-CACHE-1: block {block.block_id} at position {p} of {name}'s "
                        f"group {g} is cached, but vLLM caches only the first {f} positions")
        hbs = self.config.hash_block_size
        for name, req in self.live.items():
            checked, parent = self.chain_checked.get(name, (0, None))
            for i in range(checked, len(req.block_hashes)):
                start = i * hbs
                extra = expected_extra_keys(req, start, start + hbs)
                parent = sha256((parent or kv_cache_utils.NONE_HASH,
                                 tuple(req.all_token_ids[start:start + hbs]), extra))
                assert req.block_hashes[i] == parent, (
                    f"INV-CHAIN-2: {name}'s hash of block {i} differs from the spec's "
                    f"chain with extra keys {extra}")
            self.chain_checked[name] = (len(req.block_hashes), parent)


def _paths(name, specs, watermark=0.0, spare_blocks=2, retention_interval=None,
           **settings) -> SchedulerSettings:
    model = ModelConfig(name, specs, watermark=watermark, spare_blocks=spare_blocks,
                        retention_interval=retention_interval)
    return SchedulerSettings(model, **settings)


class WindowAtBlockEdges(SchedulerPaths):
    """Window 5 over blocks of 4: a block leaves the window exactly when a
    block's worth of tokens is computed past it. Full-sequence admission with a
    watermark, chunks cut at 6 tokens, KV loads."""

    settings = _paths("window_edges", (SlidingWindowSpec(4, sliding_window=5),),
                      watermark=0.25, long_prefill_token_threshold=6,
                      full_sequence_must_fit=True, connector=True)
    config = settings.model


class ChunkedLocalPriority(SchedulerPaths):
    """Chunks of 8 over blocks of 4 next to full attention; PRIORITY preemption
    (a victim may be un-scheduled); a watermark without full-sequence admission."""

    settings = _paths("chunk_priority", (FullAttentionSpec(4),
                                         ChunkedLocalAttentionSpec(4, attention_chunk_size=8)),
                      watermark=0.2, policy="priority", connector=True, spare_blocks=0)
    config = settings.model


class HybridWindowsPriority(SchedulerPaths):
    """Full attention and two windows (6, 9); PRIORITY preemption, full-sequence
    admission without a watermark, chunks cut at 5 tokens, KV loads."""

    settings = _paths("hybrid_windows_priority",
                      (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=6),
                       SlidingWindowSpec(4, sliding_window=9)),
                      policy="priority", long_prefill_token_threshold=5,
                      full_sequence_must_fit=True, connector=True, spare_blocks=0)
    config = settings.model


class FullAttentionTwoSeqs(SchedulerPaths):
    """Full attention, ``max_num_seqs`` 2, chunks of 7, full-sequence admission
    with a watermark, KV loads."""

    settings = _paths("full_two_seqs", (FullAttentionSpec(4),), watermark=0.2,
                      max_num_seqs=2, long_prefill_token_threshold=7,
                      full_sequence_must_fit=True, connector=True)
    config = settings.model


class WindowsRetainEvery12(SchedulerPaths):
    """Full attention and two windows (4 and 7: one and two blocks per hit)
    with a retention interval of 12 tokens: each window hashes only the tails
    of every third block boundary and of the replay boundary. KV loads, chunks
    cut at 6 tokens."""

    settings = _paths("windows_retain_every_12",
                      (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=4),
                       SlidingWindowSpec(4, sliding_window=7)),
                      retention_interval=12, long_prefill_token_threshold=6,
                      connector=True, spare_blocks=1)
    config = settings.model


class WindowRetainLatestOnly(SchedulerPaths):
    """A window of 6 alone with retention interval 0: only the tail at the
    replay boundary is hashed; FCFS, KV loads."""

    settings = _paths("window_retain_latest",
                      (SlidingWindowSpec(4, sliding_window=6),),
                      retention_interval=0, connector=True)
    config = settings.model


TestWindowAtBlockEdges = WindowAtBlockEdges.TestCase
TestWindowsRetainEvery12 = WindowsRetainEvery12.TestCase
TestWindowRetainLatestOnly = WindowRetainLatestOnly.TestCase
TestChunkedLocalPriority = ChunkedLocalPriority.TestCase
TestHybridWindowsPriority = HybridWindowsPriority.TestCase
TestFullAttentionTwoSeqs = FullAttentionTwoSeqs.TestCase
