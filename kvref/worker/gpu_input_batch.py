"""The runner's copy of each request, kept in step with the scheduler.

Mirrors ``CachedRequestState`` of ``vllm/v1/worker/gpu_input_batch.py`` and
the request bookkeeping of ``GPUModelRunner._update_states`` in
``vllm/v1/worker/gpu_model_runner.py``. Both kvref runners
(``gpu_model_runner.GPUModelRunner`` and ``model_free_runner.ModelFreeRunner``)
derive from ``RunnerRequestStates``: it applies each ``SchedulerOutput`` to the
states (``update_states``), says which tokens a step feeds in and whether it
samples, accepts or rejects draft tokens, and advances a state past the step.

vLLM also keeps a persistent ``InputBatch`` (one row per running request,
updated in place). kvref has none: the model runner gives the scheduled
requests table rows in the scheduler's order every step, appends only the new
block ids to a row that holds the same request as the step before, and
rewrites any other row from these states (``GPUModelRunner._fill_row``). No
torch here: the model-free runner runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.sampling_params import SamplingParams
from kvref.sched.output import SchedulerOutput

__all__ = ["CachedRequestState", "RunnerRequestStates"]


@dataclass(slots=True)
class CachedRequestState:
    """What a runner remembers of a request between steps."""

    req_id: str
    token_ids: list[int]                  # prompt + outputs the runner sampled
    num_prompt_tokens: int
    block_ids: tuple[list[int], ...]      # per KV cache group, in table order
    num_computed_tokens: int
    sampling_params: SamplingParams | None = None
    generator: object = None              # the sampler's torch.Generator (temperature > 0)


class RunnerRequestStates:
    """The runner's copy of each request, kept in step with the scheduler's output.

    With a ``drafter`` (``NgramProposer``), requests that sampled get a draft
    for the next step, collected by ``take_draft_token_ids``.

    With ``async_scheduling`` the scheduler plans a step before the previous
    one's tokens are back, so what it sends is ahead of the runner: its
    ``num_computed_tokens`` for a running request counts draft slots that may
    yet be rejected, and its draft tokens are ``-1`` placeholders. The runner
    then keeps its own count (it knows how many drafts the last step
    accepted) and fills the placeholders with the draft it proposed after the
    request's latest sample (cut to the slots scheduled, the rest ``-1``,
    which no model token equals). vLLM's GPU runner does the same on device.
    (vLLM runs async scheduling with the ``ngram_gpu`` proposer, not the CPU
    ``ngram`` one; its worker also trims the slots it has no draft for from the
    step, ``update_scheduler_for_invalid_drafts``, where kvref lets the ``-1``
    slots be rejected. The recorded async traces drive vLLM's AsyncScheduler
    with a worker that fills the slots as kvref does, so they check the
    scheduler under this worker, not under ngram_gpu's trimming.)
    """

    def __init__(self, drafter: NgramProposer | None = None,
                 async_scheduling: bool = False) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.drafter = drafter
        self.async_scheduling = async_scheduling
        self._draft_token_ids: dict[str, list[int]] = {}
        self._latest_drafts: dict[str, list[int]] = {}      # async: kept by the runner

    def update_states(self, scheduler_output: SchedulerOutput) -> list[CachedRequestState]:
        """Apply one step's ``SchedulerOutput``; return the scheduled states in batch order.

        Finished requests are forgotten; preempted ones are kept (their tokens)
        until resumed, when their block table is replaced whole; running ones
        get their new blocks appended per group.
        """
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._latest_drafts.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in self.requests:
                self.requests[req_id].block_ids = ()
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=list(new.prompt_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params)
            self.on_new_request(self.requests[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            num_computed = cached.num_computed_tokens[i]
            if self.async_scheduling and req_id not in cached.resumed_req_ids:
                # The scheduler's count includes in-flight drafts; ours is exact.
                if num_computed < state.num_computed_tokens:
                    raise RuntimeError(f"request {req_id!r}: the scheduler is at "
                                       f"{num_computed} tokens, the runner at "
                                       f"{state.num_computed_tokens}")
            else:
                state.num_computed_tokens = num_computed
            if req_id in cached.all_token_ids:
                state.token_ids = list(cached.all_token_ids[req_id])
            if cached.num_output_tokens and not self.async_scheduling:
                # A token sampled over a failed KV load was dropped by the scheduler.
                # (Async: the runner's tokens run ahead of the scheduler's by design.)
                del state.token_ids[state.num_prompt_tokens + cached.num_output_tokens[i]:]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A resumed request starts from a fresh table (its old blocks were freed).
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for group_ids, added in zip(state.block_ids, new_block_ids):
                    group_ids.extend(added)
        return [self.requests[req_id] for req_id in scheduler_output.num_scheduled_tokens]

    def scheduled_drafts(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """The draft tokens this step feeds in, by request: the scheduled ones, or
        under async scheduling the runner's own in place of the placeholders."""
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if not self.async_scheduling:
            return drafts
        filled = {}
        for req_id, slots in drafts.items():
            mine = self._latest_drafts.get(req_id, [])[:len(slots)]
            filled[req_id] = mine + [-1] * (len(slots) - len(mine))
        return filled

    def on_new_request(self, state: CachedRequestState) -> None:
        """Hook for subclasses (the real runner seeds the request's sampler here)."""

    @staticmethod
    def samples(state: CachedRequestState, num_scheduled_tokens: int) -> bool:
        """Whether this step reaches the request's last token (a cut prefill does not)."""
        return state.num_computed_tokens + num_scheduled_tokens >= len(state.token_ids)

    @staticmethod
    def scheduled_token_ids(state: CachedRequestState, num_scheduled_tokens: int,
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

    def finish_step(self, state: CachedRequestState, num_scheduled_tokens: int,
                    draft: list[int], sampled: list[int]) -> None:
        """Advance the state past this step: new tokens in, rejected drafts rolled back."""
        state.token_ids.extend(sampled)
        num_rejected = len(draft) - (len(sampled) - 1) if sampled else 0
        state.num_computed_tokens += num_scheduled_tokens - num_rejected
        if sampled and self.drafter is not None:
            draft = self.drafter.propose(state.token_ids)
            if self.async_scheduling:
                self._latest_drafts[state.req_id] = draft
            else:
                self._draft_token_ids[state.req_id] = draft

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """The drafts proposed in the last step, by request id (then forgotten).
        Empty under async scheduling: the runner keeps its drafts."""
        drafts, self._draft_token_ids = self._draft_token_ids, {}
        return drafts
