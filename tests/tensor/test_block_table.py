"""BlockTable / MultiGroupBlockTable: rows from the manager, slots, kernel blocks."""

from __future__ import annotations

import pytest
import torch

from kvref import FullAttentionSpec, SlidingWindowSpec
from kvref.worker import PAD_SLOT_ID, BlockTable, MultiGroupBlockTable

from .driver import DEVICES, Run


def test_slot_mapping_follows_the_formula_and_pads_with_minus_one():
    bt = BlockTable(block_size=4, max_num_reqs=3, max_num_blocks_per_req=4,
                    max_num_batched_tokens=10)
    bt.add_row([7, 2, 9], 0)
    bt.add_row([5], 1)
    # request 0: positions 6..8 (a chunk), request 1: position 2 (a decode), 2 padding
    slots = bt.compute_slot_mapping(2, torch.tensor([0, 3, 4]),
                                    torch.tensor([6, 7, 8, 2, 0, 0]))
    assert slots.tolist() == [2 * 4 + 2, 2 * 4 + 3, 9 * 4 + 0, 5 * 4 + 2,
                              PAD_SLOT_ID, PAD_SLOT_ID]
    assert bt.slot_mapping.tolist()[6:] == [PAD_SLOT_ID] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_slot_mapping_of_manager_tables_names_each_tokens_block(device):
    """Every slot lies in the block the manager gave for that position."""
    run = Run([FullAttentionSpec(4, num_kv_heads=2, head_size=8),
               SlidingWindowSpec(4, num_kv_heads=2, head_size=8, sliding_window=5)],
              num_blocks=32, device=device)
    run.add_request("a", list(range(13)))
    run.add_request("b", list(range(13)) + [9, 9])          # hits a's first blocks later
    step1 = run.step({"a": 13})
    step2 = run.step({"b": 15})
    for step in (step1, step2):
        for gb in step.groups:
            assert gb.slot_mapping.device.type == torch.device(device).type
            for r, req_id in enumerate(step.req_ids):
                ids = run.manager.get_block_ids(req_id)[gb.group]
                lo, hi = step.query_start_loc[r], step.query_start_loc[r + 1]
                for i, pos in zip(range(lo, hi), step.positions[lo:hi]):
                    assert int(gb.slot_mapping[i]) == ids[pos // 4] * 4 + pos % 4
    # b's first 12 tokens were a prefix hit: its row starts with a's blocks
    assert run.manager.get_block_ids("b")[0][:3] == run.manager.get_block_ids("a")[0][:3]


def test_row_operations_move_whole_rows():
    bt = BlockTable(4, 4, 5, 8)
    bt.add_row([1, 2], 0)
    bt.append_row([3], 0)
    bt.add_row([4], 1)
    assert bt.row(0) == [1, 2, 3] and bt.row(1) == [4]
    bt.swap_row(0, 1)
    assert bt.row(0) == [4] and bt.row(1) == [1, 2, 3]
    bt.move_row(1, 3)
    assert bt.row(3) == [1, 2, 3]
    bt.clear_row(1)
    assert bt.row(1) == [] and bt.block_table[1].tolist() == [0] * 5
    bt.add_row([6], 3)                       # add_row replaces, append_row extends
    assert bt.row(3) == [6]
    assert bt.get_device_tensor(2).tolist() == [[4, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_device_tensor_is_a_snapshot():
    bt = BlockTable(4, 2, 3, 8)
    bt.add_row([5], 0)
    snapshot = bt.get_device_tensor(1)
    bt.append_row([6], 0)
    assert snapshot.tolist() == [[5, 0, 0]]


def test_map_to_kernel_blocks_splits_each_manager_block():
    assert BlockTable.map_to_kernel_blocks([0, 1, 2], 2) == [0, 1, 2, 3, 4, 5]
    assert BlockTable.map_to_kernel_blocks([3, 0], 4) == [12, 13, 14, 15, 0, 1, 2, 3]
    assert BlockTable.map_to_kernel_blocks([3, 0], 1) == [3, 0]


def test_kernel_blocks_give_the_same_slots_as_manager_blocks():
    """A manager block of 8 is 2 kernel blocks of 4 in the same memory: every
    token keeps its slot number."""
    big = BlockTable(8, 1, 3, 16)
    small = BlockTable(8, 1, 3, 16, kernel_block_size=4)
    for table in (big, small):
        table.add_row([5, 0, 2], 0)
    assert small.block_size == 4 and small.blocks_per_kv_block == 2
    assert small.row(0) == [10, 11, 0, 1, 4, 5]
    positions = torch.arange(16, 24)
    qsl = torch.tensor([0, 8])
    assert torch.equal(big.compute_slot_mapping(1, qsl, positions),
                       small.compute_slot_mapping(1, qsl, positions))


def test_multi_group_table_takes_get_block_ids_tuples():
    run = Run([FullAttentionSpec(8, num_kv_heads=2, head_size=8),
               SlidingWindowSpec(4, num_kv_heads=2, head_size=8, sliding_window=5)],
              num_blocks=32)
    run.add_request("a", list(range(20)))
    run.step({"a": 20})
    ids = run.manager.get_block_ids("a")
    mg = MultiGroupBlockTable(2, 96, 32, "cpu", [8, 4], kernel_block_sizes=[4, 4])
    mg.add_row(ids, 1)
    assert len(mg) == 2
    assert mg[0].row(1) == BlockTable.map_to_kernel_blocks(ids[0], 2)
    assert mg[1].row(1) == ids[1]
    full_slots, swa_slots = mg.compute_slot_mapping(2, torch.tensor([0, 0, 1]),
                                                    torch.tensor([19]))
    assert full_slots.tolist() == [ids[0][2] * 8 + 3]
    assert swa_slots.tolist() == [ids[1][4] * 4 + 3]
    with pytest.raises(ValueError, match="block ids for 1 groups"):
        mg.append_row(([1],), 0)


@pytest.mark.parametrize("make,match", [
    (lambda: BlockTable(6, 1, 1, 1, kernel_block_size=4), "must divide"),
    (lambda: BlockTable(0, 1, 1, 1), "block_size must be a positive int"),
    (lambda: MultiGroupBlockTable(1, 16, 8, "cpu", [4, 4], [4]), "one entry per group"),
])
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_rows_and_positions_are_refused():
    bt = BlockTable(4, 2, 2, 8)
    with pytest.raises(ValueError, match="max_num_blocks_per_req=2"):
        bt.add_row([1, 2, 3], 0)
    with pytest.raises(IndexError, match="max_num_reqs=2"):
        bt.add_row([1], 2)
    bt.add_row([1], 0)
    with pytest.raises(ValueError, match="position 4 needs block 1"):
        bt.compute_slot_mapping(1, torch.tensor([0, 1]), torch.tensor([4]))
