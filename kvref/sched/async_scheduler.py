"""The scheduler under async scheduling: it plans step N+1 before step N's tokens arrive.

Mirrors ``vllm/v1/core/sched/async_scheduler.py`` (v0.25.1); stepped by
``core.AsyncEngineCore`` (vLLM's ``EngineCore.step_with_batch_queue``). The
scheduler cannot wait for a decode's sampled token before scheduling the
next one, so it counts the tokens a step in flight will produce as
*output placeholders*:

* after scheduling, a request that is not mid-prefill gets
  ``num_output_placeholders += 1 + (its draft slots this step)`` and ``k``
  draft placeholders (``-1``; the runner fills in the real drafts, it keeps
  them itself, so ``update_draft_token_ids`` is never called);
* the next ``schedule()`` sees ``num_tokens_with_spec +
  num_output_placeholders - num_computed_tokens`` tokens to do, which is 1
  (+ k) for a decode whose previous token is still in flight, and skips a
  request whose in-flight steps already reach ``max_tokens``;
* when a step's tokens arrive, ``num_output_placeholders -= tokens kept``
  (rejected drafts were taken off first) and the manager caches the request's
  full blocks only up to ``num_computed_tokens - num_output_placeholders``
  (vLLM's ``async_scheduler.py:70-74``). Why that count: ``num_computed_tokens``
  counts the input positions of every step scheduled, the placeholders the
  tokens the steps in flight will sample; a step that returns tokens was
  the prompt's last chunk or a decode, so the steps behind it are decodes,
  one placeholder per input position (drafts included), and the difference
  is the positions of the steps already processed. The outputs of a step in flight have no ids yet, hence no block
  hash; its input (the token just sampled) has one but is left to the next
  ``allocate_slots``, so a block is cached a step later than in the
  synchronous loop. It is not a rule of "written KV only": ``allocate_slots``
  hashes and caches the blocks a step will fill before the step runs, in both
  loops (vLLM's ``kv_cache_manager.py:458-462``), which is safe because any
  step that can hit such a block runs after the step that writes it. A
  request preempted meanwhile is not cached.

What the KV cache manager sees differently: ``allocate_slots`` for a decode
step is called one step early (``num_computed_tokens`` already counts the
in-flight token), and ``cache_blocks`` is called from ``update_from_output``
as well as from ``allocate_slots`` (which caches only up to the tokens it
knows, ``request.num_tokens``). Lesson 10's async section walks through one
request.
"""

from __future__ import annotations

from kvref import RequestStatus
from kvref.request import EngineRequest
from kvref.sched.output import SchedulerOutput
from kvref.sched.scheduler import Scheduler

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """``Scheduler`` with output placeholders, for a loop that keeps two batches in flight.

    Same arguments as ``Scheduler``.
    """

    max_concurrent_batches = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Draft placeholders handed to each decoding request after it is scheduled.
        self._spec_token_placeholders: list[int] = [-1] * self.num_spec_tokens

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue                          # samples nothing: no placeholder
            num_drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            request.num_output_placeholders += 1 + num_drafts
            request.spec_token_ids = self._spec_token_placeholders

    def _update_request_with_output(self, request: EngineRequest, new_token_ids: list[int]
                                    ) -> tuple[list[int], bool]:
        if request.async_tokens_to_discard > 0:
            # A step in flight when reset_prefix_cache preempted it: its output is
            # stale, dropped whole (vLLM's async_scheduler.py:54-58).
            request.async_tokens_to_discard -= 1
            return [], False
        status_before = request.status
        new_token_ids, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(new_token_ids)
        assert request.num_output_placeholders >= 0, request.request_id
        if status_before == RequestStatus.RUNNING:
            # Up to the positions of the steps already processed (module docstring).
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, stopped
