"""Hand-narrated walk-throughs: the stories ``kvref demo`` tells, checked as it tells them.

No vLLM counterpart. A walk-through drives the manager directly, one small
scheduler move per step, and says what happened. Every number in a narration
is read from what the manager answered, and every claim a sentence makes
("block 3 is cached but recomputed", "the window group holds null blocks") is a
``Claim`` checked against the manager right then; ``record`` raises if one is
false, so a change in the core cannot make the demo lie::

    walk = PrefixCachingWalkthrough()
    trace = walk.record()               # a kvtrace/1 trace, narration included
    walk.claims[4]                      # [(claim, True), ...] of step 4

* ``prefix-caching`` (the default demo): hits, shared blocks, the
  ``num_tokens - 1`` cap (a whole block recomputed), the free queue's order,
  eviction, ``reset_prefix_cache``.
* ``sliding-window``: a full-attention + sliding-window model: null blocks
  appear as the window slides, a hybrid hit, and the fixed point that shortens
  it when a window block is gone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvref.core.kv_cache_utils import get_request_block_hasher
from kvref.core.single_type_kv_cache_manager import SlidingWindowManager
from kvref.hashing import sha256
from kvref.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvref.math_utils import cdiv
from kvref.request import Request, RequestStatus
from kvref.verify.trace_record import RecordingKVCacheManager, make_header


class NarrationError(AssertionError):
    """A walk-through said something the manager state contradicts."""


class Walkthrough(ABC):
    """Steps of (action, narration); claims checked after each action."""

    name = "walkthrough"
    title = ""

    def __init__(self) -> None:
        self.claims: list[list[tuple[str, bool]]] = []
        self.narration: dict[int, str] = {}

    # -- what subclasses define ---------------------------------------------------

    @abstractmethod
    def config(self) -> tuple[KVCacheConfig, int, int]:
        """(config, block size, max_model_len)."""

    @abstractmethod
    def steps(self) -> list[Callable[[], str]]:
        """One function per step: it acts, states claims, returns the narration."""

    # -- helpers for the steps ------------------------------------------------------

    def claim(self, text: str, holds: bool) -> None:
        self.claims[-1].append((text, bool(holds)))

    def arrive(self, rid: str, tokens: list[int]) -> tuple[list, int, list]:
        """A new request is admitted whole: lookup, allocate, RUNNING.
        Returns (hit blocks per group, hit tokens, new blocks per group)."""
        req = Request(rid, tokens, block_hasher=self.hasher)
        self.reqs[rid] = req
        hit, num_hit = self.m.get_computed_blocks(req)
        new = self.m.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit)
        if new is None:
            raise NarrationError(f"{self.name}: {rid} did not fit; the scenario is wrong")
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        return [list(g) for g in hit.get_block_ids()], num_hit, \
            [list(g) for g in new.get_block_ids()]

    def decode(self, rid: str, token: int) -> list:
        req = self.reqs[rid]
        req.append_output_token_ids(token)
        new = self.m.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        return [list(g) for g in new.get_block_ids()]

    def finish(self, rid: str) -> None:
        req = self.reqs[rid]
        req.status = RequestStatus.FINISHED_STOPPED
        self.m.free(req)

    def blocks_of(self, rid: str) -> tuple[list[int], ...]:
        """A request's block ids, read without recording a query."""
        return self.m.manager.get_block_ids(rid)

    def pool(self):
        return self.m.manager.block_pool

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.pool().free_block_queue.get_all_free_blocks()]

    def is_cached(self, block_id: int) -> bool:
        return self.pool().blocks[block_id].block_hash is not None

    # -- running ------------------------------------------------------------------

    def record(self, max_steps: int | None = None, seed: str = "0",
               on_step: Callable[[int], None] | None = None) -> dict:
        config, block_size, max_model_len = self.config()
        header = make_header(config, max_model_len=max_model_len,
                             scheduler_block_size=block_size, hash_block_size=block_size,
                             none_hash_seed=seed)
        self.m = RecordingKVCacheManager(header)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.reqs: dict[str, Request] = {}
        self.claims, self.narration = [], {}
        for k, step in enumerate(self.steps()):
            if max_steps is not None and k >= max_steps:
                break
            self.claims.append([])
            self.m.new_step_starts()
            self.narration[k] = step()
            self.m.sync_requests()
            self.m.take_events()
            false = [text for text, holds in self.claims[-1] if not holds]
            if false:
                raise NarrationError(f"{self.name} step {k}: the narration claims "
                                     f"{false[0]!r}, which the manager state contradicts")
            if on_step:
                on_step(k)
        return self.m.finish_trace(name=f"kvref-{self.name}",
                                   config_class=f"kvref-walkthrough-{self.name}",
                                   generator={"workload": self.name, "description": self.title},
                                   narration=self.narration)


