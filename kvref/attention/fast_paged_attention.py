"""Paged attention as the engine runs it: one gather through the block table, then SDPA.

No single vLLM file: it computes what ``paged_attention`` (the per-request
reference, ``kvref/attention/paged_attention.py``) computes, as vLLM's
FlashAttention backend does in one kernel call, here with torch's fused
``scaled_dot_product_attention`` (SDPA) on gathered keys. Same arguments,
same answer (the tests check both paths against dense SDPA on every case of
``tests/tensor``, with every unreadable slot NaN). Four moves:

1. **Batch by query length.** Requests with the same ``query_len`` run in one
   SDPA call (all decodes together: query length 1); a prefill chunk of
   another length gets its own call.
2. **Gather whole blocks, once.** A request's queries see the contiguous key
   range ``[lo, hi)`` (``visible_key_range`` of its first and last query); the
   blocks holding it are read with one ``index_select`` for keys and one for
   values, into a reused buffer, for as many requests of the batch at a time
   as fit in the CPU's cache (``KVGatherBuffer.max_bytes``: SDPA then reads
   the copy from cache, not from memory; a small batch is one chunk)::

       block size 4, row [7, 2, 9, 4], window 6, seq_len 14, one query (pos 13):
       lo = 8, hi = 14 -> table columns 2..3 -> blocks 9, 4 -> key positions 8..15
       buffer row: k8 k9 k10 k11 | k12 k13 [k14 k15]      [..]: unseen, zeroed

3. **Grouped heads read their KV head.** A decode's ``G = num_heads //
   num_kv_heads`` query heads that share a KV head become ``G`` query rows
   against it; longer queries use SDPA's ``enable_gqa``. Keys are never
   repeated per query head.
4. **The visibility rules as a mask.** Causal, sliding window and chunk, the
   rules of ``paged_attention``'s docstring, on the gathered positions.

Slots no query may see (left of the window, right of ``seq_len``, a batch's
padding columns) are set to 0 in the buffer before SDPA reads it: a masked
score of a NaN key is still NaN, and so is ``0 * NaN``.

    >>> kv_cache = torch.zeros(4, 2, 2, 1, 1)           # 4 blocks of 2 slots
    >>> write_kv(kv_cache, torch.zeros(3, 1, 1), torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1),
    ...          torch.tensor([2, 3, 6]))
    >>> out = fast_paged_attention(torch.ones(1, 1, 1), kv_cache,
    ...     query_start_loc=[0, 1], seq_lens=[3], block_table=torch.tensor([[1, 3]]), scale=1.0)
    >>> round(out.item(), 4)                             # as paged_attention: the mean
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvref.attention.paged_attention import (
    PAD_SLOT_ID,
    as_ints,
    check_batch,
    check_kv_cache,
    check_query,
    check_requests,
    check_window_args,
    visibility_mask,
    visible_key_range,
    write_kv,  # noqa: F401  (the doctest's cache write)
)
from kvref.math_utils import cdiv

__all__ = ["KVGatherBuffer", "PagedAttentionPlan", "fast_paged_attention"]

# Requests gathered at once hold at most this many bytes of keys and values, so
# SDPA reads them back from cache instead of memory (the gather is the only read
# of the pool). Decode, one thread, fast / dense SDPA (enable_gqa), whole batch
# -> a request at a time: 32 x 1 over 1024 1.84-1.94 -> 1.71-1.75, 8 x 1 over 4096
# 1.56-1.73 -> 1.58-1.65 (loaded machine, load 3-4); a quiet machine gave 1.9 ->
# 1.36 (a prototype of this loop). 16 MB chunks gained nothing; the toy engine's
# batches (~2-3 MB) stay one chunk.
DEFAULT_CHUNK_BYTES = 4 << 20


class KVGatherBuffer:
    """Reused staging tensors for the gathered key and value blocks, a cache's worth.

    Gathering into a fresh tensor of tens of MB costs that tensor's page faults on
    every call (CPU, decode 32 x 1 over 1024 tokens: both gathers took ~170 ms into
    new tensors, ~31 ms into reused ones). One buffer serves every layer of a step
    in turn; it grows to the largest chunk seen and is never shrunk.

    ``max_bytes``: how much of a batch is gathered at once. A batch is gathered and
    attended a few requests at a time, as many as fit in ``max_bytes`` of keys and
    values (at least one), so that SDPA reads the keys from the CPU's cache rather
    than from memory. None: the whole batch at once.
    """

    def __init__(self, max_bytes: int | None = DEFAULT_CHUNK_BYTES) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def requests_per_chunk(self, num_reqs: int, num_keys: int, kv_cache: torch.Tensor) -> int:
        """How many requests of ``num_keys`` gathered keys each to gather at once
        (all of them off the CPU: a GPU gains nothing from CPU-cache-sized chunks)."""
        if self.max_bytes is None or kv_cache.device.type != "cpu":
            return num_reqs
        per_request = 2 * num_keys * math.prod(kv_cache.shape[3:]) * kv_cache.element_size()
        return max(1, min(num_reqs, self.max_bytes // per_request))

    def take(self, num_blocks: int, pool_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors (contents
        undefined) shaped as blocks of ``pool_keys`` (``kv_cache[:, 0]``), in its
        dtype and device."""
        shape = (num_blocks, *pool_keys.shape[1:])
        numel = math.prod(shape)
        k = self._keys
        if (k is None or k.numel() < numel or k.dtype != pool_keys.dtype
                or k.device != pool_keys.device):
            self._keys = torch.empty(numel, dtype=pool_keys.dtype, device=pool_keys.device)
            self._values = torch.empty_like(self._keys)
        return self._keys[:numel].view(shape), self._values[:numel].view(shape)


