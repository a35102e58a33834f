"""The request: tokens, status and block hashes; then what generation adds.

Mirrors ``vllm/v1/request.py``, whose one ``Request`` class kvref splits in
two. ``Request`` keeps only the fields the KV cache layer reads (the core
imports nothing else from here); ``EngineRequest`` adds what the scheduler and
the runners read: sampling parameters, output tokens, draft tokens, the
connector's transfer parameters. The block hasher given at construction turns
every full block of tokens into a chained hash; ``block_hashes`` grows as
output tokens are appended:

    >>> from kvref import get_request_block_hasher, init_none_hash, sha256
    >>> init_none_hash(sha256)
    >>> req = Request("r0", list(range(40)),
    ...               block_hasher=get_request_block_hasher(16, sha256))
    >>> len(req.block_hashes)            # 40 tokens = 2 full blocks of 16
    2
    >>> req.append_output_token_ids(list(range(8)))
    >>> len(req.block_hashes)            # 48 tokens = 3 full blocks
    3
    >>> engine_req = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=2))
    >>> engine_req.append_output_token_ids(7)
    >>> engine_req.output_token_ids, engine_req.num_tokens
    ([7], 4)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvref.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """vLLM's request states, in vLLM's order (the KV layer reads a few)."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with; its name enters the block hash."""

    lora_name: str
    lora_int_id: int

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt."""

    offset: int
    length: int


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """A multimodal item: its content hash (``identifier``) and its position."""

    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"


class _ReadOnlyTokens(Sequence):
    """A view of the token list that cannot be changed behind the hasher's back."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __getitem__(self, index):
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        return f"{self._tokens!r}"


class Request:
    """One sequence: prompt plus outputs so far, and what the scheduler tracks."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        lora_request: Any = None,
        cache_salt: str | None = None,
        mm_features: list[Any] | None = None,
        skip_reading_prefix_cache: bool = False,
        max_tokens: int | None = None,
        prompt_embeds: Any = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        features = list(mm_features or [])
        offsets = [f.mm_position.offset for f in features]
        if offsets != sorted(offsets):
            # The hasher walks the items left to right, as vLLM does.
            raise ValueError(f"request {request_id!r}: mm_features must be sorted "
                             f"by mm_position.offset, got offsets {offsets}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = _ReadOnlyTokens(self._all_token_ids)
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.mm_features = features
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.max_tokens = max_tokens
        # Embeddings given in place of (or beside) the prompt's tokens, one row
        # per prompt position (a tensor). Their bytes join each prompt block's
        # hash, so equal token ids with different embeddings never share a block.
        if prompt_embeds is not None and len(prompt_embeds) != self.num_prompt_tokens:
            raise ValueError(f"request {request_id!r}: prompt_embeds has "
                             f"{len(prompt_embeds)} rows for {self.num_prompt_tokens} "
                             "prompt tokens")
        self.prompt_embeds = prompt_embeds
        # (start, end) of a block -> the hash of its embeddings, computed once.
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # BlockHash values (kvref.core.kv_cache_utils); the vocabulary does not import the core.
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append sampled tokens; hashes every block they complete."""
        if isinstance(token_ids, int):
            self._all_token_ids.append(token_ids)
        else:
            self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, "
                f"status={self.status.name})")


class EngineRequest(Request):
    """A request the scheduler runs to completion (``Request`` + generation state)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams | None = None, *,
                 eos_token_id: int | None = None,
                 block_hasher: Callable[[Request], list[bytes]] | None = None,
                 prompt_embeds: Any = None) -> None:
        self.sampling_params = sampling_params or SamplingParams()
        super().__init__(request_id, prompt_token_ids, block_hasher=block_hasher,
                         max_tokens=self.sampling_params.max_tokens,
                         prompt_embeds=prompt_embeds,
                         skip_reading_prefix_cache=bool(
                             self.sampling_params.skip_reading_prefix_cache))
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
        # Async scheduling: outputs of steps in flight when the scheduler's
        # reset_prefix_cache(reset_running_requests=True) preempted it; each is
        # dropped when it arrives (vLLM's ``async_tokens_to_discard``).
        self.async_tokens_to_discard = 0
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
