"""FreeKVCacheBlockQueue: the doubly linked list of free blocks.

Every test ends by walking the list both ways (``assert_queue``), so a broken
``prev``/``next`` pointer or a stale ``num_free_blocks`` fails the test that
caused it, not a later one.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def assert_queue(queue: FreeKVCacheBlockQueue, expected_ids: list[int]) -> None:
    """The queue holds exactly ``expected_ids`` in order, linked both ways."""
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    forward, node = [], head.next_free_block
    while node is not tail:
        assert node is not None, "forward walk fell off the list"
        assert node.next_free_block.prev_free_block is node, "next.prev is not self"
        forward.append(node.block_id)
        node = node.next_free_block
    backward, node = [], tail.prev_free_block
    while node is not head:
        assert node is not None, "backward walk fell off the list"
        assert node.prev_free_block.next_free_block is node, "prev.next is not self"
        backward.append(node.block_id)
        node = node.prev_free_block
    assert forward == expected_ids
    assert backward == expected_ids[::-1]
    assert queue.num_free_blocks == len(expected_ids)
    assert ids(queue.get_all_free_blocks()) == expected_ids


def assert_unlinked(*blocks: KVCacheBlock) -> None:
    for block in blocks:
        assert block.prev_free_block is None and block.next_free_block is None


# -- construction -----------------------------------------------------------


def test_new_queue_holds_blocks_in_the_given_order():
    blocks = [KVCacheBlock(3), KVCacheBlock(0), KVCacheBlock(7)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert_queue(queue, [3, 0, 7])


def test_new_queue_from_no_blocks_is_empty_with_sentinels_linked():
    queue = FreeKVCacheBlockQueue([])
    assert_queue(queue, [])
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_sentinels_are_not_returned_as_free_blocks():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    free = queue.get_all_free_blocks()
    assert queue.fake_free_list_head not in free
    assert queue.fake_free_list_tail not in free


# -- popleft / popleft_n ------------------------------------------------------


def test_popleft_returns_the_head_and_unlinks_it():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft()
    assert popped is blocks[0]
    assert_unlinked(popped)
    assert_queue(queue, [1, 2])


def test_popleft_until_empty_follows_queue_order():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 2]
    assert_queue(queue, [])


def test_popleft_on_empty_queue_raises_value_error():
    queue = FreeKVCacheBlockQueue(make_blocks(1))
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert_queue(queue, [])


def test_popleft_n_returns_the_first_n_in_queue_order():
    queue = FreeKVCacheBlockQueue(make_blocks(5))
    popped = queue.popleft_n(3)
    assert ids(popped) == [0, 1, 2]
    assert_unlinked(*popped)
    assert_queue(queue, [3, 4])


def test_popleft_n_of_zero_returns_nothing_and_changes_nothing():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    assert queue.popleft_n(0) == []
    assert_queue(queue, [0, 1])


def test_popleft_n_of_every_block_empties_the_queue():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    assert ids(queue.popleft_n(4)) == [0, 1, 2, 3]
    assert_queue(queue, [])


def test_popleft_n_more_than_free_raises_and_pops_nothing():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    assert_queue(queue, [0, 1, 2])


# -- remove -----------------------------------------------------------------


@pytest.mark.parametrize("victim, left", [(0, [1, 2, 3]), (2, [0, 1, 3]), (3, [0, 1, 2])],
                         ids=["head", "middle", "tail"])
def test_remove_unlinks_a_block_from_head_middle_or_tail(victim, left):
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[victim])
    assert_unlinked(blocks[victim])
    assert_queue(queue, left)


def test_remove_the_only_block_leaves_an_empty_queue():
    blocks = make_blocks(1)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    assert_queue(queue, [])


def test_remove_of_a_block_not_in_the_queue_raises_runtime_error():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    outsider = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(outsider)
    with pytest.raises(RuntimeError):
        queue.remove(KVCacheBlock(99))
    assert_queue(queue, [1, 2])


# -- append / append_n / prepend_n --------------------------------------------


def test_append_puts_the_block_at_the_tail():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    first = queue.popleft()
    queue.append(first)
    assert_queue(queue, [1, 2, 0])


def test_append_to_an_empty_queue():
    queue = FreeKVCacheBlockQueue([])
    queue.append(KVCacheBlock(5))
    assert_queue(queue, [5])


def test_append_n_keeps_the_given_order_at_the_tail():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append_n([blocks[4], blocks[2], blocks[3]])
    assert_queue(queue, [0, 1, 4, 2, 3])


def test_prepend_n_keeps_the_given_order_at_the_head():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.prepend_n([blocks[4], blocks[2], blocks[3]])
    assert_queue(queue, [4, 2, 3, 0, 1])


def test_prepend_n_and_append_n_on_an_empty_queue():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue([])
    queue.prepend_n([blocks[1], blocks[0]])
    assert_queue(queue, [1, 0])
    queue.popleft_n(2)
    queue.append_n([blocks[3], blocks[2]])
    assert_queue(queue, [3, 2])


def test_append_n_and_prepend_n_of_nothing_change_nothing():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    queue.append_n([])
    queue.prepend_n([])
    assert_queue(queue, [0, 1])


def test_append_of_a_block_already_in_the_queue_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(RuntimeError):
        queue.append(blocks[1])
    assert_queue(queue, [0, 1, 2])


@pytest.mark.parametrize("insert", ["append_n", "prepend_n"])
def test_inserting_a_linked_block_raises(insert):
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError):
        getattr(queue, insert)([blocks[0]])


def test_removed_block_can_be_inserted_again():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    queue.prepend_n([blocks[1]])
    assert_queue(queue, [1, 0, 2])


def test_a_mixed_sequence_keeps_links_and_count_in_sync():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)           # 0 1 2 3 4 5
    a, b = queue.popleft_n(2)                        # 2 3 4 5
    queue.remove(blocks[4])                          # 2 3 5
    assert_queue(queue, [2, 3, 5])
    queue.prepend_n([b])                             # 1 2 3 5
    queue.append_n([a, blocks[4]])                   # 1 2 3 5 0 4
    assert_queue(queue, [1, 2, 3, 5, 0, 4])
    queue.remove(blocks[5])                          # 1 2 3 0 4
    assert queue.popleft() is b                      # 2 3 0 4
    assert_queue(queue, [2, 3, 0, 4])


# -- model-based check -------------------------------------------------------


class FreeQueueAgainstAList(RuleBasedStateMachine):
    """The queue behaves like a plain list of free blocks, whatever the order
    of operations; the list is the specification, the queue the O(1) version."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = make_blocks(8)
        self.queue = FreeKVCacheBlockQueue(self.blocks[:5])
        self.model = list(self.blocks[:5])

    def outside(self) -> list[KVCacheBlock]:
        return [b for b in self.blocks if b not in self.model]

    @precondition(lambda self: self.model)
    @rule()
    def take_from_head(self):
        assert self.queue.popleft() is self.model.pop(0)

    @rule(n=st.integers(0, 8))
    def take_n_from_head(self, n):
        if n > len(self.model):
            with pytest.raises(ValueError):
                self.queue.popleft_n(n)
            return
        taken, self.model = self.model[:n], self.model[n:]
        assert self.queue.popleft_n(n) == taken

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def revive_from_anywhere(self, data):
        block = data.draw(st.sampled_from(self.model))
        self.queue.remove(block)
        self.model.remove(block)

    @rule(data=st.data(), at_head=st.booleans())
    def give_back(self, data, at_head):
        outside = self.outside()
        chosen = data.draw(st.permutations(outside)) if outside else []
        chosen = chosen[:data.draw(st.integers(0, len(chosen)))]
        if at_head:
            self.queue.prepend_n(chosen)
            self.model = chosen + self.model
        else:
            self.queue.append_n(chosen)
            self.model = self.model + chosen

    @invariant()
    def queue_matches_model(self):
        assert_queue(self.queue, ids(self.model))
        assert_unlinked(*self.outside())


TestFreeQueueAgainstAList = FreeQueueAgainstAList.TestCase
TestFreeQueueAgainstAList.settings = settings(max_examples=60, stateful_step_count=20,
                                              deadline=None)


def test_a_rejected_append_n_leaves_the_queue_untouched():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(RuntimeError):
        queue.append_n([blocks[2], blocks[0]])   # block 0 is already queued
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1]
    assert queue.num_free_blocks == 2
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
