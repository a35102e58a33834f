"""vLLM's exact answers, computed from the spec alone (no vLLM counterpart).

The safety invariants say what may never happen; this module says what *does*
happen, number for number, so a mistake that stays safe but answers
differently from vLLM 0.25.1 is caught. Every function states one fact of
``specs/`` and reads kvref only for state (tables, ``ref_cnt``, hashes, the
free queue as the pool observer models it), never for a decision:

- ``skipped_tokens``: how many leading tokens a window or chunk frees (INV-SKIP-1).
- ``predict_allocation``: whether ``allocate_slots`` succeeds and which block ids
  it hands out, in order (INV-ALLOC-3, INV-ALLOC-4).
- ``expected_block_hashes``: a request's chained hashes with their extra keys
  (INV-CHAIN-2).
- ``is_hashed_by_caching``: which positions caching hashes in window and Mamba
  groups, with or without a retention interval (INV-CACHE-2).

Example, block size 4, window 5: ``skipped_tokens(spec, 8) == 4`` (block 0 is
freed), ``skipped_tokens(spec, 7) == 3`` (no whole block yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.math_utils import cdiv

from .backend import KVCacheBlock, RequestStatus, kv_cache_utils, sha256


def skipped_tokens(spec: KVCacheSpec, num_computed: int) -> int:
    """INV-SKIP-1: leading tokens no later token reads, vLLM's exact count."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return num_computed // spec.attention_chunk_size * spec.attention_chunk_size
    return 0


def return_to_queue(queue: list[int], blocks: list[KVCacheBlock]) -> list[int]:
    """The free queue after ``blocks`` (all now at ref_cnt 0, in free order) come
    back: those without a hash to the head, cached ones to the tail (INV-EVICT-1)."""
    uncached = [b.block_id for b in blocks if b.block_hash is None]
    cached = [b.block_id for b in blocks if b.block_hash is not None]
    return uncached + queue + cached


