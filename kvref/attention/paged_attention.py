"""Paged attention, written as the math: keys and values read through a block table.

Mirrors ``vllm/v1/attention/backends/flash_attn.py`` (the packed-batch metadata
and what the kernel computes) and the ``reshape_and_cache_flash`` cache write
(``csrc/cache_kernels.cu``). What it teaches: attention over a paged cache is
ordinary softmax attention; only the *address* of each key changes.

The KV cache of one layer, FlashAttention's layout in vLLM::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_size]
                           ^ 0 = keys, 1 = values
    token at position pos of a request lives in
        slot = block_table[pos // block_size] * block_size + pos % block_size
    and kv_cache[:, 0].reshape(-1, num_kv_heads, head_size)[slot] is its key.

A packed batch: the queries of all requests back to back. Each request has
``context_len`` tokens already in the cache and ``query_len`` new ones (a
prefill chunk, or 1 for a decode step); its queries are its last positions::

    request r:  |<----- context_len ----->|<- query_len ->|
                |<--------------- seq_len --------------->|
    query rows: query_start_loc[r] : query_start_loc[r + 1]

Which keys a query at position ``p`` sees (``k`` a key position, ``k < seq_len``):

    causal               k <= p
    sliding_window=W     p - W + 1 <= k              (W keys, itself included)
    attention_chunk=C    k // C == p // C            (its own chunk only)

The reference reads, per request, exactly the slots of the positions some query
of it may see (``visible_key_range``): slots of null blocks, of blocks
left of a window or chunk, and of other requests are never touched, which the
tests check by filling them with NaN.

    >>> kv_cache = torch.zeros(4, 2, 2, 1, 1)           # 4 blocks of 2 slots
    >>> values = torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1)
    >>> write_kv(kv_cache, torch.zeros(3, 1, 1), values,
    ...          torch.tensor([2, 3, 6]))                # positions 0,1 -> block 1; 2 -> block 3
    >>> out = paged_attention(torch.ones(1, 1, 1), kv_cache,   # the decode of position 2
    ...     query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([3]),
    ...     block_table=torch.tensor([[1, 3]]), scale=1.0)
    >>> round(out.item(), 4)                             # equal scores: the mean of 1, 2, 3
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvref.math_utils import cdiv


def make_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  fill: float = 0.0) -> torch.Tensor:
    """A zero (or ``fill``) KV cache of one layer,
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]``."""
    return torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), fill,
                      dtype=dtype, device=device)


# The slot of a token that belongs to no request (a padded batch): write_kv skips it.
# (vLLM keeps it in vllm/v1/attention/backends/utils.py; the worker imports it from here.)
PAD_SLOT_ID = -1


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """``ValueError`` unless ``kv_cache`` has the paged layout
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]``."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError("kv_cache must be [num_blocks, 2, block_size, num_kv_heads, "
                         f"head_size], got shape {tuple(kv_cache.shape)}")


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each token's key and value in its slot (vLLM's ``reshape_and_cache_flash``).

    Args:
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``, written in place.
        key, value: ``[num_tokens, num_kv_heads, head_size]``.
        slot_mapping: ``[n]`` int, ``n <= num_tokens``: token ``i`` goes to slot
            ``slot_mapping[i]``; ``PAD_SLOT_ID`` (-1) skips the token. As in
            vLLM, only the first ``n`` tokens are written (the rest of a padded
            ``key`` is ignored). O(n * num_kv_heads * head_size).
    """
    check_kv_cache(kv_cache)
    num_blocks, _, block_size, num_kv_heads, head_size = kv_cache.shape
    if key.shape != value.shape or key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
                         f"[num_tokens, {num_kv_heads}, {head_size}] to fit kv_cache "
                         f"{tuple(kv_cache.shape)}")
    slots = slot_mapping.to(kv_cache.device, torch.int64)
    if slots.dim() != 1 or slots.shape[0] > key.shape[0]:
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be 1-D and no "
                         f"longer than key's {key.shape[0]} tokens")
    keep = slots != PAD_SLOT_ID
    slots = slots[keep]
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping holds slots outside 0..{num_blocks * block_size - 1} "
                         f"(min {int(slots.min())}, max {int(slots.max())})")
    n = slot_mapping.shape[0]
    # A block's slots are contiguous in this layout, so slot s is (s // bs, s % bs).
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[:n][keep].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value[:n][keep].to(kv_cache.dtype)


def visible_key_range(query_pos: int, seq_len: int, causal: bool = True,
                      sliding_window: int | None = None,
                      attention_chunk_size: int | None = None) -> range:
    """Key positions a query at ``query_pos`` may see, as a ``range``.

    >>> visible_key_range(9, 10, sliding_window=4)          # p - W + 1 .. p
    range(6, 10)
    >>> visible_key_range(9, 10, attention_chunk_size=8)    # chunk 8..15, up to p
    range(8, 10)
    """
    lo, hi = 0, (query_pos + 1 if causal else seq_len)
    if sliding_window is not None:
        lo = max(lo, query_pos - sliding_window + 1)
    if attention_chunk_size is not None:
        chunk_start = query_pos // attention_chunk_size * attention_chunk_size
        lo = max(lo, chunk_start)
        hi = min(hi, chunk_start + attention_chunk_size)
    return range(lo, hi)


class AttentionOutput(NamedTuple):
    """Attention output and the log-sum-exp of each query's scores.

    ``output``: ``[num_tokens, num_heads, head_size]``; ``lse``:
    ``[num_tokens, num_heads]`` (natural log), what cascade attention merges.
    """

    output: torch.Tensor
    lse: torch.Tensor


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor, scale: float) -> AttentionOutput:
    """Softmax attention of a few queries over a few keys, with grouped heads.

    Args:
        query: ``[q, num_heads, head_size]``.
        key, value: ``[k, num_kv_heads, head_size]``; query head ``h`` reads
            kv head ``h // (num_heads // num_kv_heads)``.
        mask: ``[q, k]`` bool, True where the query may see the key. A query
            that sees no key gets output 0 and lse -inf.
        scale: multiplies the dot products (usually ``head_size ** -0.5``).

    Computed in float32 (float64 stays float64): ``out = softmax(scale * q k^T) v``.
    O(q * k * num_heads * head_size).
    """
    num_q, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(work).reshape(num_q, num_kv_heads, group, head_size)
    k, v = key.to(work), value.to(work)
    scores = torch.einsum("qhgd,khd->hgqk", q, k) * scale       # [Hk, G, q, k]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                       # [Hk, G, q]
    # exp(score - lse) is the softmax; a query with no visible key has lse -inf.
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp(min=torch.finfo(work).min))
    # 0 * NaN would be NaN: keys a query may not see must not touch its output.
    v_seen = torch.where(mask.any(dim=0)[:, None, None], v, torch.zeros_like(v))
    out = torch.einsum("hgqk,khd->qhgd", probs, v_seen)         # [q, Hk, G, D]
    return AttentionOutput(out.reshape(num_q, num_heads, head_size),
                           lse.permute(2, 0, 1).reshape(num_q, num_heads))


def as_ints(x: torch.Tensor | Sequence[int]) -> list[int]:
    """A tensor or sequence of integers as a Python list (the per-request loops read it)."""
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def check_batch(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: Sequence[int],
                seq_lens: Sequence[int], block_table: torch.Tensor) -> None:
    """Shape checks shared by every attention here; messages name the shapes."""
    check_kv_cache(kv_cache)
    check_requests(query_start_loc, seq_lens, block_table, kv_cache.shape[2])
    check_query(query, kv_cache, query_start_loc[-1])


def check_query(query: torch.Tensor, kv_cache: torch.Tensor, num_tokens: int) -> None:
    """``query`` fits ``kv_cache``'s heads and holds the batch's ``num_tokens`` rows."""
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    if query.dim() != 3 or query.shape[2] != head_size or query.shape[1] % num_kv_heads:
        raise ValueError(f"query must be [num_tokens, num_heads, {head_size}] with num_heads "
                         f"a multiple of num_kv_heads={num_kv_heads}, got {tuple(query.shape)}")
    if num_tokens > query.shape[0]:
        raise ValueError(f"query_start_loc ends at {num_tokens} but query has "
                         f"{query.shape[0]} tokens")


def check_requests(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                   block_table: torch.Tensor, block_size: int) -> None:
    """Per-request lengths agree with each other and with the block table."""
    num_reqs = len(seq_lens)
    if len(query_start_loc) != num_reqs + 1:
        raise ValueError(f"query_start_loc has {len(query_start_loc)} entries, seq_lens "
                         f"{num_reqs}: need num_reqs + 1 = {num_reqs + 1}")
    if block_table.dim() != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table must be [num_reqs={num_reqs}, max_blocks], got "
                         f"{tuple(block_table.shape)}")
    for r in range(num_reqs):
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        if not 0 <= q_len <= seq_lens[r]:
            raise ValueError(f"request {r}: query_len {q_len} must be in 0..seq_len "
                             f"{seq_lens[r]}")
        if cdiv(seq_lens[r], block_size) > block_table.shape[1]:
            raise ValueError(f"request {r}: seq_len {seq_lens[r]} needs "
                             f"{cdiv(seq_lens[r], block_size)} blocks of {block_size}, "
                             f"block_table has {block_table.shape[1]} columns")


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one request at ``positions``, read through its table row.

    ``block_ids``: ``[max_blocks]`` (one row of the block table); returns
    ``key, value``: ``[len(positions), num_kv_heads, head_size]``. O(len(positions)).
    """
    block_size = kv_cache.shape[2]
    blocks = block_ids.to(kv_cache.device, torch.int64)[positions // block_size]
    offsets = positions % block_size
    return kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]


