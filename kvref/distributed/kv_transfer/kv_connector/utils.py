"""Helpers the connectors share (mirrors ``vllm/distributed/kv_transfer/kv_connector/utils.py``).

Scheduler side: ``yield_req_data`` walks a step's requests as vLLM's helper
does, and ``RequestBlockTracker`` keeps each request's block ids from step to
step (the scheduler only sends what changed). Worker side: one block's KV,
all layers, as one tensor ``[num_layers, 2, block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["RequestBlockTracker", "extend_content_keys", "gather_blocks", "scatter_blocks",
           "yield_req_data"]


def yield_req_data(scheduler_output) -> Iterator[tuple[str, tuple[list[int], ...] | None,
                                                      bool, int]]:
    """``(req_id, new_block_ids, preempted, num_computed_tokens)`` for each scheduled
    request: new ones first, then the cached ones. ``new_block_ids`` is the whole
    table for a new request or one resumed after preemption, the blocks added
    otherwise (or None); ``preempted`` is True only for a resumed one, as in vLLM's
    helper (``utils.py:299-316``): a new request's table is whole too, but what a
    connector keeps of a request starts empty then. ``num_computed_tokens`` (kvref's
    fourth field) is the count before this step's tokens."""
    for data in scheduler_output.scheduled_new_reqs:
        yield data.req_id, data.block_ids, False, data.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, new_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens):
        yield req_id, new_ids, req_id in cached.resumed_req_ids, num_computed


class RequestBlockTracker:
    """Each scheduled request's block ids (one KV cache group), kept up to date."""

    def __init__(self) -> None:
        self.block_ids: dict[str, list[int]] = {}

    def update(self, req_id: str, new_block_ids: tuple[list[int], ...] | None,
               replace: bool) -> list[int]:
        if replace:
            self.block_ids[req_id] = list(new_block_ids[0]) if new_block_ids else []
        elif new_block_ids:
            self.block_ids.setdefault(req_id, []).extend(new_block_ids[0])
        return self.block_ids.setdefault(req_id, [])

    def forget(self, req_id: str) -> None:
        self.block_ids.pop(req_id, None)


def extend_content_keys(keys: list[str], token_ids: Sequence[int], block_size: int,
                        seed: bytes) -> list[str]:
    """Append one key per full block of ``token_ids`` not yet in ``keys``:
    ``sha256(previous key + this block's token ids)``; returns ``keys``.

    Unlike the engine's block hashes, the chain starts from ``seed``, not from
    the per-process random ``NONE_HASH``, so another process (or a later run)
    computes the same keys for the same tokens.

        >>> keys = extend_content_keys([], [1, 2, 3, 4, 5, 6], 2, b"s")
        >>> len(keys), keys[:2] == extend_content_keys([], [1, 2, 3, 4], 2, b"s")
        (3, True)
    """
    prev = bytes.fromhex(keys[-1]) if keys else hashlib.sha256(seed).digest()
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        block = ",".join(map(str, token_ids[start:start + block_size])).encode()
        prev = hashlib.sha256(prev + block).digest()
        keys.append(prev.hex())
    return keys


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]
                  ) -> torch.Tensor:
    """``[num_blocks, num_layers, 2, block_size, H, D]``: a copy of the blocks' KV.

    ``kv_caches[l]``: layer ``l``'s ``[num_blocks_in_pool, 2, block_size, H, D]``.
    """
    import torch

    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    return torch.stack([cache.index_select(0, index) for cache in kv_caches], dim=1)


def scatter_blocks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                   blocks: torch.Tensor) -> None:
    """Write ``blocks [num_blocks, num_layers, 2, block_size, H, D]`` into the pool."""
    expected = (len(block_ids), len(kv_caches), *kv_caches[0].shape[1:])
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)} do not fit {len(block_ids)} "
                         f"blocks of this pool: expected {expected}")
    import torch

    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(0, index, blocks[:, layer].to(cache.device, cache.dtype))
