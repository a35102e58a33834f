"""The worker side of the KV cache: block ids become rows of a tensor table.

Mirrors ``vllm/v1/worker/``; only the block table lives here (``block_table.py``).
Needs torch (the ``torch`` extra); the core never imports this package.

    >>> from kvref.worker import BlockTable, PAD_SLOT_ID
"""

from kvref.worker.block_table import PAD_SLOT_ID, BlockTable, MultiGroupBlockTable

__all__ = ["PAD_SLOT_ID", "BlockTable", "MultiGroupBlockTable"]
