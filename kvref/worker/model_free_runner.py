"""A runner with no model: the scheduler's steps with deterministic tokens.

No vLLM counterpart. It shares the real runner's request bookkeeping
(``gpu_input_batch.RunnerRequestStates``) and replaces the forward pass.

The "model" here is a hash: the next token of a request is a function of all
its tokens so far, so a request's output does not depend on batching, chunking,
prefix hits or preemption, exactly like a real model's greedy output. That makes
it a test of the scheduler alone, and the engine the visualizer and the
tutorials drive without torch::

    >>> from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
    >>> from kvref.engine.core import engine_step
    >>> from kvref.sched.scheduler import Scheduler
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

from kvref.worker.kv_connector_model_runner_mixin import execute_with_connector
from kvref.worker.gpu_input_batch import RunnerRequestStates
from kvref.spec_decode.ngram_proposer import NgramProposer
from kvref.outputs import ModelRunnerOutput
from kvref.sched.output import SchedulerOutput

__all__ = ["ModelFreeRunner"]


class ModelFreeRunner(RunnerRequestStates):
    """Emits ``crc32(tokens so far) % vocab_size`` for each request that samples.

    Args:
        vocab_size: tokens are drawn from ``range(vocab_size)``.
        drafter: an ``NgramProposer`` for speculative decoding, or None.
        async_scheduling: the scheduler is an ``AsyncScheduler`` (see
            ``RunnerRequestStates``).
        kv_connector: a KV connector's WORKER half, driven around each step as
            the real runner drives it (``execute_with_connector``); one that
            moves no tensors (the ``connector`` workload's) fits a runner with
            no KV cache.
    """

    def __init__(self, vocab_size: int = 32000, drafter: NgramProposer | None = None,
                 async_scheduling: bool = False, kv_connector=None) -> None:
        super().__init__(drafter, async_scheduling)
        self.kv_connector = kv_connector
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
        return execute_with_connector(self.kv_connector, scheduler_output, self._execute_model)

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        states = self.update_states(scheduler_output)
        drafts = self.scheduled_drafts(scheduler_output)
        sampled: list[list[int]] = []
        for state in states:
            n = scheduler_output.num_scheduled_tokens[state.req_id]
            draft = drafts.get(state.req_id, [])
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

