"""Block tables on tensors: from the manager's block ids to the slot of every token.

Mirrors ``vllm/v1/worker/block_table.py``. The KV cache manager hands out block
ids per request (``KVCacheBlocks.get_block_ids()``); the worker keeps them in a
table with one row per running request, and turns each token's position into a
*slot*, the flat index of the place its key and value are written::

    block size 4, row of request r: [7, 2, 9]
    position    0 1 2 3 | 4 5 6 7 | 8 9
    block       7       | 2       | 9
    slot       28 ... 31| 8 ... 11| 36 37      slot = table[pos // 4] * 4 + pos % 4

Tokens of a padded batch that belong to no request get ``PAD_SLOT_ID`` (-1):
the cache write skips them.

Kernel blocks. An attention kernel may only support some block sizes. When the
manager's block size is a multiple of the kernel's, each manager block is split
into ``k = block_size // kernel_block_size`` consecutive kernel blocks: manager
block ``b`` becomes kernel blocks ``b*k .. b*k+k-1``, which is exactly the same
memory seen as ``k`` times more, ``k`` times smaller pages (the null block 0
becomes kernel blocks ``0 .. k-1``). The table then stores kernel block ids and
``self.block_size`` is the kernel's.

    >>> bt = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=3,
    ...                 max_num_batched_tokens=8)
    >>> bt.add_row([7, 2], row_idx=0)
    >>> bt.append_row([9], row_idx=0)
    >>> bt.compute_slot_mapping(1, torch.tensor([0, 3]), torch.tensor([3, 4, 8])).tolist()
    [31, 8, 36]

Differences from vLLM, for readability: one host tensor instead of a pinned
CPU/GPU buffer pair with an explicit ``commit_block_table`` (``get_device_tensor``
copies the rows it returns), a loop over requests instead of a Triton kernel,
and no context parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvref.attention.paged_attention import PAD_SLOT_ID
from kvref.math_utils import cdiv


class BlockTable:
    """The block tables of one KV cache group, one row per request slot.

    Args:
        block_size: the KV cache manager's block size for this group.
        max_num_reqs: rows of the table (requests running at once).
        max_num_blocks_per_req: manager blocks one row can hold.
        max_num_batched_tokens: length of the slot-mapping buffer.
        device: where ``get_device_tensor`` and ``compute_slot_mapping`` put
            their results.
        kernel_block_size: the attention kernel's block size, if it differs
            from ``block_size``; it must divide ``block_size``.

    ``block_table``: ``[max_num_reqs, max_num_blocks_per_req * k]`` int32 on the
    host, in kernel blocks; ``num_blocks_per_row[r]`` says how much of row ``r``
    is used. Every method is O(blocks touched); ``compute_slot_mapping`` is
    O(num_tokens).
    """

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, device: torch.device | str = "cpu",
                 kernel_block_size: int | None = None) -> None:
        for name, value in (("block_size", block_size), ("max_num_reqs", max_num_reqs),
                            ("max_num_blocks_per_req", max_num_blocks_per_req),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockTable.{name} must be a positive int, got {value!r}")
        if kernel_block_size is None:
            kernel_block_size = block_size
        if kernel_block_size <= 0 or block_size % kernel_block_size != 0:
            raise ValueError(f"kernel_block_size {kernel_block_size} must divide the "
                             f"manager's block_size {block_size} evenly")
        # From here on the table speaks in kernel blocks, as vLLM's does.
        self.block_size = kernel_block_size
        self.blocks_per_kv_block = block_size // kernel_block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        self.block_table = torch.zeros(max_num_reqs, self.max_num_blocks_per_req,
                                       dtype=torch.int32)
        self.num_blocks_per_row = [0] * max_num_reqs
        self.slot_mapping = torch.full((max_num_batched_tokens,), PAD_SLOT_ID,
                                       dtype=torch.int64, device=self.device)

    # -- rows -------------------------------------------------------------------

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append manager block ids (a step's new blocks) to row ``row_idx``."""
        if not block_ids:
            return
        self._check_row(row_idx)
        ids = self.map_to_kernel_blocks(block_ids, self.blocks_per_kv_block)
        start = self.num_blocks_per_row[row_idx]
        end = start + len(ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row_idx} would hold {end} kernel blocks, more than "
                             f"max_num_blocks_per_req={self.max_num_blocks_per_req}")
        self.block_table[row_idx, start:end] = torch.tensor(ids, dtype=torch.int32)
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Make row ``row_idx`` hold exactly ``block_ids`` (a new or resumed request)."""
        self._check_row(row_idx)
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Empty row ``row_idx`` (its request finished or was preempted)."""
        self._check_row(row_idx)
        self.block_table[row_idx, :self.num_blocks_per_row[row_idx]] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` onto row ``tgt`` (the batch is condensed after a removal)."""
        self._check_row(src)
        self._check_row(tgt)
        n = self.num_blocks_per_row[src]
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (the batch is reordered)."""
        self._check_row(src)
        self._check_row(tgt)
        self.block_table[[src, tgt]] = self.block_table[[tgt, src]]
        self.num_blocks_per_row[src], self.num_blocks_per_row[tgt] = \
            self.num_blocks_per_row[tgt], self.num_blocks_per_row[src]

    def row(self, row_idx: int) -> list[int]:
        """The used part of row ``row_idx``, in kernel block ids."""
        self._check_row(row_idx)
        return self.block_table[row_idx, :self.num_blocks_per_row[row_idx]].tolist()

    def _check_row(self, row_idx: int) -> None:
        if not 0 <= row_idx < self.max_num_reqs:
            raise IndexError(f"row {row_idx} out of range: the table has "
                             f"max_num_reqs={self.max_num_reqs} rows")

    # -- tensors for one step -------------------------------------------------

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows, ``[num_reqs, max_num_blocks_per_req]`` int32,
        on ``device`` (a fresh copy: later row edits do not show through)."""
        return self.block_table[:num_reqs].to(self.device, copy=True)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor,
                             positions: torch.Tensor) -> torch.Tensor:
        """The slot of every scheduled token: ``[num_tokens]`` int64 on ``device``.

        ``query_start_loc``: ``[num_reqs + 1]``, request ``r``'s tokens are
        ``query_start_loc[r] : query_start_loc[r + 1]`` and belong to row ``r``;
        ``positions``: ``[num_tokens]``, each token's position in its request.
        Tokens after ``query_start_loc[num_reqs]`` are padding and get
        ``PAD_SLOT_ID``. The same values fill ``self.slot_mapping`` (its tail,
        up to ``max_num_batched_tokens``, is ``PAD_SLOT_ID`` as in vLLM).
        O(num_tokens).
        """
        starts = [int(x) for x in torch.as_tensor(query_start_loc).tolist()]
        pos = torch.as_tensor(positions).to("cpu", torch.int64)
        num_tokens = pos.shape[0]
        if len(starts) < num_reqs + 1:
            raise ValueError(f"query_start_loc has {len(starts)} entries, need "
                             f"num_reqs + 1 = {num_reqs + 1}")
        if num_tokens > self.max_num_batched_tokens or starts[num_reqs] > num_tokens:
            raise ValueError(f"positions has {num_tokens} tokens, query_start_loc ends at "
                             f"{starts[num_reqs]}, max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}")
        # The slots are worked out in Python from one copy of the rows' used part:
        # a few list operations per token instead of ~25 small tensor ops (16-token
        # decode step: ~130 -> ~70 us; a 1,280-token prefill: ~410 -> ~490 us).
        n = starts[num_reqs]
        width = max(self.num_blocks_per_row[:num_reqs], default=0)
        rows = self.block_table[:num_reqs, :width].tolist()
        positions_list = pos[:n].tolist()
        slots = []
        for r in range(num_reqs):
            row, held = rows[r], self.num_blocks_per_row[r]
            for p in positions_list[starts[r]:starts[r + 1]]:
                block_idx = p // self.block_size
                if block_idx >= held:
                    raise ValueError(f"request row {r}: position {p} needs block "
                                     f"{block_idx} but the row holds {held} blocks of "
                                     f"{self.block_size}")
                slots.append(row[block_idx] * self.block_size + p % self.block_size)
        self.slot_mapping[:n] = torch.tensor(slots, dtype=torch.int64).to(self.device)
        self.slot_mapping[n:] = PAD_SLOT_ID
        return self.slot_mapping[:num_tokens].clone()

    @staticmethod
    def map_to_kernel_blocks(kv_manager_block_ids: Sequence[int],
                             blocks_per_kv_block: int) -> list[int]:
        """Split manager blocks into kernel blocks: ``b -> b*k, ..., b*k + k - 1``.

        >>> BlockTable.map_to_kernel_blocks([0, 3], 2)     # k = 2
        [0, 1, 6, 7]
        """
        k = blocks_per_kv_block
        return [int(b) * k + j for b in kv_manager_block_ids for j in range(k)]


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV cache group; rows move together.

    ``append_row``/``add_row`` take the tuple ``KVCacheBlocks.get_block_ids()``
    returns (one list per group). ``max_num_blocks`` defaults to
    ``cdiv(max_model_len, block_size)`` per group; vLLM additionally rounds it up
    for some kernels, which changes nothing a reader sees here.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_batched_tokens: int,
                 device: torch.device | str, block_sizes: Sequence[int],
                 kernel_block_sizes: Sequence[int] | None = None,
                 max_num_blocks: Sequence[int] | None = None) -> None:
        if kernel_block_sizes is None:
            kernel_block_sizes = list(block_sizes)
        if max_num_blocks is None:
            max_num_blocks = [cdiv(max_model_len, bs) for bs in block_sizes]
        if not len(block_sizes) == len(kernel_block_sizes) == len(max_num_blocks):
            raise ValueError(f"block_sizes ({len(block_sizes)}), kernel_block_sizes "
                             f"({len(kernel_block_sizes)}) and max_num_blocks "
                             f"({len(max_num_blocks)}) need one entry per group")
        self.block_tables = [
            BlockTable(bs, max_num_reqs, n, max_num_batched_tokens, device, kbs)
            for bs, kbs, n in zip(block_sizes, kernel_block_sizes, max_num_blocks)]

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(f"got block ids for {len(block_ids)} groups, the table has "
                             f"{len(self.block_tables)}")

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table.add_row(ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table.clear_row(row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.swap_row(src, tgt)

    def compute_slot_mapping(self, num_reqs: int, query_start_loc: torch.Tensor,
                             positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One slot mapping per group (each group has its own blocks and block size)."""
        return tuple(t.compute_slot_mapping(num_reqs, query_start_loc, positions)
                     for t in self.block_tables)

    def __getitem__(self, group_idx: int) -> BlockTable:
        return self.block_tables[group_idx]

    def __len__(self) -> int:
        return len(self.block_tables)
