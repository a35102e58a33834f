"""A runner with no model: the scheduler's steps with deterministic tokens.

No vLLM counterpart as a whole; its ``RunnerRequestStates`` is the request
bookkeeping of ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states`` and
``CachedRequestState``), which the real runner (``model_runner.py``) shares.

The "model" here is a hash: the next token of a request is a function of all
its tokens so far, so a request's output does not depend on batching, chunking,
prefix hits or preemption, exactly like a real model's greedy output. That makes
it a test of the scheduler alone, and the engine the visualizer and the
tutorials drive without torch::

    >>> from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
    >>> from kvref.engine.scheduler import Scheduler
    >>> config = KVCacheConfig(8, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    >>> manager = KVCacheManager(config, max_model_len=32, scheduler_block_size=4,
    ...                          hash_block_size=4)
    >>> scheduler = Scheduler(manager, max_num_batched_tokens=16)
    >>> req = scheduler.new_request("a", [1, 2, 3])
    >>> runner = ModelFreeRunner(vocab_size=50)
    >>> while scheduler.has_unfinished_requests():
    ...     _ = engine_step(scheduler, runner)
    >>> req.output_token_ids == runner.reference_output([1, 2, 3], 16)
    True
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from kvref.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

__all__ = ["ModelFreeRunner", "RunnerRequestState", "RunnerRequestStates", "engine_step"]


@dataclass(slots=True)
class RunnerRequestState:
    """What a runner remembers of a request between steps (vLLM's CachedRequestState)."""

    req_id: str
    token_ids: list[int]                  # prompt + outputs the runner sampled
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]      # per KV cache group, in table order
    num_computed_tokens: int
    sampling_params: object = None
    generator: object = None              # the sampler's RNG (temperature > 0)
    scheduled: bool = field(default=True)


class RunnerRequestStates:
    """The runner's copy of each request, kept in step with the scheduler's output.

    With a ``drafter`` (``NgramProposer``), requests that sampled get a draft
    for the next step, collected by ``take_draft_token_ids``.
    """

    def __init__(self, drafter=None) -> None:
        self.requests: dict[str, RunnerRequestState] = {}
        self.drafter = drafter
        self._draft_token_ids: dict[str, list[int]] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> list[RunnerRequestState]:
        """Apply one step's ``SchedulerOutput``; return the scheduled states in batch order.

        Finished requests are forgotten; preempted ones are kept (their tokens)
        until resumed, when their block table is replaced whole; running ones
        get their new blocks appended per group.
        """
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_ids = ()
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params)
            self.on_new_request(self.requests[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if req_id in cached.all_token_ids:
                state.token_ids = list(cached.all_token_ids[req_id])
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A resumed request starts from a fresh table (its old blocks were freed).
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for group_ids, added in zip(state.block_ids, new_block_ids):
                    group_ids.extend(added)
        return [self.requests[req_id] for req_id in scheduler_output.num_scheduled_tokens]

    def on_new_request(self, state: RunnerRequestState) -> None:
        """Hook for subclasses (the real runner seeds the request's sampler here)."""

    @staticmethod
    def samples(state: RunnerRequestState, num_scheduled_tokens: int) -> bool:
        """Whether this step reaches the request's last token (a cut prefill does not)."""
        return state.num_computed_tokens + num_scheduled_tokens >= len(state.token_ids)

    @staticmethod
    def scheduled_token_ids(state: RunnerRequestState, num_scheduled_tokens: int,
                            draft: list[int]) -> list[int]:
        """This step's input tokens: the request's next known tokens, then its draft."""
        start = state.num_computed_tokens
        known = state.token_ids[start:start + num_scheduled_tokens - len(draft)]
        if len(known) + len(draft) != num_scheduled_tokens or (
                draft and start + len(known) != len(state.token_ids)):
            raise RuntimeError(f"request {state.req_id!r}: {num_scheduled_tokens} tokens "
                               f"({len(draft)} drafts) scheduled from position {start}, "
                               f"but it has {len(state.token_ids)} tokens")
        return known + draft

    @staticmethod
    def accept_draft(draft: list[int], targets: list[int]) -> list[int]:
        """Rejection sampling for a draft of exact tokens: ``targets[j]`` is the
        model's token after the context plus ``draft[:j]``. Keep drafts while the
        model agrees; end with the model's own token (the first disagreement, or
        a bonus token after a fully accepted draft). Sampling ``targets`` from
        the model's distribution keeps that distribution exact."""
        out = []
        for proposed, target in zip(draft, targets):
            out.append(target)
            if target != proposed:
                return out
        out.append(targets[len(draft)])
        return out

    def finish_step(self, state: RunnerRequestState, num_scheduled_tokens: int,
                    draft: list[int], sampled: list[int]) -> None:
        """Advance the state past this step: new tokens in, rejected drafts rolled back."""
        state.token_ids.extend(sampled)
        num_rejected = len(draft) - (len(sampled) - 1) if sampled else 0
        state.num_computed_tokens += num_scheduled_tokens - num_rejected
        if sampled and self.drafter is not None:
            self._draft_token_ids[state.req_id] = self.drafter.propose(state.token_ids)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts proposed in the last step, by request id (then forgotten)."""
        drafts, self._draft_token_ids = self._draft_token_ids, {}
        return drafts


class ModelFreeRunner(RunnerRequestStates):
    """Emits ``crc32(tokens so far) % vocab_size`` for each request that samples.

    Args:
        vocab_size: tokens are drawn from ``range(vocab_size)``.
        drafter: an ``NgramProposer`` for speculative decoding, or None.
    """

    def __init__(self, vocab_size: int = 32000, drafter=None) -> None:
        super().__init__(drafter)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size

    def next_token(self, token_ids: list[int]) -> int:
        data = b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids)
        return zlib.crc32(data) % self.vocab_size

    def reference_output(self, prompt_token_ids: list[int], num_tokens: int) -> list[int]:
        """What a request generates with ``ignore_eos``: the answer without any scheduler."""
        tokens = list(prompt_token_ids)
        for _ in range(num_tokens):
            tokens.append(self.next_token(tokens))
        return tokens[len(prompt_token_ids):]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        states = self.update_states(scheduler_output)
        sampled: list[list[int]] = []
        for state in states:
            n = scheduler_output.num_scheduled_tokens[state.req_id]
            draft = scheduler_output.scheduled_spec_decode_tokens.get(state.req_id, [])
            self.scheduled_token_ids(state, n, draft)          # checks the counts
            tokens: list[int] = []
            if self.samples(state, n):
                targets = [self.next_token(state.token_ids + draft[:j])
                           for j in range(len(draft) + 1)]
                tokens = self.accept_draft(draft, targets)
            sampled.append(tokens)
            self.finish_step(state, n, draft, tokens)
        req_ids = [s.req_id for s in states]
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)


def engine_step(scheduler: Scheduler, runner) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """One engine step (vLLM's ``EngineCore.step``): schedule, run, update, take drafts."""
    scheduler_output = scheduler.schedule()
    runner_output = runner.execute_model(scheduler_output)
    scheduler.update_from_output(scheduler_output, runner_output)
    scheduler.update_draft_token_ids(runner.take_draft_token_ids())
    return scheduler_output, runner_output
