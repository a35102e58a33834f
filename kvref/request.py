"""The request as the KV layer sees it: tokens, status, and block hashes.

Mirrors ``vllm/v1/request.py``, keeping only the fields the KV cache layer reads.
The block hasher given at construction turns every full block of tokens into a
chained hash; ``block_hashes`` grows as output tokens are appended:

    >>> from kvref import get_request_block_hasher, init_none_hash, sha256
    >>> init_none_hash(sha256)
    >>> req = Request("r0", list(range(40)),
    ...               block_hasher=get_request_block_hasher(16, sha256))
    >>> len(req.block_hashes)            # 40 tokens = 2 full blocks of 16
    2
    >>> req.append_output_token_ids(list(range(8)))
    >>> len(req.block_hashes)            # 48 tokens = 3 full blocks
    3
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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
