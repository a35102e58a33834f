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