class PagedAttentionPlan:
    """Everything a step's attention does the same in every layer, worked out once.

    The layers of one KV cache group share the batch, the block table and the
    visibility rules, so which blocks to gather, which gathered slots to zero,
    the masks and the query rows are computed here once per step, and
    ``attend`` does only tensor work per layer. (vLLM's metadata builder plays
    this part: it runs once per step and group, and FlashAttention's
    ``scheduler_metadata`` is its precomputed kernel plan.)

    Args:
        query_start_loc, seq_lens, block_table, causal, sliding_window,
            attention_chunk_size: as in ``paged_attention`` (checked here).
        block_size: the KV cache's (kernel) block size.
        num_blocks: the KV cache's block count; with ``slot_mapping``, the slots
            are checked against it here, once, and ``write_kv`` only writes.
        slot_mapping: ``[n]``, as ``write_kv``'s (optional: a plan that only attends).
        device: where the plan's tensors live (the KV cache's device).
    """

    def __init__(self, query_start_loc: torch.Tensor | Sequence[int],
                 seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor, *,
                 block_size: int, causal: bool = True, sliding_window: int | None = None,
                 attention_chunk_size: int | None = None, num_blocks: int | None = None,
                 slot_mapping: torch.Tensor | None = None,
                 device: torch.device | str = "cpu") -> None:
        starts, lens = as_ints(query_start_loc), as_ints(seq_lens)
        check_requests(starts, lens, block_table, block_size)
        check_window_args(sliding_window, attention_chunk_size)
        self.block_size = block_size
        self.causal, self.sliding_window = causal, sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.num_tokens = starts[-1]
        self.num_reqs = len(lens)
        by_query_len: dict[int, list[int]] = {}
        for r in range(len(lens)):
            q_len = starts[r + 1] - starts[r]
            if q_len:
                by_query_len.setdefault(q_len, []).append(r)
        self._writes = None if slot_mapping is None else _plan_writes(
            slot_mapping.to(device, torch.int64), block_size, num_blocks)
        block_table = block_table.to(device)
        self.batches = [_plan_batch(q_len, reqs, starts, lens, block_table, block_size,
                                    causal, sliding_window, attention_chunk_size, device)
                        for q_len, reqs in by_query_len.items()]

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """``write_kv(kv_cache, key, value, slot_mapping)`` with the slots checked at
        planning: two indexed writes per layer."""
        if self._writes is None:
            raise ValueError("this plan was made without a slot_mapping")
        blocks, offsets, rows, num_blocks = self._writes
        if kv_cache.dim() != 5 or kv_cache.shape[0] != num_blocks \
                or kv_cache.shape[2] != self.block_size:
            raise ValueError(f"the plan is for a kv_cache of {num_blocks} blocks of "
                             f"{self.block_size}, got shape {tuple(kv_cache.shape)}")
        if key.shape != value.shape or key.shape[1:] != kv_cache.shape[3:] \
                or key.shape[0] < blocks.shape[0]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must "
                             f"both be [>= {blocks.shape[0]}, {kv_cache.shape[3]}, "
                             f"{kv_cache.shape[4]}]")
        if rows is None:                                 # no padding slot: every token
            key, value = key[:blocks.shape[0]], value[:blocks.shape[0]]
        else:
            key, value = key[rows], value[rows]
        kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
               buffer: KVGatherBuffer | None = None) -> torch.Tensor:
        """``paged_attention``'s output for this plan's batch: ``[num_tokens, H, D]``."""
        check_kv_cache(kv_cache)
        check_query(query, kv_cache, self.num_tokens)
        if kv_cache.shape[2] != self.block_size:
            raise ValueError(f"the plan is for blocks of {self.block_size} tokens, kv_cache "
                             f"has {kv_cache.shape[2]}")
        buffer = buffer or KVGatherBuffer()
        if len(self.batches) == 1 and self.batches[0].rows is None \
                and self.num_tokens == query.shape[0]:
            # One batch holding every row in order (a step of decodes): its output is the output.
            return _attend_batch(query, kv_cache, buffer, self.batches[0], scale
                                 ).to(query.dtype)
        output = torch.zeros(query.shape, dtype=query.dtype, device=kv_cache.device)
        for batch in self.batches:
            if batch.rows is None:
                n = batch.num_reqs * batch.q_len
                output[:n] = _attend_batch(query[:n], kv_cache, buffer, batch, scale)
            else:
                out = _attend_batch(query.index_select(0, batch.rows), kv_cache, buffer,
                                    batch, scale)
                output.index_copy_(0, batch.rows, out.to(output.dtype))
        return output


