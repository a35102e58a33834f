"""torch's own paged attention (flex_attention + ``PagedAttention``) fed kvref's
block tables gives kvref's output.

``torch.nn.attention.experimental._paged_attention.PagedAttention`` keeps a page
table ``[batch, logical block] -> physical page`` and its inverse; we fill both
from the worker's block table instead of letting it allocate, and run
``flex_attention`` (eager on CPU: it materializes the full score matrix) over
the physical cache. Its layout is ``[1, num_kv_heads, num_pages * page_size,
head_size]``, a transposed view of kvref's keys and values.

Eager flex multiplies the masked-out probabilities (0) by every value of the
physical cache, so a NaN anywhere in the cache would reach the output
(0 * NaN); these runs fill unwritten slots with 0, not NaN.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .driver import DEVICES, Run, chunk_of, window_of
from .test_paged_attention import CONFIGS, mixed_run


def flex_paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                         window, chunk):
    """Packed ``query [T, H, D]`` -> ``[T, H, D]`` through torch's PagedAttention."""
    num_pages, _, page_size, num_kv_heads, head_size = kv_cache.shape
    num_reqs = len(seq_lens)
    device = kv_cache.device
    q_lens = [query_start_loc[r + 1] - query_start_loc[r] for r in range(num_reqs)]
    q_max = max(q_lens)
    paged = PagedAttention(num_pages, page_size, num_reqs, device=str(device))
    width = block_table.shape[1]
    paged.page_table[:, :width] = block_table.to(torch.int64)
    for r in range(num_reqs):
        for logical, physical in enumerate(block_table[r].tolist()):
            # Only real blocks get a logical index; null (0) stays "not live".
            if physical != 0 and logical * page_size < seq_lens[r]:
                paged.physical_to_logical[r, physical] = logical
    ctx = torch.tensor([s - q for s, q in zip(seq_lens, q_lens)], device=device)
    q_len_t = torch.tensor(q_lens, device=device)
    seq_len_t = torch.tensor(seq_lens, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = ctx[b] + q_idx
        seen = (q_idx < q_len_t[b]) & (kv_idx <= pos) & (kv_idx < seq_len_t[b])
        if window is not None:
            seen = seen & (kv_idx > pos - window)
        if chunk is not None:
            seen = seen & (kv_idx // chunk == pos // chunk)
        return seen

    logical_mask = create_block_mask(mask_mod, num_reqs, None, q_max, width * page_size,
                                     device=str(device), BLOCK_SIZE=(page_size, page_size))
    physical_mask = paged.convert_logical_block_mask(logical_mask, kv_len=seq_len_t)
    q = torch.zeros(num_reqs, query.shape[1], q_max, head_size, device=device)
    for r in range(num_reqs):
        rows = query[query_start_loc[r]:query_start_loc[r + 1]]
        q[r, :, :q_lens[r]] = rows.transpose(0, 1)
    k = kv_cache[:, 0].reshape(1, num_pages * page_size, num_kv_heads, head_size).transpose(1, 2)
    v = kv_cache[:, 1].reshape(1, num_pages * page_size, num_kv_heads, head_size).transpose(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # "called without torch.compile"
        out = flex_attention(q, k, v, block_mask=physical_mask, scale=scale, enable_gqa=True)
    return torch.cat([out[r, :, :q_lens[r]].transpose(0, 1) for r in range(num_reqs)])


# Every attention type, hybrids and split kernel blocks, in three runs (eager flex
# traces each new shape with dynamo: seconds per run).
FLEX_CONFIGS = ["hybrid_full_chunked", "hybrid_full_swa", "kernel_split_swa"]
# Of mixed_run's steps: two prefill chunks; chunk + decode; a chunk after a
# prefix hit next to a decode; a re-admission after preemption; the last decode
# (the window has slid over freed blocks).
COMPARED_STEPS = {0, 1, 3, 5, 12}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FLEX_CONFIGS)
def test_torch_paged_flex_attention_agrees_with_kvref(config, device):
    run = Run(num_blocks=48, device=device, fill=0.0, **CONFIGS[config])
    num_compared = 0
    for i, step in enumerate(mixed_run(run)):
        if i not in COMPARED_STEPS:
            continue
        for gb in step.groups:
            spec = run.specs[gb.group]
            out = flex_paged_attention(gb.query, run.caches[gb.group], gb.block_table,
                                       step.query_start_loc, step.seq_lens, run.scale,
                                       window_of(spec), chunk_of(spec))
            torch.testing.assert_close(out, gb.output[:step.query_start_loc[-1]],
                                       atol=1e-5, rtol=0)
            num_compared += 1
    assert num_compared == len(COMPARED_STEPS) * len(run.specs)
