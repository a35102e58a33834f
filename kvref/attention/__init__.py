"""Attention over kvref's paged KV cache, on real tensors.

Mirrors the FlashAttention and FlashInfer backends of ``vllm/v1/attention/``
and the cache-write op; each module says which file it follows:

- ``paged_attention``: the cache layout, ``write_kv``, and the reference
  ``paged_attention`` (causal, grouped heads, sliding window, chunked local).
- ``fast_paged_attention``: the same result batched, one gather through the
  block table and one SDPA call per query length (what the engine runs).
- ``flashinfer``: ``to_flashinfer``, the same block table as FlashInfer's CSR arrays.
- ``cascade``: a prefix all requests share (``get_num_common_prefix_blocks``)
  read once, merged with each request's own part by log-sum-exp.
- ``mamba_state``: a linear recurrence whose per-request state lives in the
  blocks ``MambaManager`` hands out (modes ``all`` and ``align``).

Needs torch (the ``torch`` extra); the core never imports this package.
"""

from kvref.attention.cascade import (
    cascade_attention,
    compute_cascade_attn_prefix_len,
    merge_attn_states,
)
from kvref.attention.fast_paged_attention import (
    KVGatherBuffer,
    PagedAttentionPlan,
    fast_paged_attention,
)
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
from kvref.attention.mamba_state import make_state_cache, mamba_step, recurrence_reference

__all__ = [
    "AttentionOutput", "FlashInferPageTable", "KVGatherBuffer", "attend", "cascade_attention",
    "PagedAttentionPlan", "compute_cascade_attn_prefix_len", "default_scale",
    "fast_paged_attention",
    "flashinfer_paged_attention",
    "gather_kv", "make_kv_cache", "make_state_cache", "mamba_step", "merge_attn_states",
    "paged_attention", "paged_attention_with_lse", "recurrence_reference", "to_flashinfer",
    "visible_key_range", "write_kv",
]
