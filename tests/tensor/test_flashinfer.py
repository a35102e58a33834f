"""FlashInfer's page-table form names the same keys as the block table."""

from __future__ import annotations

import pytest
import torch

from kvref.attention import flashinfer_paged_attention, to_flashinfer

from .driver import DEVICES, Run, window_of
from .test_paged_attention import CONFIGS, mixed_run

# vLLM's FlashInfer backend serves chunked-local layers through "virtual
# batches" (one per chunk), a different construction; it is left out here.
FLASHINFER_CONFIGS = [c for c in CONFIGS if "chunked" not in c]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", FLASHINFER_CONFIGS)
def test_flashinfer_form_gives_the_block_tables_output(config, device):
    run = Run(num_blocks=48, device=device, **CONFIGS[config])
    for step in mixed_run(run):
        for gb in step.groups:
            spec = run.specs[gb.group]
            page_size = run.kernel_block_sizes[gb.group]
            table = to_flashinfer(gb.block_table, step.seq_lens, page_size)
            num_pages = table.kv_indptr.diff()
            kv_lens = page_size * (num_pages - 1) + table.kv_last_page_len
            assert kv_lens.tolist() == step.seq_lens
            w = window_of(spec)
            out = flashinfer_paged_attention(
                gb.query, run.caches[gb.group], qo_indptr=step.query_start_loc,
                kv_indptr=table.kv_indptr, kv_indices=table.kv_indices,
                kv_last_page_len=table.kv_last_page_len, scale=run.scale,
                window_left=-1 if w is None else w - 1).output
            torch.testing.assert_close(out, gb.output, atol=1e-6, rtol=0)


def test_to_flashinfer_takes_each_rows_used_pages():
    table = to_flashinfer(torch.tensor([[7, 2, 0, 0], [3, 5, 1, 9]]), [8, 9], 4)
    assert table.kv_indptr.tolist() == [0, 2, 5]
    assert table.kv_indices.tolist() == [7, 2, 3, 5, 1]
    assert table.kv_last_page_len.tolist() == [4, 1]          # full last page: 4, not 0
    with pytest.raises(ValueError, match="needs 3 pages"):
        to_flashinfer(torch.tensor([[7, 2]]), [9], 4)
