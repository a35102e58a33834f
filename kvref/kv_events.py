"""Events the block pool emits when the prefix-cache index changes.

Mirrors the three cache events of ``vllm/distributed/kv_events.py``. A consumer
that applies them in order (store on ``BlockStored``, drop on ``BlockRemoved``,
empty on ``AllBlocksCleared``) rebuilds the set of cached hashes per group
without looking inside the pool; that is how external KV routers follow vLLM.

Hashes in events are ``ExternalBlockHash`` values: by default the last 8 bytes of
the 32-byte block hash as an int (see ``kv_cache_utils.maybe_convert_block_hash``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass
class BlockStored:
    """Consecutive full blocks of one request became cached in one group.

    ``block_hashes`` has one entry per stored block; ``token_ids`` spans every
    block in the range, including null or masked-out ones that were skipped.
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` are filled in by
    ``KVCacheManager.take_events`` (the pool knows nothing of specs).
    """

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass
class BlockRemoved:
    """Cached blocks lost their hash (evicted for reuse, or evicted on request)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
