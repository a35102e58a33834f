"""Cascade attention: read a prefix every request shares once, then merge.

Mirrors ``cascade_attention`` and ``merge_attn_states`` in
``vllm/v1/attention/backends/flash_attn.py`` and ``vllm/v1/attention/ops/
merge_attn_states.py``, and the prefix-length rule of
``GPUModelRunner._compute_cascade_attn_prefix_len``. What it teaches: this is
where the KV manager meets the kernel. ``KVCacheManager.get_num_common_prefix_blocks``
says how many leading blocks *every* running request holds (same physical
blocks, thanks to prefix caching); attention over them can be done once for
the whole batch::

    request 0:  | shared prefix (blocks 3, 8) | own suffix ...     |
    request 1:  | shared prefix (blocks 3, 8) | own suffix ... |
                 ^ one attention, all queries   ^ per-request causal attention
                   against these keys, no mask

Softmax over the union of two disjoint key sets is the two partial softmaxes
reweighted by their log-sum-exps (``lse``)::

    out = (exp(lse_p) * out_p + exp(lse_s) * out_s) / (exp(lse_p) + exp(lse_s))
    lse = log(exp(lse_p) + exp(lse_s))

The prefix part has no mask, so every query must come after the whole prefix:
the prefix length is capped by the smallest ``context_len`` of the batch and
rounded down to whole blocks. Sliding windows and chunked-local attention are
not supported (vLLM refuses them too).

    >>> compute_cascade_attn_prefix_len(num_common_prefix_blocks=3, block_size=4,
    ...                                 num_computed_tokens=[10, 17])
    8
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvref.attention.paged_attention import (
    AttentionOutput,
    as_ints,
    attend,
    check_batch,
    gather_kv,
    paged_attention_with_lse,
)


def compute_cascade_attn_prefix_len(num_common_prefix_blocks: int, block_size: int,
                                    num_computed_tokens: Sequence[int]) -> int:
    """Tokens of shared prefix cascade attention may use: the common blocks,
    capped by the least ``num_computed_tokens`` of the batch (a query inside
    the prefix would need a mask), rounded down to whole blocks. 0: no cascade.

    vLLM additionally returns 0 unless cascading looks faster (a prefix of at
    least 256 tokens, 8 requests, ...); that heuristic is about speed, not
    about the result, and is left out.
    """
    common = num_common_prefix_blocks * block_size
    if common == 0 or not num_computed_tokens:
        return 0
    common = min(common, min(num_computed_tokens))
    return common // block_size * block_size


def merge_attn_states(prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor
                      ) -> AttentionOutput:
    """Combine attention over two disjoint key sets into attention over both.

    ``*_output``: ``[num_tokens, num_heads, head_size]``; ``*_lse``:
    ``[num_tokens, num_heads]``. A side with ``lse = -inf`` saw no key and gets
    weight 0. O(num_tokens * num_heads * head_size).
    """
    if prefix_output.shape != suffix_output.shape or prefix_lse.shape != suffix_lse.shape \
            or prefix_lse.shape != prefix_output.shape[:2]:
        raise ValueError(f"outputs {tuple(prefix_output.shape)}, {tuple(suffix_output.shape)} "
                         f"and lses {tuple(prefix_lse.shape)}, {tuple(suffix_lse.shape)} must "
                         "be [num_tokens, num_heads, head_size] and [num_tokens, num_heads]")
    lse = torch.logaddexp(prefix_lse.float(), suffix_lse.float())
    # A query that saw no key on either side: both weights 0, not NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_prefix = torch.exp(prefix_lse.float() - safe).unsqueeze(-1)
    w_suffix = torch.exp(suffix_lse.float() - safe).unsqueeze(-1)
    out = w_prefix * prefix_output.float() + w_suffix * suffix_output.float()
    return AttentionOutput(out.to(prefix_output.dtype), lse)


def cascade_attention(query: torch.Tensor, kv_cache: torch.Tensor, *,
                      query_start_loc: torch.Tensor | Sequence[int],
                      seq_lens: torch.Tensor | Sequence[int], block_table: torch.Tensor,
                      scale: float, common_prefix_len: int) -> torch.Tensor:
    """Causal paged attention computed as shared prefix + per-request suffix.

    Arguments as in ``paged_attention``; ``common_prefix_len``: tokens of the
    shared prefix, a positive multiple of the block size, whose blocks are the
    first ``common_prefix_len // block_size`` of *every* row (``block_table[0]``
    is read for them), and not more than any request's ``context_len``.
    Returns ``[num_tokens, num_heads, head_size]``, equal to ``paged_attention``
    up to rounding.

    Cost: the prefix part is O(num_tokens * common_prefix_len * H * D) in one
    pass over the prefix keys (read once, not once per request); the suffix
    part is ``paged_attention``'s over the remaining keys.
    """
    starts, lens = as_ints(query_start_loc), as_ints(seq_lens)
    check_batch(query, kv_cache, starts, lens, block_table)
    block_size = kv_cache.shape[2]
    if common_prefix_len <= 0 or common_prefix_len % block_size:
        raise ValueError(f"common_prefix_len must be a positive multiple of the block size "
                         f"{block_size}, got {common_prefix_len}")
    context_lens = [s - (starts[r + 1] - starts[r]) for r, s in enumerate(lens)]
    if common_prefix_len > min(context_lens):
        raise ValueError(f"common_prefix_len {common_prefix_len} exceeds the smallest "
                         f"context_len {min(context_lens)}: some query lies inside the "
                         "prefix and would need a mask (see compute_cascade_attn_prefix_len)")
    num_prefix_blocks = common_prefix_len // block_size
    if not torch.equal(block_table[:len(lens), :num_prefix_blocks],
                       block_table[:1, :num_prefix_blocks].expand(len(lens), -1)):
        raise ValueError(f"the first {num_prefix_blocks} blocks differ between rows: "
                         "they are not a shared prefix")
    num_tokens = starts[-1]
    device = kv_cache.device

    # 1. Every query of the batch against the prefix keys, no mask.
    prefix_pos = torch.arange(common_prefix_len, device=device)
    key, value = gather_kv(kv_cache, block_table[0], prefix_pos)
    no_mask = torch.ones(num_tokens, common_prefix_len, dtype=torch.bool, device=device)
    prefix = attend(query[:num_tokens].to(device), key, value, no_mask, scale)

    # 2. Each request's queries against its own keys after the prefix, causal;
    # the table and lengths are shifted so that the suffix starts at position 0.
    suffix = paged_attention_with_lse(
        query[:num_tokens], kv_cache, query_start_loc=starts,
        seq_lens=[s - common_prefix_len for s in lens],
        block_table=block_table[:, num_prefix_blocks:], scale=scale, causal=True)

    merged = merge_attn_states(prefix.output.to(query.dtype), prefix.lse, suffix.output,
                               suffix.lse).output
    output = torch.zeros(query.shape, dtype=query.dtype, device=device)
    output[:num_tokens] = merged
    return output