def fast_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, *,
                         query_start_loc: torch.Tensor | Sequence[int],
                         seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor,
                         scale: float, causal: bool = True, sliding_window: int | None = None,
                         attention_chunk_size: int | None = None,
                         buffer: KVGatherBuffer | None = None) -> torch.Tensor:
    """``paged_attention``'s result (same arguments, shapes and errors), batched.

    ``buffer``: a ``KVGatherBuffer`` to gather into (the engine keeps one); None
    uses a fresh one. Scores and softmax run in float32 (float64 stays float64),
    as in the reference. Cost: per batch of equal query lengths, one read of the
    blocks its requests see and one SDPA over its queries x the longest
    gathered range. A caller that runs several layers on one batch builds the
    ``PagedAttentionPlan`` once and calls its ``attend`` per layer.
    """
    starts, lens = as_ints(query_start_loc), as_ints(seq_lens)
    check_batch(query, kv_cache, starts, lens, block_table)
    plan = PagedAttentionPlan(starts, lens, block_table, block_size=kv_cache.shape[2],
                              causal=causal, sliding_window=sliding_window,
                              attention_chunk_size=attention_chunk_size,
                              device=kv_cache.device)
    return plan.attend(query, kv_cache, scale, buffer)


def _plan_writes(slots: torch.Tensor, block_size: int, num_blocks: int | None):
    """``(blocks, offsets, rows, num_blocks)`` of ``write_kv``'s writes; rows: the
    tokens kept (None: all), the slots' checks those of ``write_kv``."""
    if num_blocks is None:
        raise ValueError("a plan with a slot_mapping needs num_blocks")
    if slots.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slots.shape)}")
    keep = slots != PAD_SLOT_ID
    rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
    kept = slots if rows is None else slots[rows]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping holds slots outside 0..{num_blocks * block_size - 1} "
                         f"(min {int(kept.min())}, max {int(kept.max())})")
    return kept // block_size, kept % block_size, rows, num_blocks


