"""The engine's request: kvref's KV-layer ``Request`` plus what generation needs.

Mirrors the rest of ``vllm/v1/request.py``: sampling parameters, the output
tokens so far, the end-of-sequence id, and how many prompt tokens the prefix
cache served (``num_cached_tokens``, -1 until the first admission; vLLM keeps
it in the request's ``PrefillStats`` and reports it with the first output)::

    >>> from kvref import get_request_block_hasher, init_none_hash, sha256
    >>> from kvref.engine.sampling_params import SamplingParams
    >>> init_none_hash(sha256)
    >>> req = EngineRequest("r0", [1, 2, 3], SamplingParams(max_tokens=2),
    ...                     block_hasher=get_request_block_hasher(16, sha256))
    >>> req.append_output_token_ids(7)
    >>> req.output_token_ids, req.num_tokens
    ([7], 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvref import Request, RequestStatus
from kvref.engine.sampling_params import SamplingParams


class EngineRequest(Request):
    """A request the scheduler runs to completion (``kvref.Request`` + generation state)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, *,
                 eos_token_id: int | None = None,
                 block_hasher: Callable[[Request], list[bytes]] | None = None,
                 prompt_embeds: Any = None) -> None:
        self.sampling_params = sampling_params or SamplingParams()
        super().__init__(request_id, prompt_token_ids, block_hasher=block_hasher,
                         max_tokens=self.sampling_params.max_tokens,
                         prompt_embeds=prompt_embeds)
        self.eos_token_id = eos_token_id
        self.output_token_ids: list[int] = []
        # Prompt tokens the prefix cache served at the last admission before
        # the first output token (vLLM's PrefillStats: a preemption before
        # that token re-admits the request and overwrites it; after, not).
        self.num_cached_tokens = -1
        # Draft tokens proposed for the next step (n-gram speculative decoding).
        self.spec_token_ids: list[int] = []
        # Whether the last step stopped inside the known tokens (sampled nothing).
        self.is_prefill_chunk = True
        # Async scheduling: tokens of steps in flight (sampled and draft slots),
        # already counted in num_computed_tokens, not yet in the token list.
        self.num_output_placeholders = 0
        # The last step that scheduled it (the deferred-free fence; vLLM's name).
        self.last_sched_seq = 0
        # The stop token that finished it (None: EOS, a length cap, or unfinished).
        self.stop_reason: int | None = None
        # KV connector: what the request asks of it (vLLM reads the same dict from
        # sampling_params.extra_args["kv_transfer_params"]), and what it said back.
        extra = self.sampling_params.extra_args or {}
        self.kv_transfer_params: dict | None = (
            dict(extra["kv_transfer_params"]) if extra.get("kv_transfer_params") else None)
        self.kv_transfer_params_out: dict | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.output_token_ids.extend(ids)
        super().append_output_token_ids(ids)

    def get_finished_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"abort"`` (vLLM's names), None while unfinished."""
        if self.status == RequestStatus.FINISHED_STOPPED:
            return "stop"
        if self.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return "length"
        if self.status == RequestStatus.FINISHED_ABORTED:
            return "abort"
        if self.status == RequestStatus.FINISHED_ERROR:
            return "error"
        return None


def check_stop(request: EngineRequest, max_model_len: int) -> bool:
    """Set a finished status and return True if the last token ends the request.

    Mirrors ``vllm/v1/core/sched/utils.py::check_stop``, in its order: nothing
    stops before ``min_tokens``; then EOS (unless ``ignore_eos``) and stop
    tokens finish as ``FINISHED_STOPPED``; then a full context or
    ``max_tokens`` finishes as ``FINISHED_LENGTH_CAPPED``.
    """
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and request.eos_token_id is not None \
            and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def prompt_embeds_from_rows(rows: list[list[float]], dtype: str) -> Any:
    """Prompt embeddings ``[num_prompt_tokens, hidden_size]`` from plain rows, as
    a tensor of the dtype named ``dtype`` (``"float32"``). Lives on the engine
    side because it needs torch; the KV layer only hashes the tensor's bytes.
    ``ValueError`` if ``dtype`` names no torch dtype."""
    import torch

    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"prompt_embeds dtype {dtype!r} is not a torch dtype name")
    return torch.tensor(rows, dtype=torch_dtype)
