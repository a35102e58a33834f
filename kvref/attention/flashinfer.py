"""FlashInfer's page table: the same block table, flattened into three arrays.

Mirrors the metadata vLLM's FlashInfer backend builds
(``vllm/v1/attention/backends/flashinfer.py``: ``paged_kv_indptr``,
``paged_kv_indices``, ``paged_kv_last_page_len``). What it teaches: a block
table row and FlashInfer's CSR form are two spellings of one mapping::

    block size 4, seq_lens [6, 9], block_table [[7, 2, 0], [3, 5, 1]]
    kv_indptr        [0, 2, 5]            request r's pages: kv_indices[indptr[r]:indptr[r+1]]
    kv_indices       [7, 2, 3, 5, 1]
    kv_last_page_len [2, 1]               kv_len = page_size * (num_pages - 1) + last_page_len

Null blocks stay in ``kv_indices`` (vLLM passes them too); the window keeps the
kernel from reading them. FlashInfer's cache layout "NHD" with keys and values
in one tensor is ``[num_pages, 2, page_size, num_kv_heads, head_size]``, the
same as ``kvref.attention.paged_attention``'s.

    >>> to_flashinfer(torch.tensor([[7, 2, 0], [3, 5, 1]]), torch.tensor([6, 9]), 4)
    FlashInferPageTable(kv_indptr=tensor([0, 2, 5]), kv_indices=tensor([7, 2, 3, 5, 1]), kv_last_page_len=tensor([2, 1]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvref.attention.paged_attention import (
    AttentionOutput,
    as_ints,
    check_kv_cache,
    attend,
    visibility_mask,
    visible_key_range,
)
from kvref.math_utils import cdiv


class FlashInferPageTable(NamedTuple):
    """FlashInfer's paged-KV arrays (int32 in FlashInfer; int64 here for indexing).

    ``kv_indptr``: ``[num_reqs + 1]``; ``kv_indices``: ``[kv_indptr[-1]]``;
    ``kv_last_page_len``: ``[num_reqs]``, each in ``1..page_size``.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def to_flashinfer(block_table: torch.Tensor, seq_lens: torch.Tensor | Sequence[int],
                  block_size: int) -> FlashInferPageTable:
    """Convert a block table ``[num_reqs, max_blocks]`` to FlashInfer's form.

    Request ``r`` has ``cdiv(seq_lens[r], block_size)`` pages, the first of its
    row; the last holds ``(seq_len - 1) % block_size + 1`` tokens. O(total pages).
    """
    lens = as_ints(seq_lens)
    if block_table.dim() != 2 or block_table.shape[0] < len(lens):
        raise ValueError(f"block_table must be [num_reqs={len(lens)}, max_blocks], got "
                         f"{tuple(block_table.shape)}")
    indptr, indices, last = [0], [], []
    for r, seq_len in enumerate(lens):
        if seq_len <= 0:
            raise ValueError(f"request {r}: seq_len must be positive, got {seq_len}")
        num_pages = cdiv(seq_len, block_size)
        if num_pages > block_table.shape[1]:
            raise ValueError(f"request {r}: seq_len {seq_len} needs {num_pages} pages, "
                             f"block_table has {block_table.shape[1]} columns")
        indices.extend(block_table[r, :num_pages].tolist())
        indptr.append(indptr[-1] + num_pages)
        last.append((seq_len - 1) % block_size + 1)
    device = block_table.device
    return FlashInferPageTable(torch.tensor(indptr, dtype=torch.int64, device=device),
                               torch.tensor(indices, dtype=torch.int64, device=device),
                               torch.tensor(last, dtype=torch.int64, device=device))


def flashinfer_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, *,
                               qo_indptr: torch.Tensor | Sequence[int],
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                               kv_last_page_len: torch.Tensor, scale: float,
                               causal: bool = True, window_left: int = -1
                               ) -> AttentionOutput:
    """Attention that reads keys through FlashInfer's arrays instead of a block table.

    ``qo_indptr``: ``[num_reqs + 1]`` query offsets (``query_start_loc``).
    ``window_left``: FlashInfer's window, keys ``p - window_left .. p``
    (``-1``: none); vLLM passes ``sliding_window - 1``. Same cost as
    ``paged_attention``; used to check that both forms name the same keys.
    """
    check_kv_cache(kv_cache)
    page_size = kv_cache.shape[2]
    starts = as_ints(qo_indptr)
    indptr, last = as_ints(kv_indptr), as_ints(kv_last_page_len)
    num_tokens, num_heads, head_size = query.shape
    output = torch.zeros_like(query, device=kv_cache.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=kv_cache.device)
    window = None if window_left < 0 else window_left + 1
    for r in range(len(starts) - 1):
        pages = kv_indices[indptr[r]:indptr[r + 1]].to(kv_cache.device)
        kv_len = page_size * (len(pages) - 1) + last[r]
        q_start, q_end = starts[r], starts[r + 1]
        if q_start == q_end:
            continue
        q_pos = torch.arange(kv_len - (q_end - q_start), kv_len, device=kv_cache.device)
        lo = visible_key_range(int(q_pos[0]), kv_len, causal, window).start
        k_pos = torch.arange(lo, kv_len, device=kv_cache.device)
        page, offset = pages[k_pos // page_size], k_pos % page_size
        mask = visibility_mask(q_pos[:, None], k_pos[None, :], kv_len, causal, window, None)
        res = attend(query[q_start:q_end], kv_cache[page, 0, offset],
                     kv_cache[page, 1, offset], mask, scale)
        output[q_start:q_end] = res.output.to(query.dtype)
        lse[q_start:q_end] = res.lse.float()
    return AttentionOutput(output, lse)
