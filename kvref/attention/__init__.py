"""Attention over kvref's paged KV cache, on real tensors.

Mirrors the FlashAttention and FlashInfer backends of ``vllm/v1/attention/``
and the cache-write op; each module says which file it follows:

- ``paged_attention``: the cache layout, ``write_kv``, and the reference
  ``paged_attention`` (causal, grouped heads, sliding window, chunked local).
- ``flashinfer``: ``to_flashinfer``, the same block table as FlashInfer's CSR arrays.

Needs torch (the ``torch`` extra); the core never imports this package.
"""

from kvref.attention.flashinfer import (
    FlashInferPageTable,
    flashinfer_paged_attention,
    to_flashinfer,
)
from kvref.attention.paged_attention import (
    AttentionOutput,
    attend,
    default_scale,
    gather_kv,
    make_kv_cache,
    paged_attention,
    paged_attention_with_lse,
    visible_key_range,
    write_kv,
)

__all__ = [
    "AttentionOutput", "FlashInferPageTable", "attend", "default_scale",
    "flashinfer_paged_attention", "gather_kv", "make_kv_cache", "paged_attention",
    "paged_attention_with_lse", "to_flashinfer", "visible_key_range", "write_kv",
]
