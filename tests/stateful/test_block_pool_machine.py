"""BlockPool against an abstract model: reference counts, an ordered free list,
and a dict from hash to the blocks cached under it.

Owners (``A``, ``B``, ... in order, at most three at a time) stand for
requests: each has a prompt, a block table, and the number of its leading
blocks already cached. They take blocks (fresh or by a prefix hit), cache
them, give single blocks back, hold the null block, and finish, freeing in any
order; in between, blocks are evicted by id and the cache is reset, and owners
index a block under a prefix that ends inside it (partial entries: hashes
every 2 tokens, blocks of 6, so a block has two such boundaries). The model
predicts every answer of the pool (which blocks ``get_new_blocks`` hands out,
what a lookup finds, whether a reset succeeds) and its whole state after every
step; a consumer of the KV events alone must see the same index.

With the null block's guard removed from ``free_blocks``, the shrunk failure
reads (invariant lines left out)::

    state = BlockPoolAgainstAModel()
    state.start_request(group=0, lora=None, prompt='chat-12-then-other')
    Draw 1 (owner): 'A'
    state.hold_null_block(data=data(...))
    Draw 2 (owner): 'A'
    Draw 3 (free order): [0]
    state.finish(data=data(...))
    AssertionError: INV-POOL-3: the null block is in the free queue
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref.verify.invariants import check

from . import backend
from .backend import (
    BlockHashListWithBlockSize,
    BlockPool,
    KVCacheBlock,
    LoRARequest,
    Request,
    free_blocks_in_order,
    get_request_block_hasher,
    index_items,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)
from .event_consumer import EventConsumer, assert_consumer_agrees

BLOCK_SIZE = 6
HASH_BLOCK_SIZE = 2       # request.block_hashes: one every 2 tokens
NUM_BLOCKS = 10           # the null block and 9 usable ones
MAX_OWNERS = 3
PROMPTS = {
    "chat-24": list(range(100, 124)),                                  # 4 full blocks
    "chat-12-then-other": list(range(100, 112)) + list(range(200, 212)),  # shares 2
    "chat-9": list(range(100, 109)),                                   # 1 full, 4 more hashed
    "other-16": list(range(300, 316)),
}


def full_block_hashes(request: Request) -> BlockHashListWithBlockSize:
    return BlockHashListWithBlockSize(request.block_hashes, HASH_BLOCK_SIZE, BLOCK_SIZE)


@dataclass
class Owner:
    request: Request
    group: int
    table: list[KVCacheBlock] = field(default_factory=list)  # released slots hold the null block
    num_cached: int = 0
    null_holds: int = 0       # references taken on the null block with touch()


class BlockPoolAgainstAModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        init_none_hash(sha256)
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=HASH_BLOCK_SIZE,
                              enable_kv_cache_events=True)
        self.owners: dict[str, Owner] = {}
        self.started = 0
        # The model.
        self.refs = {i: 0 for i in range(1, NUM_BLOCKS)}
        self.free_list = list(range(1, NUM_BLOCKS))          # head first
        self.hash_of: dict[int, bytes] = {}                   # block id -> index key
        self.covers: dict[int, int] = {}                      # block id -> tokens its key covers
        self.extra_keys: dict[int, list[bytes]] = {}          # block id -> partial-entry keys
        self.index: dict[bytes, list[int]] = {}               # key -> block ids, oldest first
        self.consumer = EventConsumer()

    # -- model helpers ----------------------------------------------------------

    def _uncache(self, block_id: int) -> None:
        """The block leaves the index under its key and every partial-entry key."""
        keys = [self.hash_of.pop(block_id)] if block_id in self.hash_of else []
        keys += self.extra_keys.pop(block_id, [])
        self.covers.pop(block_id, None)
        for key in keys:
            self.index[key].remove(block_id)
            if not self.index[key]:
                del self.index[key]

    def _release(self, blocks: list[KVCacheBlock]) -> None:
        """The model of free_blocks: a block reaching 0 goes to the head if it has
        no hash (nobody can hit it), to the tail if cached (evicted last)."""
        uncached, cached = [], []
        for block in blocks:
            if block.is_null:
                continue
            self.refs[block.block_id] -= 1
            if self.refs[block.block_id] == 0:
                (cached if block.block_id in self.hash_of else uncached).append(block.block_id)
        self.free_list = uncached + self.free_list + cached

    # -- requests come and take blocks -------------------------------------------
    # A rule that acts on an owner draws it from those it applies to; the story
    # shows the draw as "Draw 1 (owner): 'A'" just before the step.

    def _pick(self, data, names) -> Owner:
        return self.owners[data.draw(st.sampled_from(sorted(names)), label="owner")]

    @precondition(lambda self: len(self.owners) < MAX_OWNERS)
    @rule(prompt=st.sampled_from(sorted(PROMPTS)), lora=st.sampled_from([None, "sql-lora"]),
          group=st.integers(0, 1))
    def start_request(self, prompt, lora, group):
        """A new owner (A, B, C, ... in order) with this prompt, caching into ``group``."""
        name = chr(ord("A") + self.started % 26)
        self.started += 1
        request = Request(f"req-{name}", PROMPTS[prompt],
                          block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
                          lora_request=LoRARequest(lora, 1) if lora else None)
        self.owners[name] = Owner(request, group)

    @precondition(lambda self: self.index)
    @rule(prompt=st.sampled_from(sorted(PROMPTS)), lora=st.sampled_from([None, "sql-lora"]),
          group=st.integers(0, 1))
    def look_up(self, prompt, lora, group):
        """Look a prompt up at every hash boundary without taking blocks: each
        finds the oldest copy cached under that prefix (full or partial), or nothing."""
        request = Request("lookup", PROMPTS[prompt],
                          block_hasher=get_request_block_hasher(HASH_BLOCK_SIZE, sha256),
                          lora_request=LoRARequest(lora, 1) if lora else None)
        for i, block_hash in enumerate(request.block_hashes):
            found = self.pool.get_cached_block(block_hash, [group])
            key = make_block_hash_with_group_id(block_hash, group)
            expected = self.index.get(key, [None])[0]
            got = None if found is None else found[0].block_id
            assert got == expected, (f"INV-HASH-1: block {i} of {prompt!r} found {got}, "
                                     f"the oldest cached copy is {expected}")

    @precondition(lambda self: any(not o.table for o in self.owners.values()))
    @rule(data=st.data())
    def hit_cached_prefix(self, data):
        """A new request looks its blocks up hash by hash and takes the cached prefix."""
        o = self._pick(data, [n for n, o in self.owners.items() if not o.table])
        hit = []
        for block_hash in full_block_hashes(o.request):
            found = self.pool.get_cached_block(block_hash, [o.group])
            key = make_block_hash_with_group_id(block_hash, o.group)
            expected = self.index.get(key, [None])[0]
            got = None if found is None else found[0].block_id
            assert got == expected, (
                f"INV-HASH-1: lookup of {o.request.request_id}'s block {len(hit)} found "
                f"{got}, the oldest cached copy is {expected}")
            if found is None:
                break
            hit.append(found[0])
        self.pool.touch(hit)
        for block in hit:
            if self.refs[block.block_id] == 0:
                self.free_list.remove(block.block_id)
            self.refs[block.block_id] += 1
        o.table = hit
        o.num_cached = len(hit)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), num_blocks=st.integers(0, 5))
    def allocate(self, data, num_blocks):
        """Take ``num_blocks`` fresh blocks from the head of the free queue."""
        o = self._pick(data, self.owners)
        if num_blocks > len(self.free_list):
            with pytest.raises(ValueError):   # and nothing is taken
                self.pool.get_new_blocks(num_blocks)
            return
        got = [b.block_id for b in self.pool.get_new_blocks(num_blocks)]
        expected, self.free_list = self.free_list[:num_blocks], self.free_list[num_blocks:]
        assert got == expected, (f"INV-EVICT-1: get_new_blocks({num_blocks}) gave {got}; "
                                 f"the head of the free queue was {expected}")
        for block_id in got:
            self._uncache(block_id)   # reused: its old content is gone
            self.refs[block_id] = 1
        o.table.extend(self.pool.blocks[i] for i in got)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def hold_null_block(self, data):
        """Take a reference on the null block (touch never queues or unqueues it)."""
        o = self._pick(data, self.owners)
        self.pool.touch([self.pool.null_block])
        o.null_holds += 1

    @precondition(lambda self: any(o.table for o in self.owners.values()))
    @rule(data=st.data(), num_full_blocks=st.integers(0, 6))
    def cache(self, data, num_full_blocks):
        """The owner's first ``num_full_blocks`` blocks are full: index them."""
        o = self._pick(data, [n for n, o in self.owners.items() if o.table])
        hashes = full_block_hashes(o.request)
        num_full = min(num_full_blocks, len(o.table), len(hashes))
        self.pool.cache_full_blocks(o.request, o.table, o.num_cached, num_full,
                                    BLOCK_SIZE, o.group)
        for i in range(o.num_cached, num_full):
            block = o.table[i]
            if block.is_null:
                continue
            self._uncache(block.block_id)   # a partial entry grows into the full key
            key = make_block_hash_with_group_id(hashes[i], o.group)
            self.hash_of[block.block_id] = key
            self.covers[block.block_id] = (i + 1) * BLOCK_SIZE
            self.index.setdefault(key, []).append(block.block_id)
        o.num_cached = max(o.num_cached, num_full)

    @precondition(lambda self: any(o.table for o in self.owners.values()))
    @rule(data=st.data(), position=st.integers(0, 5), inside=st.sampled_from([2, 4]))
    def cache_partial(self, data, position, inside):
        """Index the owner's block at ``position`` under its prefix ending
        ``inside`` tokens into that block (a hit block gets an extra key; a
        block being filled gets its key replaced by longer ones)."""
        o = self._pick(data, [n for n, o in self.owners.items() if o.table])
        position = min(position, len(o.table) - 1)
        block, num_tokens = o.table[position], position * BLOCK_SIZE + inside
        if block.is_null:   # a released slot: nothing, not even the arguments checked
            assert self.pool.cache_partial_block(o.request, block, num_tokens, o.group,
                                                 BLOCK_SIZE) is None
            return
        if num_tokens > len(o.request.block_hashes) * HASH_BLOCK_SIZE:
            with pytest.raises(AssertionError):   # the request has no hash that far
                self.pool.cache_partial_block(o.request, block, num_tokens, o.group, BLOCK_SIZE)
            return
        got = self.pool.cache_partial_block(o.request, block, num_tokens, o.group, BLOCK_SIZE)
        key = make_block_hash_with_group_id(
            o.request.block_hashes[num_tokens // HASH_BLOCK_SIZE - 1], o.group)
        assert got == key, "cache_partial_block returned another key than the prefix's hash"
        bid = block.block_id
        if key == self.hash_of.get(bid) or key in self.extra_keys.get(bid, []):
            return                                 # already there: nothing changes
        if bid in self.hash_of and self.covers[bid] < num_tokens:
            self._uncache(bid)                     # the longer prefix replaces it
        if bid in self.hash_of:
            self.extra_keys.setdefault(bid, []).append(key)
        else:
            self.hash_of[bid], self.covers[bid] = key, num_tokens
        self.index.setdefault(key, []).append(bid)

    # -- blocks go back ---------------------------------------------------------

    @precondition(lambda self: any(o.table for o in self.owners.values()))
    @rule(data=st.data(), position=st.integers(0, 5))
    def release_block(self, data, position):
        """The owner no longer needs one block (it left a sliding window):
        free it and keep the null block in its place."""
        o = self._pick(data, [n for n, o in self.owners.items() if o.table])
        position = min(position, len(o.table) - 1)
        block = o.table[position]
        if block.is_null:
            return
        o.table[position] = self.pool.null_block
        self.pool.free_blocks([block])
        self._release([block])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def finish(self, data):
        """Free every reference the owner holds, in an order drawn at random."""
        o = self._pick(data, self.owners)
        del self.owners[next(n for n, x in self.owners.items() if x is o)]
        held = [b.block_id for b in o.table if not b.is_null] + [0] * o.null_holds
        order = [self.pool.blocks[i] for i in data.draw(st.permutations(held), label="free order")]
        self.pool.free_blocks(order)
        self._release(order)
        # Freeing again a block that is now free is refused and changes nothing.
        now_free = [b for b in order if not b.is_null and self.refs[b.block_id] == 0]
        if now_free and backend.checks("double free refused"):
            with pytest.raises(ValueError):
                self.pool.free_blocks([now_free[0]])

    # -- the cache is trimmed -----------------------------------------------------

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def evict(self, data):
        """Drop a block from the prefix cache by id (a KV connector lost it). The
        draw may also name the null block (nothing happens) or an id outside the
        pool (refused)."""
        block_id = data.draw(st.sampled_from(sorted(self.hash_of) + [0, NUM_BLOCKS]),
                             label="block")
        if block_id >= NUM_BLOCKS:
            with pytest.raises(backend.EVICT_OUT_OF_RANGE):
                self.pool.evict_blocks({block_id})
            return
        self.pool.evict_blocks({block_id})
        self._uncache(block_id)

    @precondition(lambda self: self.hash_of)
    @rule()
    def reset_prefix_cache(self):
        expected = all(n == 0 for n in self.refs.values())
        assert self.pool.reset_prefix_cache() is expected, (
            f"INV-RESET-1: reset_prefix_cache must succeed exactly when no block is in use "
            f"(in use: {[i for i, n in self.refs.items() if n]})")
        if expected:
            self.hash_of.clear()
            self.covers.clear()
            self.extra_keys.clear()
            self.index.clear()

    # -- invariants -------------------------------------------------------------------
    # Hypothesis prints each invariant after each step of a shrunk story, so
    # they are few, named as statements, and each cites the spec ids it checks.

    @invariant()
    def every_block_is_where_the_model_says(self):
        """INV-POOL-3/6, INV-MGR-1, INV-POOL-4, INV-QUEUE-1..6, INV-EVICT-1/2,
        INV-POOL-5, no leaks: the null block stays out of everything; each
        ref_cnt is the model's count and the owners' holdings; the free queue,
        walked both ways, is the model's list (least recently freed first);
        usage is the used fraction; with no owner holding blocks, all are free."""
        null = self.pool.null_block
        assert null is self.pool.blocks[0] and null.is_null
        assert null.prev_free_block is None and null.next_free_block is None, \
            "INV-POOL-3: the null block is in the free queue"
        assert null.block_hash is None, "INV-POOL-3: the null block has a hash"
        assert not any(b.is_null for b in self.pool.blocks[1:]), "INV-POOL-2: a second null block"

        holders = {i: 0 for i in range(1, NUM_BLOCKS)}
        for o in self.owners.values():
            for block in o.table:
                if not block.is_null:
                    holders[block.block_id] += 1
        actual = {b.block_id: b.ref_cnt for b in self.pool.blocks[1:]}
        assert actual == self.refs, f"INV-MGR-1: ref_cnt {actual}, model {self.refs}"
        assert holders == self.refs, f"INV-MGR-1: holders {holders}, model {self.refs}"

        queue = self.pool.free_block_queue
        forward = [b.block_id for b in free_blocks_in_order(queue)]
        backward, node = [], queue.fake_free_list_tail.prev_free_block
        while node is not queue.fake_free_list_head and len(backward) <= NUM_BLOCKS:
            backward.append(node.block_id)
            node = node.prev_free_block
        assert backward == forward[::-1], f"INV-QUEUE-1: forward {forward}, backward {backward}"
        assert queue.num_free_blocks == len(forward), "INV-QUEUE-2: stale num_free_blocks"
        assert forward == self.free_list, \
            f"INV-EVICT-1: free queue {forward}, model (eviction order) {self.free_list}"

        used = sum(1 for n in self.refs.values() if n)
        usage = self.pool.get_usage()
        assert 0.0 <= usage <= 1.0, f"INV-POOL-5: usage {usage}"
        assert usage == pytest.approx(used / (NUM_BLOCKS - 1)), \
            f"INV-POOL-5: usage {usage}, {used} of {NUM_BLOCKS - 1} blocks in use"
        if not any(o.table for o in self.owners.values()):
            assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1, (
                f"INV-MGR-1 (leak): nobody holds a block, yet only "
                f"{self.pool.get_num_free_blocks()} of {NUM_BLOCKS - 1} are free")

    @invariant()
    def cache_index_is_the_model_index(self):
        """INV-HASH-1/2/5, INV-EVT-1: every block's hash, its partial-entry keys
        and the hash -> blocks map
        are the model's (a hit takes the oldest copy), and the index rebuilt
        from the KV events alone is the same."""
        hashes = {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash}
        assert hashes == self.hash_of, "INV-HASH-1: block hashes differ from the model"
        covers = {b.block_id: b.block_hash_num_tokens for b in self.pool.blocks if b.block_hash}
        assert covers == self.covers, f"block_hash_num_tokens {covers}, model {self.covers}"
        assert backend.partial_entry_keys(self.pool.cached_block_hashes_by_block) == \
            backend.partial_entry_keys(self.extra_keys), \
            "INV-HASH-5: the partial-entry keys differ from the model"
        index = {}
        for key, block in index_items(self.pool.cached_block_hash_to_block):
            index.setdefault(key, []).append(block.block_id)
        assert index == self.index, "INV-HASH-2: the index differs from the model"
        self.consumer.apply(self.pool.take_events())
        assert_consumer_agrees(self.consumer, self.pool)

    @invariant()
    def kvref_checker_finds_nothing(self):
        """INV-POOL-*, INV-QUEUE-*, INV-HASH-*: kvref's own snapshot checker agrees."""
        check(self.pool)


TestBlockPoolAgainstAModel = BlockPoolAgainstAModel.TestCase