def _ids(ids: Sequence[int]) -> str:
    """``[0, 0, 9]`` -> ``"∅, ∅, 9"`` (block 0 is the null block)."""
    return ", ".join("∅" if i == 0 else str(i) for i in ids)


class PrefixCachingWalkthrough(Walkthrough):
    """Prefix caching on a 12-block pool (the null block and 11 to allocate), 4 tokens per block."""

    name = "prefix-caching"
    title = ("prefix caching on a 12-block pool (block 0 is the null block, 11 to allocate), "
             "4 tokens per block")
    SYSTEM = [101, 102, 103, 104, 105, 106, 107, 108]          # 2 blocks

    def config(self) -> tuple[KVCacheConfig, int, int]:
        return (KVCacheConfig(12, [KVCacheGroupSpec(["attn"], FullAttentionSpec(4))]), 4, 64)

    def steps(self) -> list[Callable[[], str]]:
        s = self.SYSTEM
        return [lambda: self._a_arrives(s + [1, 2, 3]),
                lambda: self._a_decodes(),
                lambda: self._b_shares(s + [9, 9, 9, 9, 9]),
                lambda: self._a_finishes(),
                lambda: self._partial_block(s + [1, 2, 3, 4, 5]),
                lambda: self._the_cap(s + [1, 2, 3, 4]),
                lambda: self._b_finishes(),
                lambda: self._eviction(),
                lambda: self._reset()]

    def _a_arrives(self, tokens: list[int]):
        hit, num_hit, new = self.arrive("A", tokens)
        cached = [b for b in new[0] if self.is_cached(b)]
        self.claim("nothing hits on an empty cache", num_hit == 0)
        self.claim("only the full blocks are cached", len(cached) == len(tokens) // 4)
        self.claim("the partial last block has no hash", not self.is_cached(new[0][-1]))
        return (f"Request A arrives: an 8-token system prompt and 3 tokens of its own "
                f"({len(tokens)} tokens). Nothing is cached yet: it gets blocks "
                f"{_ids(new[0])}. Its {len(cached)} full blocks ({_ids(cached)}) are cached "
                f"(◉); the last block holds only {len(tokens) % 4} tokens, so it has no "
                "hash and nobody can hit it yet.")

    def _a_decodes(self):
        before = {b for b in self.blocks_of("A")[0] if self.is_cached(b)}
        new = self.decode("A", 4)
        last = self.blocks_of("A")[0][-1]
        self.claim("the decode fits in the last block", new[0] == [])
        self.claim("the last block became cached", self.is_cached(last) and last not in before)
        return (f"A decodes one token. It fits in block {last}, which is now full: "
                f"block {last} gets its hash and is cached too.")

    def _b_shares(self, tokens: list[int]):
        hit, num_hit, new = self.arrive("B", tokens)
        refs = [self.pool().blocks[b].ref_cnt for b in hit[0]]
        self.claim("B hits the system prompt", num_hit == len(self.SYSTEM))
        self.claim("the hit blocks are shared", all(r == 2 for r in refs))
        return (f"Request B arrives with the same system prompt: blocks {_ids(hit[0])} "
                f"are a prefix hit ({num_hit} tokens). B shares them with A (ref count "
                f"{refs[0]}) and gets {len(new[0])} new block{'s' if len(new[0]) != 1 else ''} "
                f"({_ids(new[0])}) for the rest.")

    def _a_finishes(self):
        a_blocks = self.blocks_of("A")[0]
        self.finish("A")
        private = [b for b in a_blocks if self.pool().blocks[b].ref_cnt == 0]
        shared = [b for b in a_blocks if self.pool().blocks[b].ref_cnt > 0]
        queue = self.free_queue()
        self.claim("A's private blocks are free and still cached",
                   private and all(self.is_cached(b) for b in private))
        self.claim("they sit at the tail of the free queue", queue[-len(private):] == private)
        self.claim("the shared prefix is still held by B",
                   all(self.pool().blocks[b].ref_cnt == 1 for b in shared))
        return (f"A finishes. Its own block {_ids(private)} is free but stays cached (○) at "
                f"the tail of the free queue: evicted last, hittable until then. The shared "
                f"prefix ({_ids(shared)}) is still held by B.")

    def _partial_block(self, tokens: list[int]):
        hit, num_hit, new = self.arrive("C", tokens)
        full_blocks = len(tokens) // 4
        self.claim("C hits every full block of its prompt", num_hit == full_blocks * 4)
        self.claim("its last block is partial and has no hash",
                   len(tokens) % 4 != 0 and len(self.reqs["C"].block_hashes) == full_blocks)
        self.claim("the cap would have allowed this hit", num_hit <= len(tokens) - 1)
        return (f"Request C repeats A's conversation and adds one token ({len(tokens)} "
                f"tokens). It hits all {len(hit[0])} full blocks ({num_hit} tokens, "
                f"blocks {_ids(hit[0])}). Its last token sits alone in a partial block, "
                "which is never cached, so it is computed anyway; the num_tokens - 1 cap "
                f"({len(tokens) - 1}) plays no role here.")

    def _the_cap(self, tokens: list[int]):
        req_blocks = len(tokens) // 4
        hit, num_hit, new = self.arrive("D", tokens)
        c_blocks = self.blocks_of("C")[0]
        self.claim("the prompt is a whole number of blocks", len(tokens) % 4 == 0)
        self.claim("every block of the prompt is cached", all(self.is_cached(b)
                                                              for b in c_blocks[:req_blocks]))
        self.claim("the hit is one whole block short", num_hit == len(tokens) - 4)
        return (f"Request D is exactly A's {len(tokens)} tokens: {req_blocks} whole blocks, "
                f"all cached. Yet it hits only {num_hit} tokens ({_ids(hit[0])}): a hit may "
                f"cover at most num_tokens - 1 = {len(tokens) - 1} tokens (the last token "
                "is computed to get its logits), and hits come in whole blocks, so the whole "
                f"last block is recomputed into a new block ({_ids(new[0])}), not just one "
                "token.")

    def _b_finishes(self):
        b_blocks = self.blocks_of("B")[0]
        self.finish("B")
        queue = self.free_queue()
        freed = [b for b in b_blocks if self.pool().blocks[b].ref_cnt == 0]
        unhashed = [b for b in freed if not self.is_cached(b)]
        hashed = [b for b in freed if self.is_cached(b)]
        self.claim("B's partial block has no hash", len(unhashed) == 1)
        self.claim("it goes to the front of the queue", queue[0] == unhashed[0])
        self.claim("B's cached block goes to the back", hashed and queue[-1] == hashed[0])
        return (f"B finishes. Its partial block {unhashed[0]} has no hash: nobody can hit "
                f"it, so it goes to the FRONT of the free queue (reused first). Its cached "
                f"block {_ids(hashed)} goes to the BACK. Free queue now: {_ids(queue)}.")

    def _eviction(self):
        queue = self.free_queue()
        old_hash = {b: self.pool().blocks[b].block_hash for b in queue if self.is_cached(b)}
        tokens = list(range(500, 500 + 4 * len(queue) - 1))
        hit, num_hit, new = self.arrive("E", tokens)
        evicted = [b for b in new[0] if b in old_hash]
        self.claim("E takes the free blocks in queue order", new[0] == queue)
        self.claim("some of them were cached", evicted)
        # E's own full blocks get cached right away: an evicted block may hold a new hash.
        self.claim("the cached blocks among them lost their old hashes",
                   all(self.pool().blocks[b].block_hash != old_hash[b] for b in evicted))
        self.claim("the unhashed ones came first", all(
            not old_hash.get(b) for b in new[0][:len(new[0]) - len(evicted)]))
        return (f"Request E needs {len(new[0])} blocks: the whole free queue, taken from "
                f"the head: {_ids(new[0])}. The unhashed ones go first; the cached ones "
                f"({_ids(evicted)}) come last, least recently freed first, and are evicted: "
                "their hashes are dropped and later requests can no longer hit them.")

    def _reset(self):
        def hashed():
            return [b.block_id for b in self.pool().blocks if b.block_hash is not None]

        cached_before = hashed()
        refused = self.m.reset_prefix_cache()
        self.claim("reset is refused while blocks are in use", refused is False)
        self.claim("a refused reset changes nothing", hashed() == cached_before)
        for rid in ("C", "D", "E"):
            self.finish(rid)
        queue = self.free_queue()
        done = self.m.reset_prefix_cache()
        self.claim("reset succeeds once all are free", done is True and not hashed())
        self.claim("the free queue keeps its order", self.free_queue() == queue)
        return ("reset_prefix_cache while C, D and E hold blocks returns False and changes "
                "nothing. Once they finish it returns True: every cached prefix is "
                "forgotten (no ○ left), the free queue keeps its order.")


class SlidingWindowWalkthrough(Walkthrough):
    """A full-attention + sliding-window (window 8) model on one pool, 4 tokens per block."""

    name = "sliding-window"
    title = "full attention + sliding window 8, 4 tokens per block"
    SYSTEM = list(range(200, 216))                                   # 4 blocks

    def config(self) -> tuple[KVCacheConfig, int, int]:
        return (KVCacheConfig(40, [KVCacheGroupSpec(["full"], FullAttentionSpec(4)),
                                   KVCacheGroupSpec(["swa"], SlidingWindowSpec(4, 8))]), 4, 64)

    def steps(self) -> list[Callable[[], str]]:
        s = self.SYSTEM
        return [lambda: self._a_arrives(s + [1, 2, 3, 4, 5, 6]),
                lambda: self._window_slides(),
                lambda: self._hybrid_hit(s + [7, 7, 7, 7, 7, 7]),
                lambda: self._evicted_window_blocks(),
                lambda: self._fixed_point(s + [8, 8, 8, 8, 8, 8]),
                lambda: self._all_finish()]

    def _a_arrives(self, tokens: list[int]):
        hit, num_hit, new = self.arrive("A", tokens)
        self.claim("both groups allocate the same number of blocks",
                   len(new[0]) == len(new[1]) == cdiv(len(tokens), 4))
        return (f"Request A ({len(tokens)} tokens) arrives. Each group gets its own "
                f"{len(new[0])} blocks from the one pool: full attention {_ids(new[0])}, "
                f"sliding window {_ids(new[1])}.")

    def _window_slides(self):
        window_before = self.blocks_of("A")[1]
        self.decode("A", 9)
        full, window = self.blocks_of("A")
        nulls = [i for i, b in enumerate(window) if b == 0]
        freed = [window_before[i] for i in nulls]
        self.claim("the window table starts with null blocks", nulls == list(range(len(nulls))))
        computed = self.reqs["A"].num_computed_tokens - 1
        self.claim("as many as the skipped tokens fill",
                   len(nulls) == (computed - 8 + 1) // 4 > 0)
        self.claim("the full table has no null block", 0 not in full)
        self.claim("the dropped window blocks are free but cached",
                   all(self.pool().blocks[b].ref_cnt == 0 and self.is_cached(b)
                       for b in freed))
        return (f"A decodes a token. The next token reads only the last 8 tokens, so the "
                f"first {computed - 8 + 1} of its {computed} computed tokens are never read "
                f"again: the window group replaces its first {len(nulls)} blocks with the "
                f"null block ∅ and frees {_ids(freed)} (free, still cached). Full attention "
                "keeps all its blocks.")

    def _hybrid_hit(self, tokens: list[int]):
        a_window = self.blocks_of("A")[1]
        hit, num_hit, new = self.arrive("B", tokens)
        window_hit = hit[1]
        real = [b for b in window_hit if b != 0]
        need = SlidingWindowManager.num_contiguous_blocks_for_hit(8, 4, use_eagle=False)
        self.claim("the hit covers the system prompt", num_hit == len(self.SYSTEM))
        self.claim("the window hit is nulls then the last blocks",
                   window_hit[:len(window_hit) - need] == [0] * (len(window_hit) - need)
                   and len(real) == need)
        reused = [b for b in real if b not in a_window]
        self.claim("one of them was free and is reused", len(reused) == 1)
        return (f"Request B shares the {len(self.SYSTEM)}-token system prompt and hits "
                f"{num_hit} tokens. Full attention reuses all of {_ids(hit[0])}; the window "
                f"group needs only the last {need} blocks (its window reads 7 earlier tokens), "
                f"so its hit is [{_ids(window_hit)}]: ∅ stands for what it never reads. Block "
                f"{reused[0]}, a window block A had freed (still cached), comes back into use.")

    def _evicted_window_blocks(self):
        b_full, b_window = self.blocks_of("B")
        victims = {b for b in b_window[2:4] if b != 0}
        self.m.evict_blocks(victims)
        self.claim("those window blocks have no hash now",
                   all(not self.is_cached(b) for b in victims))
        self.claim("the full-attention prefix is still cached",
                   all(self.is_cached(b) for b in b_full[:4]))
        return (f"Suppose window blocks {_ids(sorted(victims))} (tokens 8-15 of the system "
                "prompt) lose their hashes (here with evict_blocks; under memory pressure, "
                "an allocation would reuse them). B keeps using them; they just cannot be "
                "hit any more. The full-attention blocks of the prefix are all still cached.")

    def _fixed_point(self, tokens: list[int]):
        req = Request("probe", tokens, block_hasher=self.hasher)
        coordinator = self.m.manager.coordinator
        _, per_group = coordinator.find_longest_cache_hit_per_group(req.block_hashes,
                                                                    len(tokens) - 1)
        hit, num_hit, new = self.arrive("C", tokens)
        self.claim("full attention alone could hit the whole system prompt",
                   per_group[0] == len(self.SYSTEM))
        self.claim("the window alone cannot", per_group[1] < per_group[0])
        self.claim("the agreed hit is what every group accepts",
                   num_hit == min(per_group) and num_hit < len(self.SYSTEM))
        return (f"Request C has the same system prompt. Full attention alone could hit "
                f"{per_group[0]} tokens, but a window hit must end right after 2 cached window "
                f"blocks in a row, and blocks for tokens 8-15 are gone. The longest such run "
                f"ends at token {per_group[1]}, so every group agrees on {num_hit} tokens: the "
                f"full-attention hit is cut to {_ids(hit[0])} and the rest is recomputed.")

    def _all_finish(self):
        for rid in ("A", "B", "C"):
            self.finish(rid)
        in_use = [b.block_id for b in self.pool().blocks if b.ref_cnt > 0 and not b.is_null]
        queue = self.free_queue()
        self.claim("every block is free again", not in_use)
        self.claim("the null block is not in the free queue", 0 not in queue)
        self.claim("cached blocks are at the back", self.is_cached(queue[-1]))
        return ("A, B and C finish. The null block was never a real allocation, so only "
                "real blocks return to the free queue, cached ones at the back.")


WALKTHROUGHS: dict[str, type[Walkthrough]] = {
    PrefixCachingWalkthrough.name: PrefixCachingWalkthrough,
    SlidingWindowWalkthrough.name: SlidingWindowWalkthrough,
}