def admission_cap(spec: KVCacheSpec, max_num_batched_tokens: int,
                  max_model_len: int) -> int | None:
    """INV-ALLOC-3: the most blocks one request of this type holds at once."""
    if isinstance(spec, SlidingWindowSpec):
        tokens = min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, spec.block_size) + 1
    if isinstance(spec, ChunkedLocalAttentionSpec):
        tokens = min(spec.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(tokens, spec.block_size)
    return None


@dataclass
class Allocation:
    """What one ``allocate_slots`` call should do (INV-ALLOC-3/4)."""

    fits: bool
    total_computed: int                  # T: computed + hit + external, capped
    handed_out: list[list[int]] = field(default_factory=list)   # per group, in order
    sequence: list[int] = field(default_factory=list)           # all groups, in call order
    skipped_blocks: list[int] = field(default_factory=list)     # k per group
    why: str = ""


def predict_allocation(*, specs, tables, hits, request, num_new_tokens: int,
                       num_hit: int, num_external: int, free_queue: list[int],
                       max_model_len: int, max_num_batched_tokens: int,
                       watermark_blocks: int, has_scheduled_reqs: bool,
                       full_sequence_must_fit: bool, reserved_blocks: int,
                       allocated_before: bool) -> Allocation:
    """vLLM's answer to ``allocate_slots`` for attention-only groups.

    ``tables``/``hits``: per group, the request's table and its hit (block
    objects, read for ``ref_cnt``, hash and identity only); ``free_queue``: the
    free block ids head first. Steps as ``specs/kv_cache_manager.md`` orders
    them: full-sequence test, window frees, room test, touches, external
    blocks, new blocks.
    """
    T = min(request.num_computed_tokens + num_hit + num_external, max_model_len)
    slots = min(T + num_new_tokens, max_model_len)
    wm = watermark_blocks if has_scheduled_reqs and request.status in (
        RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
    free = len(free_queue)
    ks = [skipped_tokens(s, T) // s.block_size for s in specs]

    def need(tokens: int, capped: bool) -> int:
        total = 0
        for spec, table, hit, k in zip(specs, tables, hits, ks):
            required = cdiv(tokens, spec.block_size)
            cap = admission_cap(spec, max_num_batched_tokens, max_model_len)
            if capped and cap is not None:
                required = min(required, cap)
            if allocated_before:
                total += max(required - len(table), 0)
            else:
                total += max(required - max(k, len(hit)), 0)
                total += sum(1 for b in hit[k:] if not b.is_null and b.ref_cnt == 0)
        return total

    result = Allocation(False, T, skipped_blocks=ks)
    if full_sequence_must_fit:
        whole = need(min(request.num_tokens, max_model_len), capped=True)
        if whole + wm > free:
            result.why = f"the whole request needs {whole} + watermark {wm} > {free} free"
            return result
    # Step 2: blocks left of each window go back to the queue (rightmost first).
    queue = list(free_queue)
    for spec, table, k in zip(specs, tables, ks):
        freed = []
        for p in range(min(k, len(table)) - 1, -1, -1):
            if table[p].is_null:
                break
            if table[p].ref_cnt == 1:
                freed.append(table[p])
        queue = return_to_queue(queue, freed)
    needed = need(slots, capped=False)
    if needed + wm > len(queue) - reserved_blocks:
        result.why = (f"needs {needed} + watermark {wm} > {len(queue)} free "
                      f"after window frees - {reserved_blocks} reserved")
        return result
    result.fits = True
    lengths = []
    for spec, table, hit, k in zip(specs, tables, hits, ks):
        if allocated_before:
            lengths.append(len(table))
            continue
        for b in hit[k:]:                       # touched: off the free queue
            if not b.is_null and b.ref_cnt == 0:
                queue.remove(b.block_id)
        lengths.append(max(k, len(hit)))
    handed = [[] for _ in specs]
    if not allocated_before and num_external > 0:
        total = request.num_computed_tokens + num_hit + num_external
        for g, spec in enumerate(specs):
            skipped = skipped_tokens(spec, total)
            ext = min(total - skipped, num_external) if skipped > 0 else num_external
            if ext > 0:
                n = max(cdiv(total, spec.block_size) - lengths[g], 0)
                handed[g] += queue[:n]
                result.sequence += queue[:n]
                del queue[:n]
                lengths[g] += n
    for g, spec in enumerate(specs):
        n = max(cdiv(slots, spec.block_size) - lengths[g], 0)
        handed[g] += queue[:n]
        result.sequence += queue[:n]
        del queue[:n]
    result.handed_out = handed
    return result


def expected_extra_keys(request, start: int, end: int) -> tuple | None:
    """INV-CHAIN-2: the extra keys of block ``[start, end)``, from the spec."""
    keys: list = []
    if request.lora_request is not None:
        keys.append(request.lora_request.lora_name)
    items = list(request.mm_features)
    if end > request.num_prompt_tokens and items:
        items = items[-1:]      # a block completed by outputs sees only the last item
    for item in items:
        offset, length = item.mm_position.offset, item.mm_position.length
        if offset < end and offset + length > start:
            keys.append((item.identifier, offset - start))
    if start == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def expected_block_hashes(request, hash_block_size: int) -> list[bytes]:
    """INV-CHAIN-2: every full block's hash, chained from ``NONE_HASH``."""
    hashes: list[bytes] = []
    parent = kv_cache_utils.NONE_HASH
    tokens = list(request.all_token_ids)
    for start in range(0, len(tokens) - hash_block_size + 1, hash_block_size):
        end = start + hash_block_size
        parent = sha256((parent, tuple(tokens[start:end]),
                         expected_extra_keys(request, start, end)))
        hashes.append(parent)
    return hashes


def is_hashed_by_caching(spec: KVCacheSpec, position: int, *, alignment: int,
                         retention_interval: int | None, num_prompt_tokens: int,
                         use_eagle: bool) -> bool:
    """INV-CACHE-2: whether caching that covers ``position`` hashes it.

    Read off the spec's kept boundaries one by one (not vLLM's mask arithmetic):
    block size 4, window 4 (one block per hit), interval 8, a 14-token prompt
    (replay boundary 12): boundaries 8, 16, ... and 12 -> positions 1, 3, 5, ...
    and 2.
    """
    bs = spec.block_size
    if isinstance(spec, SlidingWindowSpec):
        need = cdiv(spec.sliding_window - 1, bs) + (1 if use_eagle else 0)
        shift = 1 if use_eagle else 0
        segment = alignment if retention_interval is None else retention_interval
        if segment > 0 and need >= segment // bs:
            return True

        def tail_of(boundary: int) -> bool:
            end = boundary // bs + shift
            return end - need <= position < end

        # The tails that can contain ``position`` end at most ``need`` blocks later.
        if segment > 0:
            for end_block in range(position + 1, position + need + 1):
                boundary = (end_block - shift) * bs
                if boundary > 0 and boundary % segment == 0 and tail_of(boundary):
                    return True
        return retention_interval is not None and             tail_of((num_prompt_tokens - 1) // alignment * alignment)
    if isinstance(spec, MambaSpec):
        if retention_interval is None or 0 < retention_interval < 2 * bs:
            return True
        boundary = (position + 1) * bs
        replay = (num_prompt_tokens - 1) // alignment * alignment
        return boundary == replay or (retention_interval > 0
                                      and boundary % retention_interval == 0)
    return True


def is_plain_full_attention(spec: KVCacheSpec) -> bool:
    """INV-ALLOC-5: the groups whose fresh blocks ``take_new_block_ids`` reports."""
    return type(spec) is FullAttentionSpec


__all__ = ["Allocation", "admission_cap", "cdiv", "expected_block_hashes",
           "expected_extra_keys", "is_hashed_by_caching", "is_plain_full_attention",
           "predict_allocation", "return_to_queue", "skipped_tokens"]