def paged_attention_with_lse(query: torch.Tensor, kv_cache: torch.Tensor, *,
                             query_start_loc: torch.Tensor | Sequence[int],
                             seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor,
                             scale: float, causal: bool = True,
                             sliding_window: int | None = None,
                             attention_chunk_size: int | None = None) -> AttentionOutput:
    """``paged_attention`` that also returns each query's log-sum-exp (for cascades)."""
    starts, lens = as_ints(query_start_loc), as_ints(seq_lens)
    check_batch(query, kv_cache, starts, lens, block_table)
    check_window_args(sliding_window, attention_chunk_size)
    num_tokens, num_heads, head_size = query.shape
    device = kv_cache.device
    out_dtype = query.dtype
    output = torch.zeros(num_tokens, num_heads, head_size, dtype=out_dtype, device=device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32,
                     device=device)
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        if q_start == q_end:
            continue
        context_len = seq_len - (q_end - q_start)
        q_pos = torch.arange(context_len, seq_len, device=device)
        # Keys some query of this request may see: from the first query's
        # lowest visible key to the last query's highest.
        first = visible_key_range(context_len, seq_len, causal, sliding_window,
                                  attention_chunk_size)
        last = visible_key_range(seq_len - 1, seq_len, causal, sliding_window,
                                 attention_chunk_size)
        k_pos = torch.arange(first.start, max(last.stop, first.stop), device=device)
        key, value = gather_kv(kv_cache, block_table[r], k_pos)
        mask = visibility_mask(q_pos[:, None], k_pos[None, :], seq_len, causal,
                               sliding_window, attention_chunk_size)
        res = attend(query[q_start:q_end].to(device), key, value, mask, scale)
        output[q_start:q_end] = res.output.to(out_dtype)
        lse[q_start:q_end] = res.lse.float()
    return AttentionOutput(output, lse)


