"""FreeKVCacheBlockQueue against a plain Python list.

The list is the specification ("the free blocks, in eviction order"); the
queue is the O(1) doubly linked version. Every operation is applied to both,
and after every step the queue is walked head to tail *and* tail to head, so a
forgotten ``prev`` link fails at the step that forgot it. A story reads::

    state = FreeQueueAgainstAList()
    state.build(initially_free=[3, 1, 4])
    state.revive(block=1)                   # a cache hit pulls 1 out of the middle
    state.take_from_head()                  # -> 3
    Draw 1 (blocks): [3, 1]
    state.give_back_at_tail(data=data(...))
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from . import backend
from .backend import FreeKVCacheBlockQueue, KVCacheBlock

NUM_BLOCKS = 8
block_ids = st.integers(0, NUM_BLOCKS - 1)


class FreeQueueAgainstAList(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
        self.queue = FreeKVCacheBlockQueue([])
        self.model: list[int] = []  # block ids, head first

    @initialize(initially_free=st.lists(block_ids, unique=True))
    def build(self, initially_free):
        """The queue starts with these blocks, in this order."""
        self.queue = FreeKVCacheBlockQueue([self.blocks[i] for i in initially_free])
        self.model = list(initially_free)

    def _outside(self) -> list[int]:
        return [i for i in range(NUM_BLOCKS) if i not in self.model]

    # -- taking blocks out ----------------------------------------------------

    @rule()
    def take_from_head(self):
        if not self.model:
            with pytest.raises(ValueError):
                self.queue.popleft()
            return
        assert self.queue.popleft() is self.blocks[self.model.pop(0)]

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def take_n_from_head(self, n):
        if n > len(self.model):
            with pytest.raises(backend.POPLEFT_N_TOO_MANY):  # and nothing is taken
                self.queue.popleft_n(n)
            return
        taken = self.queue.popleft_n(n)
        expected, self.model = self.model[:n], self.model[n:]
        assert [b.block_id for b in taken] == expected

    @rule(block=block_ids)
    def revive(self, block):
        """A prefix hit pulls a block out of the middle of the queue."""
        if block not in self.model:
            with pytest.raises(RuntimeError):  # not free: refused, nothing changes
                self.queue.remove(self.blocks[block])
            return
        self.queue.remove(self.blocks[block])
        self.model.remove(block)

    # -- putting blocks back --------------------------------------------------

    @rule(block=block_ids)
    def give_back_one_at_tail(self, block):
        if block in self.model:
            if not backend.checks("append of a free block refused"):
                return
            with pytest.raises(RuntimeError):  # already free: refused, nothing changes
                self.queue.append(self.blocks[block])
            return
        self.queue.append(self.blocks[block])
        self.model.append(block)

    @rule(data=st.data())
    def give_back_at_tail(self, data):
        chosen = self._draw_outside(data)
        self.queue.append_n([self.blocks[i] for i in chosen])
        self.model = self.model + chosen

    @rule(data=st.data())
    def give_back_at_head(self, data):
        chosen = self._draw_outside(data)
        self.queue.prepend_n([self.blocks[i] for i in chosen])
        self.model = chosen + self.model

    def _draw_outside(self, data) -> list[int]:
        outside = self._outside()
        if not outside:
            return []
        return data.draw(st.lists(st.sampled_from(outside), unique=True), label="blocks")

    # -- invariants -------------------------------------------------------------

    @invariant()
    def walks_both_ways_give_the_model(self):
        """INV-QUEUE-1, INV-QUEUE-2: one chain head -> tail, linked both ways,
        holding exactly the model's blocks in the model's order."""
        head, tail = self.queue.fake_free_list_head, self.queue.fake_free_list_tail
        assert head.prev_free_block is None and tail.next_free_block is None, \
            "INV-QUEUE-1: a sentinel links outward"
        forward, node = [], head
        while node.next_free_block is not tail:
            nxt = node.next_free_block
            assert nxt is not None, f"INV-QUEUE-1: the forward walk stops after {forward}"
            assert nxt.prev_free_block is node, (
                f"INV-QUEUE-1: block {nxt.block_id}'s prev link does not point back "
                f"(forward walk so far {forward})")
            forward.append(nxt.block_id)
            assert len(forward) <= NUM_BLOCKS, "INV-QUEUE-1: the chain has a cycle"
            node = nxt
        backward, node = [], tail
        while node.prev_free_block is not head:
            prev = node.prev_free_block
            assert prev is not None, f"INV-QUEUE-1: the backward walk stops after {backward}"
            assert prev.next_free_block is node, (
                f"INV-QUEUE-1: block {prev.block_id}'s next link does not point forward")
            backward.append(prev.block_id)
            assert len(backward) <= NUM_BLOCKS, "INV-QUEUE-1: the chain has a cycle"
            node = prev
        assert forward == self.model, f"INV-QUEUE-1: queue {forward}, model {self.model}"
        assert backward == self.model[::-1], \
            f"INV-QUEUE-1: backward walk {backward}, model reversed {self.model[::-1]}"
        assert self.queue.num_free_blocks == len(self.model), (
            f"INV-QUEUE-2: num_free_blocks {self.queue.num_free_blocks}, "
            f"{len(self.model)} blocks on the chain")
        assert [b.block_id for b in self.queue.get_all_free_blocks()] == self.model

    @invariant()
    def blocks_outside_have_no_links(self):
        """INV-QUEUE-6: a block that is not free carries no queue links."""
        for i in self._outside():
            block = self.blocks[i]
            assert block.prev_free_block is None and block.next_free_block is None, \
                f"INV-QUEUE-6: block {i} is not in the queue but still linked"


TestFreeQueueAgainstAList = FreeQueueAgainstAList.TestCase
