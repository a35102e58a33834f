"""Block tables and slot mappings of a batch that shrinks and grows over many steps.

vLLM's worker keeps its block table and slot mapping in persistent buffers:
rows are appended to, moved when a request leaves (the last row fills the
hole), swapped, and a step with fewer tokens than the last one writes a
shorter slot mapping into the same buffer. Each check below compares the
buffers, after every step, with a plain model of what the batch holds (a
list of manager block ids per row), so that nothing of a previous step's
longer batch or longer row survives where a kernel would read it:

- every scheduled token's slot is ``row[pos // B] * B + pos % B`` of its
  row now (in kernel blocks after a split), padding tokens get -1;
- the persistent ``slot_mapping`` buffer holds the step's slots and -1 in
  the whole tail, up to ``max_num_batched_tokens``;
- every live row is exactly its request's blocks; vacated rows are empty;
- ``max_model_len`` not a multiple of the block size still gives each row
  ``cdiv(max_model_len, block_size)`` blocks, the last slot included.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.math_utils import cdiv
from kvref.worker import PAD_SLOT_ID, BlockTable, MultiGroupBlockTable


class BatchModel:
    """What the batch holds: per row, its request's manager block ids per group."""

    def __init__(self, num_groups: int) -> None:
        self.rows: list[list[list[int]]] = []       # rows[r][g] = manager block ids
        self.num_groups = num_groups


