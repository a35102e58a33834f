"""What the runner hands back each step: ``ModelRunnerOutput``.

Mirrors ``ModelRunnerOutput`` of ``vllm/v1/outputs.py``, keeping the fields
kvref's scheduler reads, plus ``logits`` (kvref's, for the tests that compare
with ``transformers``). The runners build it; ``Scheduler.update_from_output``
consumes it. ``Logprob`` is ``vllm/logprobs.py``'s, for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Logprob", "ModelRunnerOutput"]


@dataclass(slots=True)
class Logprob:
    """One token's log probability and its rank in the vocabulary (1: the most
    likely), as vLLM's ``vllm/logprobs.py:13-24``; ``decoded_token`` with a tokenizer."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's sampled tokens, per scheduled request.

    ``sampled_token_ids[req_id_to_index[r]]`` is ``[token]`` for a request whose
    scheduled tokens reached its last token, ``[]`` for a cut prefill chunk;
    with draft tokens, the accepted drafts and then one token of the model's.
    ``logits`` (optional) maps a request id to the ``[num_sampled, vocab]``
    logits its sampled tokens were drawn from.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logits: dict[str, object] = field(default_factory=dict)
    # Requests whose prompt was all computed this step, with prompt_logprobs asked
    # for: one ``{token_id: Logprob}`` per prompt position after the first.
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # With a KV connector: finished transfers and failed loads (``KVConnectorOutput``).
    kv_connector_output: object | None = None