def check_window_args(sliding_window: int | None, attention_chunk_size: int | None) -> None:
    for name, v in (("sliding_window", sliding_window),
                    ("attention_chunk_size", attention_chunk_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")


def visibility_mask(q: torch.Tensor, k: torch.Tensor, seq_len: int | torch.Tensor,
                    causal: bool, sliding_window: int | None,
                    attention_chunk_size: int | None) -> torch.Tensor:
    """Bool, True where a query at position ``q`` may see the key at ``k``: the
    three rules of the module docstring, elementwise (``q``, ``k`` and ``seq_len``
    broadcast: ``q_pos[:, None]`` against ``k_pos[None, :]`` gives ``[q, k]``)."""
    mask = k < seq_len
    if causal:
        mask = mask & (k <= q)
    if sliding_window is not None:
        mask = mask & (k >= q - sliding_window + 1)
    if attention_chunk_size is not None:
        mask = mask & (k // attention_chunk_size == q // attention_chunk_size)
    return mask


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, *,
                    query_start_loc: torch.Tensor | Sequence[int],
                    seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor,
                    scale: float, causal: bool = True, sliding_window: int | None = None,
                    attention_chunk_size: int | None = None) -> torch.Tensor:
    """Attention of a packed batch of prefill chunks and decode steps over a paged cache.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, requests back to back.
        kv_cache: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``; the
            batch's own keys and values must already be written (``write_kv``).
        query_start_loc: ``[num_reqs + 1]`` cumulative query lengths.
        seq_lens: ``[num_reqs]`` context + query tokens per request.
        block_table: ``[num_reqs, max_blocks]`` block ids, in ``kv_cache``'s
            block size (kernel blocks when they are split).
        scale: softmax scale, usually ``head_size ** -0.5``.
        causal: queries see no later key (False: every key of the request).
        sliding_window: ``W``: a query at ``p`` sees keys ``p - W + 1 .. p``.
        attention_chunk_size: ``C``: a query sees only keys of its own chunk.

    Returns ``[num_tokens, num_heads, head_size]`` in ``query``'s dtype on
    ``kv_cache``'s device; rows after ``query_start_loc[-1]`` (padding) are 0.
    Grouped-query attention when ``num_heads`` is a multiple of ``num_kv_heads``.

    Cost: for each request, O(query_len * keys_seen * num_heads * head_size),
    where keys_seen <= seq_len (<= query_len + W - 1 with a window).
    """
    return paged_attention_with_lse(
        query, kv_cache, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_table=block_table, scale=scale, causal=causal, sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size).output


def default_scale(head_size: int) -> float:
    """The usual softmax scale, ``1 / sqrt(head_size)``."""
    return 1.0 / math.sqrt(head_size)