@dataclass(frozen=True, slots=True)
class _Batch:
    """One SDPA call: ``num_reqs`` requests of ``q_len`` queries, keys gathered
    from ``num_cols`` table columns each (``num_keys = num_cols * block_size``)."""

    q_len: int
    num_reqs: int
    num_keys: int
    rows: torch.Tensor | None        # [R * q_len] query rows; None: rows 0.. in order
    block_ids: torch.Tensor          # [R * num_cols] the blocks to gather, request by request
    unseen: torch.Tensor | None      # indices into the R * num_keys gathered slots to zero
    unseen_starts: list[int] | None  # [R + 1] where each request's indices begin in unseen
    attn_mask: torch.Tensor | None   # [R, 1, q_len, num_keys] bool; None: see is_causal
    # Every request has the same mask (attn_mask is one request's, expanded):
    # SDPA is handed the one [1, 1, q_len, num_keys] copy to broadcast.
    shared_mask: bool = False
    # Prefills from position 0 under plain causal attention: the first q_len keys,
    # SDPA's own causal mask (it skips the blocks above the diagonal).
    is_causal: bool = False
    # Per request, the gathered slots [a, b) its queries see (their ranges overlap
    # or touch, so together they are one run); None for is_causal batches.
    seen_runs: list[tuple[int, int]] | None = None
    # Chunk lists by requests per chunk, made by the first layer that asks (``_chunks``).
    chunks: dict[int, list[_Chunk]] = field(default_factory=dict, compare=False)


