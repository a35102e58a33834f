"""kvref explain's gate record: a KVCacheManager subclass outside the core that
keeps the numbers each allocate_slots call weighed and changes no answer."""

from __future__ import annotations

import pytest

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, Request,
                   RequestStatus, SlidingWindowSpec, get_request_block_hasher, init_none_hash,
                   sha256)
from kvref.viz.gates import GateRecordingKVCacheManager

BLOCK = 4


@pytest.fixture(autouse=True)
def _seed_hash_chain():
    init_none_hash(sha256)


def manager(cls, num_blocks: int, spec=None, **kwargs) -> KVCacheManager:
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"],
                                                         spec or FullAttentionSpec(BLOCK))])
    return cls(config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
               **kwargs)


def request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)),
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_each_call_gets_its_own_record_of_the_capacity_gate():
    m = manager(GateRecordingKVCacheManager, 4)            # 3 usable blocks
    a = request("a", 16)
    assert m.last_allocate_slots is None
    assert m.allocate_slots(a, 16) is None
    refused = m.last_allocate_slots
    assert (refused.num_free_blocks, refused.num_blocks_needed,
            refused.num_available_blocks, refused.refused_by) == (3, 4, 3, "capacity")
    assert m.allocate_slots(a, 12) is not None
    admitted = m.last_allocate_slots
    assert admitted is not refused and refused.refused_by == "capacity"
    assert (admitted.num_blocks_needed, admitted.refused_by) == (3, None)


def test_full_sequence_gate_watermark_and_reserved_blocks_are_recorded():
    m = manager(GateRecordingKVCacheManager, 11, watermark=0.2)   # 10 usable, watermark 2
    a = request("a", 40)
    assert m.allocate_slots(a, 8, full_sequence_must_fit=True) is None   # 10 + 2 > 10
    gates = m.last_allocate_slots
    assert (gates.watermark_blocks, gates.full_sequence_blocks, gates.num_blocks_needed,
            gates.refused_by) == (2, 10, None, "full-sequence")
    assert m.allocate_slots(a, 8, reserved_blocks=3) is not None
    gates = m.last_allocate_slots
    assert (gates.full_sequence_blocks, gates.num_blocks_needed,
            gates.num_available_blocks, gates.refused_by) == (None, 2, 7, None)
    a.status = RequestStatus.RUNNING                      # the watermark is for admissions
    a.num_computed_tokens = 8
    m.allocate_slots(a, 4)
    assert m.last_allocate_slots.watermark_blocks == 0


def test_blocks_freed_left_of_the_window_are_counted():
    spec = SlidingWindowSpec(BLOCK, sliding_window=4)
    m = manager(GateRecordingKVCacheManager, 10, spec)
    a = request("a", 24)
    a.status = RequestStatus.RUNNING
    m.allocate_slots(a, 16)
    a.num_computed_tokens = 16
    m.allocate_slots(a, 8)
    gates = m.last_allocate_slots                         # blocks 1-3 fall out of the window
    assert (gates.num_free_blocks, gates.num_freed_blocks, gates.num_available_blocks) == (5, 3, 8)
    assert m.get_block_ids("a") == ([0, 0, 0, 4, 5, 6],)


def test_a_call_that_raises_before_its_gates_leaves_the_last_record():
    m = manager(GateRecordingKVCacheManager, 4)
    a = request("a", 8)
    m.allocate_slots(a, 8)
    kept = m.last_allocate_slots
    with pytest.raises(ValueError):
        m.allocate_slots(a, 0)
    assert m.last_allocate_slots is kept


def test_the_recording_manager_answers_as_the_core_manager():
    """Same calls, same block ids and the same refusals as KVCacheManager."""
    answers = []
    for cls in (KVCacheManager, GateRecordingKVCacheManager):
        m, seen = manager(cls, 6, watermark=0.2), []
        for i, n in enumerate((8, 12, 20, 4, 16)):
            r = request(f"r{i}", n)
            blocks = m.allocate_slots(r, n, full_sequence_must_fit=i % 2 == 0)
            seen.append(None if blocks is None else blocks.get_block_ids())
            if i == 1:
                m.free(r)
        answers.append(seen)
    assert answers[0] == answers[1] and None in answers[0]


def test_the_core_manager_keeps_no_gates():
    m = manager(KVCacheManager, 4)
    m.allocate_slots(request("a", 8), 8)
    assert not hasattr(m, "last_allocate_slots") and not hasattr(m, "record_allocate_slots")
