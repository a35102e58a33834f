"""Prefix-cache hit counters, as the scheduler reports them.

Mirrors ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``. Each
``get_computed_blocks`` call records one query; requests that were preempted
before are counted apart, since their hits are mostly their own old blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counts since the last ``KVCacheManager.make_prefix_cache_stats()``.

    ``queries`` and ``hits`` are in tokens; ``reset`` tells that
    ``reset_prefix_cache`` succeeded in this interval.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one lookup of ``num_tokens`` tokens that hit ``num_hits``."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


# The words every kvref command, lesson and page uses for these figures (kvref's
# own; vLLM prints only the first, as "Prefix cache hit rate"):
#
# * HIT_RATE: ``hits / queries`` of the lookups of requests never preempted, the
#   ratio of vLLM's ``vllm:prefix_cache_hits`` and ``vllm:prefix_cache_queries``
#   counters (``vllm/v1/metrics/loggers.py:1088-1093``; its log line takes the
#   same ratio over the last 1000 requests, ``vllm/v1/metrics/stats.py:42``).
#   A request waiting for blocks is looked up, and counted, each step it waits.
# * PREEMPTED_APART: the lookups of requests preempted before, which vLLM
#   counts apart (``preempted_queries``, ``preempted_hits``): each retry after
#   a preemption is a query, so they can add up to more than the prompt tokens.
# * SERVED_ONCE: prompt tokens served from the cache at each request's first
#   admission, over all prompt tokens: each request counted once.
HIT_RATE = "vLLM's hit rate"
PREEMPTED_APART = "preempted requests, counted apart"
SERVED_ONCE = "served from the cache, once per request"
RETRIES_ARE_QUERIES = "each retry after a preemption is a query"
