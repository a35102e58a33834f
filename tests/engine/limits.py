"""Every scheduler limit, checked on every step's output, for every request.

A limit checked only when a request is admitted misses the running requests'
later chunks, drafts and decodes. ``watch_limits`` wraps a scheduler's
``schedule`` so that each ``SchedulerOutput`` it returns is checked against
the limits the test configured (given here, not read back from the
scheduler), using only the output and the requests' token counts:

- the step's tokens: ``total_num_scheduled_tokens == sum <= budget``, each >= 1;
- ``long_prefill_token_threshold`` (> 0): no request gets more in one step;
- ``max_num_seqs``: requests scheduled, and requests running after the step;
- ``max_model_len``: a request scheduled from position ``c`` with ``n``
  tokens stays within ``c + n <= max_model_len - 1`` (the last position is
  never computed: the token sampled there ends the request), except vLLM's
  padding of a one-token admission to ``1 + k`` with placeholder drafts (-1),
  which may reach ``max_model_len``;
- the real tokens come first and exist (``c + n - drafts <= num_tokens``);
  drafts only after the last known token, at most ``k`` of them;
- without chunked prefill, a new request's remaining prompt is scheduled whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Limits:
    budget: int
    max_model_len: int
    max_num_seqs: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    steps_checked: int = 0
    chunks_checked: int = 0                 # prefill chunks not starting at position 0
    max_position_reached: int = 0           # the highest c + n seen (padding aside)

    def check(self, scheduler, output) -> None:
        scheduled = output.num_scheduled_tokens
        total = sum(scheduled.values())
        assert output.total_num_scheduled_tokens == total <= self.budget, (
            f"{total} tokens scheduled (reported {output.total_num_scheduled_tokens}), "
            f"budget {self.budget}")
        assert len(scheduled) <= self.max_num_seqs
        assert len(scheduler.running) <= self.max_num_seqs
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        assert set(starts) == set(scheduled)
        new_ids = {new.req_id for new in output.scheduled_new_reqs}
        for req_id, n in scheduled.items():
            request = scheduler.requests[req_id]
            start = starts[req_id]
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            assert n >= 1, f"{req_id}: {n} tokens scheduled"
            if self.long_prefill_token_threshold:
                assert n <= self.long_prefill_token_threshold, (
                    f"{req_id}: {n} tokens in one step from position {start}, "
                    f"long_prefill_token_threshold {self.long_prefill_token_threshold}")
            # vLLM pads a one-token admission among decodes to 1 + k with k draft
            # slots of -1 (always rejected), and lets that padding reach the last
            # position; real work and real drafts stop one short of it.
            padded = bool(drafts) and all(t == -1 for t in drafts)
            last = self.max_model_len if padded else self.max_model_len - 1
            assert start + n <= last, (
                f"{req_id}: positions {start}..{start + n - 1} scheduled, "
                f"max_model_len {self.max_model_len}")
            real = n - len(drafts)
            # Async scheduling: tokens of steps in flight are not in num_tokens yet.
            known = request.num_tokens + getattr(request, "num_output_placeholders", 0)
            assert real >= 1 and start + real <= known, (
                f"{req_id}: {real} real tokens from {start}, it has {known}")
            if drafts:
                assert start + real == known, f"{req_id}: drafts before the end"
                assert len(drafts) <= self.num_speculative_tokens
            if not self.enable_chunked_prefill and req_id in new_ids:
                assert start + n == request.num_tokens, (
                    f"{req_id}: prompt cut at {start + n} of {request.num_tokens} "
                    "without chunked prefill")
            if start > 0 and (real > 1 or start + real < request.num_tokens):
                self.chunks_checked += 1
            self.max_position_reached = max(self.max_position_reached,
                                            start + (real if padded else n))
        self.steps_checked += 1


def watch_limits(scheduler, limits: Limits) -> Limits:
    """Check ``limits`` on every output ``scheduler.schedule()`` returns from now on."""
    schedule = scheduler.schedule

    def checked_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        limits.check(scheduler, output)
        return output

    scheduler.schedule = checked_schedule
    return limits
