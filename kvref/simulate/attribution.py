"""Why each computed prompt token was computed: the rules of ``specs/simulate.md``.

No vLLM counterpart (vLLM counts hits, not the reasons for misses). Two parts:

* ``PrefixHistory``: every prompt or output token whose KV any request has
  computed so far, kept as chained block hashes (the hashes vLLM's cache
  uses, at the hash block size) and, per parent block, the tokens of the
  blocks that followed it, full or partial, so a shared prefix can be measured
  to the token, also inside a block.
* ``MissLedger``: at a request's first admission, the prompt is cut at five
  positions ``h <= A <= F <= S <= T <= P`` (rule S2) into the hit and five
  causes; then every prompt token the engine computes, step by step, takes the
  cause of its position the first time and ``recompute_after_preemption`` any
  later time (rule S3). So the causes always sum to the prompt tokens
  computed::

      | hit | cap | window/Mamba | evicted | inside a block | first occurrence |
      0     h     A              F         S                T                  P

  With a host tier, the tokens it loads after the device's hit, ``[h, h + e)``,
  are not computed and have no cause; the cuts start at ``h + e`` (rule S5).
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from collections.abc import Sequence

__all__ = ["CAUSES", "MissLedger", "PrefixHistory"]

# The keys of misses_by_cause, in the order of the drawing above (then the later ones).
CAUSES = ("last_token_cap", "window_or_mamba_limit", "evicted_before_reuse",
          "shared_prefix_ends_inside_block", "first_occurrence",
          "recompute_after_preemption", "prefix_caching_disabled")


def _encode(tokens: Sequence[int]) -> bytes:
    """Tokens as bytes whose common prefix, in bytes // 4, is the tokens' common prefix."""
    try:
        return array("i", tokens).tobytes()
    except OverflowError:
        raise ValueError("token ids must fit in 32 bits (0 <= id < 2**31) for the "
                         "simulation's prefix history") from None


def _common_prefix_tokens(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n                          # bytes: a[:lo] == b[:lo]; answer <= hi
    if a[:n] == b[:n]:
        return n // 4
    while hi - lo > 1:                     # a[:lo] equal, a[:hi] not
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo // 4


class PrefixHistory:
    """All token prefixes whose KV has been computed, at ``hash_block_size`` blocks.

    ``add(request, num_tokens)`` after the engine has computed ``num_tokens`` of a
    request's tokens; ``seen_prefix(request)`` -> ``(S, T)``: the longest
    prefix of whole blocks computed before (S), and the longest prefix computed
    before at all, to the token (T >= S).
    """

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.seen: set = set()                        # block hashes computed
        # parent block hash (None: the first block) -> sorted encoded children
        self.children: dict = {}

    def _add_child(self, parent, tokens: Sequence[int]) -> None:
        encoded = _encode(tokens)
        kids = self.children.get(parent)
        if kids is None:
            self.children[parent] = [encoded]
            return
        i = bisect.bisect_left(kids, encoded)
        if i == len(kids) or kids[i] != encoded:
            kids.insert(i, encoded)

    def add(self, request, num_blocks_added: int, num_tokens: int, partial: bool) -> int:
        """Record the request's computed tokens ``[0, num_tokens)``: full blocks from
        ``num_blocks_added`` on, and the partial tail if ``partial``. Returns the
        full blocks now recorded."""
        size = self.hash_block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        full = min(num_tokens // size, len(hashes))
        for k in range(num_blocks_added, full):
            if hashes[k] not in self.seen:
                self.seen.add(hashes[k])
                self._add_child(hashes[k - 1] if k else None, tokens[k * size:(k + 1) * size])
        if partial and num_tokens > full * size:
            self._add_child(hashes[full - 1] if full else None, tokens[full * size:num_tokens])
        return max(full, num_blocks_added)

    def seen_prefix(self, request, num_tokens: int) -> tuple[int, int]:
        size = self.hash_block_size
        hashes = request.block_hashes
        k = 0
        limit = min(len(hashes), num_tokens // size)
        while k < limit and hashes[k] in self.seen:
            k += 1
        start = k * size
        kids = self.children.get(hashes[k - 1] if k else None)
        if not kids or start >= num_tokens:
            return start, start
        query = _encode(request.all_token_ids[start:min(start + size, num_tokens)])
        i = bisect.bisect_left(kids, query)
        best = 0
        for j in (i - 1, i):                # the longest common prefix is a neighbour's
            if 0 <= j < len(kids):
                best = max(best, _common_prefix_tokens(query, kids[j]))
        return start, start + best


class MissLedger:
    """Attributes computed prompt tokens to causes (``specs/simulate.md``, S1-S4)."""

    def __init__(self) -> None:
        self.segments: dict[str, list[tuple[int, int, str]]] = {}
        self.computed: dict[str, list[list[int]]] = {}       # merged intervals per request
        self.hit_once: dict[str, int] = {}
        self.host_once: dict[str, int] = {}
        self.by_cause: Counter = Counter()

    def admit(self, request_id: str, num_prompt_tokens: int, cuts: tuple[int, ...],
              caching: bool, from_host: int = 0) -> None:
        """First admission: ``cuts = (h, A, F, S, T)`` (rule S2); ``from_host``
        tokens after ``h`` were loaded from a host tier, not computed (rule S5)."""
        P = num_prompt_tokens
        h, a, f, s, t = (min(x, P) for x in cuts)
        self.hit_once[request_id] = h
        self.host_once[request_id] = min(h + from_host, P) - h
        h = min(h + from_host, P)            # the causes start after the load
        a = max(a, h)
        f = max(f, a)
        s = max(s, f)
        t = max(t, s)
        if caching:
            names = ("last_token_cap", "window_or_mamba_limit", "evicted_before_reuse",
                     "shared_prefix_ends_inside_block", "first_occurrence")
        else:
            names = ("prefix_caching_disabled",) * 4 + ("first_occurrence",)
        bounds = (h, a, f, s, t, P)
        self.segments[request_id] = [(bounds[i], bounds[i + 1], names[i]) for i in range(5)
                                     if bounds[i] < bounds[i + 1]]
        self.computed[request_id] = []

    def computed_tokens(self, request_id: str, start: int, end: int) -> None:
        """The engine computed prompt positions ``[start, end)`` of the request."""
        if start >= end:
            return
        intervals = self.computed[request_id]
        # Positions computed before: recomputed now.
        again = sum(max(0, min(end, e) - max(start, s)) for s, e in intervals)
        if again:
            self.by_cause["recompute_after_preemption"] += again
        first = (end - start) - again
        if first:
            attributed = 0
            for s, e, cause in self.segments[request_id]:
                lo, hi = max(s, start), min(e, end)
                if lo < hi:
                    overlap = hi - lo - sum(max(0, min(hi, ce) - max(lo, cs))
                                            for cs, ce in intervals)
                    if overlap:
                        self.by_cause[cause] += overlap
                        attributed += overlap
            if first - attributed:
                # Before the first hit's end: served once, computed after a preemption.
                self.by_cause["recompute_after_preemption"] += first - attributed
        # Merge [start, end) into the intervals.
        merged = []
        for s, e in sorted(intervals + [[start, end]]):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        self.computed[request_id] = merged

    def finish(self, request_id: str) -> None:
        self.segments.pop(request_id, None)
        self.computed.pop(request_id, None)
