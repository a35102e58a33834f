"""A run that cannot make progress says so in one line instead of spinning."""

from __future__ import annotations

import pytest

from kvref.core.kv_cache_manager import KVCacheManager
from kvref.simulate import NAMED_SHAPES, TraceRequest, pool_from_tokens, simulate
from kvref.simulate import engine


def prompts(n: int, length: int) -> list[TraceRequest]:
    shared = list(range(1000, 1000 + length - 50))
    return [TraceRequest(f"r{i}", length, 4, float(i),
                         tokens=shared + [50_000 + 100 * i + j for j in range(50)])
            for i in range(n)]


def test_a_hybrid_pool_too_small_for_one_request_across_its_groups_is_refused():
    """The full-attention group alone would fit the request; the window groups
    taking blocks of the same pool make it not fit: vLLM's startup check counts
    every group, and so does the simulation (it used to run forever, admitting
    nothing)."""
    pool = pool_from_tokens(400, shape=NAMED_SHAPES["gemma-3-12b-like"])
    with pytest.raises(ValueError, match=r"holds 0\.\d\d of a request of max_model_len 2054 "
                                         r"across its groups"):
        simulate(prompts(4, 2050), pool, max_steps=50)


class NeverAdmits(KVCacheManager):
    """A pool that answers "no room" to every allocation (order arrivals: one
    request waits at a time)."""

    def allocate_slots(self, *args, **kwargs):
        return None


def test_a_scheduler_that_schedules_nothing_for_long_is_called_stalled(monkeypatch):
    monkeypatch.setattr(engine, "MAX_IDLE_STEPS", 20)
    pool = pool_from_tokens(100_000)
    with pytest.raises(ValueError, match="no token was scheduled for 20 steps in a row at "
                                         "step 20, with 1 request.s. waiting and 0 running"):
        simulate(prompts(2, 200), pool, manager_factory=NeverAdmits)