def expected_slots(ids: list[int], block_size: int, kernel_block_size: int,
                   positions: list[int]) -> list[int]:
    k = block_size // kernel_block_size
    kernel_ids = [b * k + j for b in ids for j in range(k)]
    return [kernel_ids[p // kernel_block_size] * kernel_block_size + p % kernel_block_size
            for p in positions]


GROUP_SHAPES = st.sampled_from([
    # (block_sizes, kernel_block_sizes)
    ([4], [4]), ([3], [3]), ([5], [5]), ([1], [1]), ([8], [2]),
    ([4, 6], [4, 3]), ([6, 2], [3, 1]), ([7, 7], [7, 7]),
])


@settings(max_examples=40, deadline=None)
@given(shape=GROUP_SHAPES, max_model_len=st.integers(1, 45), max_num_reqs=st.integers(1, 5),
       data=st.data())
def test_buffers_follow_a_shrinking_and_growing_batch(shape, max_model_len, max_num_reqs,
                                                      data):
    block_sizes, kernel_sizes = shape
    budget = data.draw(st.integers(1, 40), label="max_num_batched_tokens")
    table = MultiGroupBlockTable(max_num_reqs, max_model_len, budget, "cpu", block_sizes,
                                 kernel_sizes)
    for t, bs, kbs in zip(table.block_tables, block_sizes, kernel_sizes):
        assert t.max_num_blocks_per_req == cdiv(max_model_len, bs) * (bs // kbs)
    model = BatchModel(len(block_sizes))
    lengths: list[int] = []                       # tokens each row's blocks cover
    next_block = 1

    def new_blocks(count_per_group):
        nonlocal next_block
        out = []
        for count in count_per_group:
            out.append(list(range(next_block, next_block + count)))
            next_block += count
        return out

    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        # Requests leave: the last row fills the hole (vLLM's condense).
        for _ in range(data.draw(st.integers(0, len(model.rows)), label="leave")):
            r = data.draw(st.integers(0, len(model.rows) - 1), label="leaving row")
            last = len(model.rows) - 1
            table.clear_row(r)
            if r != last:
                table.move_row(last, r)
                table.clear_row(last)
                model.rows[r], lengths[r] = model.rows[last], lengths[last]
            model.rows.pop()
            lengths.pop()
        # Running rows grow to a new length (new blocks appended).
        for r in range(len(model.rows)):
            new_len = data.draw(st.integers(lengths[r], max_model_len), label="grow")
            added = new_blocks([cdiv(new_len, bs) - len(model.rows[r][g])
                                for g, bs in enumerate(block_sizes)])
            table.append_row(added, r)
            for g in range(model.num_groups):
                model.rows[r][g].extend(added[g])
            lengths[r] = new_len
        # Requests arrive into the free rows at the end.
        while len(model.rows) < max_num_reqs and data.draw(st.booleans(), label="arrive"):
            n = data.draw(st.integers(1, max_model_len), label="arrival length")
            ids = new_blocks([cdiv(n, bs) for bs in block_sizes])
            table.add_row(ids, len(model.rows))
            model.rows.append(ids)
            lengths.append(n)
        if len(model.rows) >= 2 and data.draw(st.booleans(), label="swap"):
            i, j = data.draw(st.permutations(range(len(model.rows))), label="swap")[:2]
            table.swap_row(i, j)
            model.rows[i], model.rows[j] = model.rows[j], model.rows[i]
            lengths[i], lengths[j] = lengths[j], lengths[i]
        if not model.rows:
            continue

        # This step's tokens: the tail of each row, within the budget, then padding.
        room = budget
        query_start_loc, positions = [0], []
        for r, length in enumerate(lengths):
            q = data.draw(st.integers(0, min(length, room)), label="query_len")
            room -= q
            positions.extend(range(length - q, length))
            query_start_loc.append(query_start_loc[-1] + q)
        num_scheduled = len(positions)
        pad = data.draw(st.integers(0, budget - num_scheduled), label="padding")
        positions_t = torch.tensor(positions + [0] * pad, dtype=torch.int64)
        slots = table.compute_slot_mapping(len(model.rows), torch.tensor(query_start_loc),
                                           positions_t)

        for g, (t, bs, kbs) in enumerate(zip(table.block_tables, block_sizes, kernel_sizes)):
            want = []
            for r, ids in enumerate(model.rows):
                want.extend(expected_slots(ids[g], bs, kbs,
                                           positions[query_start_loc[r]:query_start_loc[r + 1]]))
            assert slots[g].tolist() == want + [PAD_SLOT_ID] * pad
            buffer = t.slot_mapping.tolist()
            assert buffer[:num_scheduled] == want
            assert buffer[num_scheduled:] == [PAD_SLOT_ID] * (budget - num_scheduled), (
                "the slot-mapping buffer keeps an earlier step's tail")
            k = bs // kbs
            device_rows = t.get_device_tensor(len(model.rows))
            for r, ids in enumerate(model.rows):
                kernel_ids = [b * k + j for b in ids[g] for j in range(k)]
                assert t.row(r) == kernel_ids
                assert device_rows[r, :len(kernel_ids)].tolist() == kernel_ids
            for r in range(len(model.rows), max_num_reqs):
                assert t.row(r) == [], f"vacated row {r} still holds blocks"


def test_a_full_length_row_of_an_odd_max_model_len_reaches_its_last_slot():
    # 30 tokens, blocks of 4: 8 blocks, the last one holding 2 tokens.
    bt = BlockTable(block_size=4, max_num_reqs=1, max_num_blocks_per_req=cdiv(30, 4),
                    max_num_batched_tokens=30)
    mg = MultiGroupBlockTable(1, 30, 30, "cpu", [4])
    for table in (bt, mg[0]):
        table.add_row(list(range(1, 9)), 0)
        slots = table.compute_slot_mapping(1, torch.tensor([0, 30]), torch.arange(30))
        assert slots[-1].item() == 8 * 4 + 1
        assert slots.tolist() == [(p // 4 + 1) * 4 + p % 4 for p in range(30)]


def test_a_shorter_step_leaves_no_stale_slots_in_the_buffer():
    bt = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=4,
                    max_num_batched_tokens=12)
    bt.add_row([3, 5, 7], 0)
    bt.add_row([2], 1)
    bt.compute_slot_mapping(2, torch.tensor([0, 9, 12]), torch.tensor(list(range(9)) + [0, 1, 2]))
    bt.clear_row(1)
    bt.compute_slot_mapping(1, torch.tensor([0, 1]), torch.tensor([9]))
    assert bt.slot_mapping.tolist() == [7 * 4 + 1] + [PAD_SLOT_ID] * 11