def _plan_batch(q_len: int, reqs: list[int], starts: list[int], lens: list[int],
                block_table: torch.Tensor, block_size: int, causal: bool,
                sliding_window: int | None, attention_chunk_size: int | None,
                device: torch.device | str) -> _Batch:
    seq_lens = [lens[r] for r in reqs]
    in_order = [starts[r] for r in reqs] == list(range(0, len(reqs) * q_len, q_len))
    rows = None if in_order else torch.cat(
        [torch.arange(starts[r], starts[r] + q_len) for r in reqs]).to(device)
    if q_len > 1 and causal and sliding_window is None and attention_chunk_size is None \
            and all(n == q_len for n in seq_lens):
        # Whole prompts, no context: key i is position i, query i sees keys 0..i.
        # (Measured on a 4 x 512 prefill: ~20% faster than the boolean mask.)
        num_cols = cdiv(q_len, block_size)
        cols = torch.arange(num_cols, device=device).expand(len(reqs), num_cols)
        table = block_table if reqs == list(range(len(reqs))) else block_table[reqs]
        return _Batch(q_len=q_len, num_reqs=len(reqs), num_keys=num_cols * block_size,
                      rows=rows, block_ids=table[:len(reqs)].gather(1, cols).reshape(-1)
                      .to(torch.int64), unseen=None, unseen_starts=None, attn_mask=None,
                      is_causal=True)
    # The table columns each request reads: the blocks of its keys [lo, hi).
    first_col, last_col, seen_runs = [], [], []
    for seq_len in seq_lens:
        first = visible_key_range(seq_len - q_len, seq_len, causal, sliding_window,
                                  attention_chunk_size)
        last = visible_key_range(seq_len - 1, seq_len, causal, sliding_window,
                                 attention_chunk_size)
        lo, hi = first.start, max(last.stop, first.stop)
        first_col.append(lo // block_size)
        last_col.append((hi - 1) // block_size)
        seen_runs.append((lo - first_col[-1] * block_size, hi - first_col[-1] * block_size))
    num_reqs = len(reqs)
    num_cols = max(b - a for a, b in zip(first_col, last_col)) + 1
    num_keys = num_cols * block_size
    first_t = torch.tensor(first_col, device=device)
    # Shorter requests repeat their last block up to the batch's width (masked below).
    cols = torch.minimum(first_t[:, None] + torch.arange(num_cols, device=device),
                         torch.tensor(last_col, device=device)[:, None])      # [R, C]
    rows_of_table = block_table if reqs == list(range(num_reqs)) else block_table[reqs]
    block_ids = rows_of_table[:num_reqs].gather(1, cols).reshape(-1).to(torch.int64)

    # Positions of the gathered keys (the unclamped ones: a repeated block lies
    # past hi, so the rules hide it) and of the queries, the tail of each sequence.
    # Requests of one length see the same gathered slots: their mask is worked
    # out once and shared (chunked prefill 4 x 128 over 512: the plan 1.5 -> 1.1
    # ms, and SDPA broadcasts one mask; the whole call ~3% faster).
    shared = len(set(seq_lens)) == 1
    mask_reqs = 1 if shared else num_reqs
    k_pos = first_t[:mask_reqs, None] * block_size + torch.arange(num_keys, device=device)
    seq_t = torch.tensor(seq_lens[:mask_reqs], device=device)
    q_pos = seq_t[:, None] - q_len + torch.arange(q_len, device=device)            # [r, q]
    mask = visibility_mask(q_pos[:, :, None], k_pos[:, None, :], seq_t[:, None, None],
                           causal, sliding_window, attention_chunk_size)          # [r, q, K]
    if shared:
        mask = mask.expand(num_reqs, q_len, num_keys)                             # [R, q, K]
    # Slots no query sees are zeroed one by one in the gathered buffer (assigning
    # through a boolean mask would rewrite all of it).
    unseen = (~mask.any(dim=1)).reshape(-1).nonzero().squeeze(1)                   # of R * K
    seen_all = unseen.numel() == 0
    # A chunk of requests [r0, r1) zeroes unseen[starts[r0]:starts[r1]] - r0 * K.
    starts = torch.searchsorted(unseen, torch.arange(num_reqs + 1, device=device) * num_keys)
    return _Batch(q_len=q_len, num_reqs=num_reqs, num_keys=num_keys, rows=rows,
                  block_ids=block_ids, unseen=None if seen_all else unseen,
                  unseen_starts=None if seen_all else starts.tolist(), seen_runs=seen_runs,
                  # A decode that sees every gathered key needs no mask.
                  attn_mask=None if seen_all and q_len == 1 else mask[:, None],
                  shared_mask=shared)


class _Chunk(NamedTuple):
    """Requests ``r0 .. r1 - 1`` of a ``_Batch``, gathered and attended together."""

    r0: int
    r1: int
    block_ids: torch.Tensor            # [(r1 - r0) * num_cols]
    unseen: torch.Tensor | None        # indices into the chunk's gathered slots to zero
    attn_mask: torch.Tensor | None     # [r1 - r0, 1, q_len, num_keys], or None
    seen: slice | None                 # one request: the gathered slots to hand SDPA


def _chunks(batch: _Batch, step: int) -> list[_Chunk]:
    """The batch cut into chunks of ``step`` requests; worked out once per step
    (every layer's call finds it in ``batch.chunks``)."""
    if step in batch.chunks:
        return batch.chunks[step]
    cols = batch.block_ids.numel() // batch.num_reqs
    chunks = []
    for r0 in range(0, batch.num_reqs, step):
        r1 = min(r0 + step, batch.num_reqs)
        block_ids = batch.block_ids[r0 * cols:r1 * cols]
        mask = batch.attn_mask
        if mask is not None:               # a shared mask: one request's, broadcast by SDPA
            mask = mask[:1] if batch.shared_mask else mask[r0:r1]
        if r1 - r0 == 1 and batch.seen_runs is not None:
            # One request: SDPA gets only the slots its queries see, so nothing is
            # zeroed and a decode needs no mask (decode 32 x 1 over 1024, a request
            # per chunk: 2 index_fill_ and SDPA's mask conversion less per request,
            # ~0.25x of dense SDPA's time on the loaded machine).
            a, b = batch.seen_runs[r0]
            mask = None if batch.q_len == 1 or mask is None else mask[..., a:b]
            chunks.append(_Chunk(r0, r1, block_ids, None, mask, slice(a, b)))
            continue
        unseen = None
        if batch.unseen is not None:
            start, stop = batch.unseen_starts[r0], batch.unseen_starts[r1]
            if stop > start:
                unseen = batch.unseen[start:stop] - r0 * batch.num_keys
        chunks.append(_Chunk(r0, r1, block_ids, unseen, mask, None))
    batch.chunks[step] = chunks
    return chunks


def _attend_batch(query: torch.Tensor, kv_cache: torch.Tensor, buffer: KVGatherBuffer,
                  batch: _Batch, scale: float) -> torch.Tensor:
    """``query [R * q_len, H, D]`` -> the batch's output, same shape, in the work dtype.

    The requests are gathered and attended a chunk at a time (``buffer.max_bytes``
    of keys and values), each chunk still in cache when SDPA reads it.
    """
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    query = query.to(work)
    pool_keys, pool_values = kv_cache[:, 0], kv_cache[:, 1]      # [num_blocks, bs, Hk, D]
    chunks = _chunks(batch, buffer.requests_per_chunk(batch.num_reqs, batch.num_keys, kv_cache))
    if len(chunks) == 1:
        return _attend_chunk(query, pool_keys, pool_values, buffer, batch, chunks[0], scale)
    out = torch.empty(query.shape, dtype=work, device=query.device)
    q_len = batch.q_len
    for chunk in chunks:
        rows = slice(chunk.r0 * q_len, chunk.r1 * q_len)
        out[rows] = _attend_chunk(query[rows], pool_keys, pool_values, buffer, batch, chunk,
                                  scale)
    return out


def _attend_chunk(query: torch.Tensor, pool_keys: torch.Tensor, pool_values: torch.Tensor,
                  buffer: KVGatherBuffer, batch: _Batch, chunk: _Chunk,
                  scale: float) -> torch.Tensor:
    """The chunk's ``query [n * q_len, H, D]`` (work dtype) -> its output, same shape."""
    num_kv_heads, head_size = pool_keys.shape[2:]
    num_heads = query.shape[1]
    num_reqs, q_len, num_keys = chunk.r1 - chunk.r0, batch.q_len, batch.num_keys
    keys, values = buffer.take(chunk.block_ids.numel(), pool_keys)
    torch.index_select(pool_keys, 0, chunk.block_ids, out=keys)          # [n * C, bs, Hk, D]
    torch.index_select(pool_values, 0, chunk.block_ids, out=values)
    if chunk.unseen is not None:
        keys.view(num_reqs * num_keys, -1).index_fill_(0, chunk.unseen, 0)
        values.view(num_reqs * num_keys, -1).index_fill_(0, chunk.unseen, 0)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    k = keys.view(num_reqs, num_keys, num_kv_heads, head_size).transpose(1, 2)
    v = values.view(num_reqs, num_keys, num_kv_heads, head_size).transpose(1, 2)
    if chunk.seen is not None:
        k, v = k[:, :, chunk.seen], v[:, :, chunk.seen]
    q = query.view(num_reqs, q_len, num_heads, head_size)                # k, v: [n, Hk, K, D]
    if q_len == 1:
        # A decode reads every key once for its G query heads: they become G rows
        # against their KV head, [R, Hk, G, D], and the mask is one row per request.
        q = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_size)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.attn_mask, scale=scale)
    else:
        # Longer queries: one mask [R, 1, q, K] for all heads, and SDPA pairs each
        # query head with its KV head (folding heads into rows here would repeat the
        # mask G times; measured ~1.5x slower on a 512-token prefill).
        if batch.is_causal:                 # the slots past the prompt are never read
            k, v = k[:, :, :q_len], v[:, :, :q_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                             attn_mask=chunk.attn_mask, scale=scale,
                                             is_causal=batch.is_causal,
                                             enable_gqa=True)                 # [R, H, q, D]
        out = out.transpose(1, 2)
    return out.reshape(num_reqs * q_len, num_heads, head_size)
