"""The textbook answer the lessons compare paged attention with.

No vLLM counterpart: a teaching aid. Plain softmax attention on contiguous
tensors, with the causal mask and, when asked, a sliding window or
chunked-local mask; no block, no slot, no cache. Lessons 04, 06 and 10 check
``kvref.attention.paged_attention`` against it.
"""

from __future__ import annotations

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None,
                    attention_chunk_size: int | None = None) -> torch.Tensor:
    """The last ``len(q)`` positions of a ``len(k)``-token sequence attending to
    its keys: q ``[n, H, D]``, k and v ``[s, Hk, D]`` (grouped heads repeated),
    out ``[n, H, D]``. Position ``p`` sees key ``j`` when ``j <= p``, and, with
    a window ``w``, ``j > p - w``; with a chunk ``c``, ``j // c == p // c``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n, s = q.shape[0], k.shape[0]
    query_pos = torch.arange(s - n, s, device=q.device)[:, None]
    key_pos = torch.arange(s, device=q.device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    if attention_chunk_size is not None:
        visible &= key_pos // attention_chunk_size == query_pos // attention_chunk_size
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
