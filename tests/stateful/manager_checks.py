"""The model-side checks of the scheduler machine, kept apart from its rules.

``ManagerChecks`` is a mixin for ``SchedulerDrivesManager`` (in
``test_kv_cache_manager_machine.py``) and reads the state that machine keeps:
``config``, ``specs``, ``manager``, ``pool``, ``coordinator``, ``live``,
``running``, ``in_flight``, ``observer``, ``consumer``, ``content``,
``content_of_key``, ``key_of_content``, ``states_written_this_step`` and
``tables_seen``. Every failure message starts with the spec id it breaks
(``specs/``), or says plainly what went wrong where no id covers it.
"""

from __future__ import annotations

import pytest
from hypothesis import event

from kvref import CrossAttentionSpec, MambaSpec
from kvref.math_utils import cdiv

from .backend import free_blocks_in_order, index_items
from .event_consumer import assert_consumer_agrees
from .content_model import Content, blocks_read_from, first_token_read


class ManagerChecks:
    """The checks that compare kvref with the machine's model (see the module docstring)."""

    # -- prefix hits, allocations, block contents ----------------------------------

    def _check_hit(self, req, hit, num_hit):
        cfg = self.config
        if not cfg.enable_caching or req.skip_reading_prefix_cache:
            assert num_hit == 0 and hit is self.manager.empty_kv_cache_blocks, (
                f"INV-HIT-1: {req.request_id} may not read the prefix cache "
                "(caching off or skip_reading_prefix_cache), yet got a hit")
            return
        align = cfg.scheduler_block_size
        assert 0 <= num_hit <= req.num_tokens - 1 and num_hit % align == 0, (
            f"INV-HIT-1: {req.request_id} with {req.num_tokens} tokens got a hit of "
            f"{num_hit}; at most {req.num_tokens - 1}, a multiple of {align}")
        # The spec's one exception to INV-HIT-2: with EAGLE, Mamba ignores the
        # dropped block, and the agreed hit can outrun the other groups' blocks.
        eagle_with_mamba = cfg.use_eagle and any(isinstance(s, MambaSpec) for s in self.specs)
        for g, (spec, blocks) in enumerate(zip(self.specs, hit.blocks)):
            if not eagle_with_mamba:
                assert len(blocks) * spec.block_size == num_hit, (
                    f"INV-HIT-2: group {g}'s hit has {len(blocks)} blocks of "
                    f"{spec.block_size}, the hit is {num_hit} tokens")
                for i in blocks_read_from(spec, num_hit):
                    assert not blocks[i].is_null, (
                        f"INV-HIT-2: group {g}'s hit of {num_hit} tokens has the null block "
                        f"at {i}, which the next token reads")
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                expected = self._content_of(req, g, i)
                assert block.block_hash is not None, \
                    f"INV-HIT-3: hit block {block.block_id} of group {g} is not cached"
                assert self.content.get(block.block_id) == expected, (
                    f"INV-HIT-3: block {block.block_id}, hit at position {i} of group {g} for "
                    f"{req.request_id}, holds {self.content.get(block.block_id)}; the request "
                    f"needs {expected}")
        longest = self._longest_usable_hit(req)
        if longest is not None:
            assert num_hit == longest, (
                f"longest hit: {req.request_id} got a hit of {num_hit} tokens, but by the "
                f"model's record of what is cached every group can serve exactly {longest}")

    def _longest_usable_hit(self, req) -> int | None:
        """The longest aligned prefix, at most ``num_tokens - 1``, whose blocks
        each group reads are all cached (by content). None where EAGLE's
        drop-and-recheck makes the answer more than a simple maximum."""
        cfg = self.config
        if cfg.use_eagle and len(self.specs) > 1:
            return None
        cached = {self.content.get(b.block_id) for b in self.pool.blocks
                  if b.block_hash is not None}

        def serves(length):
            return all(self._content_of(req, g, i) in cached
                       for g, spec in enumerate(self.specs)
                       for i in blocks_read_from(spec, length))

        align = cfg.scheduler_block_size
        if cfg.use_eagle:  # one full-attention group: the cached prefix less one block
            length = 0
            while length + align <= req.num_tokens - 1 and serves(length + align):
                length += align
            return max(0, length - align)
        return max(L for L in range(0, req.num_tokens, align) if serves(L))

    def _hit_state_keys(self, hit) -> set[bytes]:
        """The keys of the last block of each Mamba group's hit."""
        return {blocks[-1].block_hash for spec, blocks in zip(self.specs, hit.blocks)
                if isinstance(spec, MambaSpec) and blocks}

    def _hit_reads_unwritten_state(self, hit) -> bool:
        return any(isinstance(spec, MambaSpec) and blocks
                   and blocks[-1].block_id in self.states_written_this_step
                   for spec, blocks in zip(self.specs, hit.blocks))

    def _check_hit_starts_tables(self, name, hit):
        for g, (table, blocks) in enumerate(zip(self.manager.get_blocks(name).blocks,
                                                hit.blocks)):
            for i, block in enumerate(blocks):
                assert table[i] is block or table[i].is_null, (
                    f"group {g} of {name}: table position {i} holds block "
                    f"{table[i].block_id}, the hit gave {block.block_id}")

    def _check_refusal(self, name, before, keeps_blocks=False):
        """INV-ALLOC-1: a refused allocation takes no reference and caches nothing
        (it may still free blocks that left the attention window)."""
        refs_before, hashes_before = before[1], before[2]
        for block_id, refs in self.observer.refs.items():
            assert refs <= refs_before[block_id], \
                f"INV-ALLOC-1: refused allocation for {name} took a reference on block {block_id}"
        new_hashes = {i for i, h in self._hashes().items() if hashes_before.get(i) != h}
        assert not new_hashes, f"INV-ALLOC-1: refused allocation for {name} cached {new_hashes}"
        if not keeps_blocks:
            assert not any(self.manager.get_blocks(name).blocks), \
                f"INV-ALLOC-1: refused admission left {name} holding blocks"

    def _check_step_slots(self, name, computed, n):
        """INV-ALLOC-2: after a successful allocation every token of the step has
        a slot, the lookahead tokens too, and every block the step reads is real."""
        cfg = self.config
        end = computed + n
        for g, (spec, table) in enumerate(zip(self.specs, self.manager.get_blocks(name).blocks)):
            bs = spec.block_size
            if isinstance(spec, CrossAttentionSpec):
                need = cdiv(cfg.encoder_tokens, bs)
                assert len(table) == need and not any(b.is_null for b in table), \
                    f"INV-ALLOC-2: {name}'s cross-attention table {ids(table)}, needs {need} blocks"
                continue
            if isinstance(spec, MambaSpec):
                read = [cdiv(end, bs) - 1] + ([(computed - 1) // bs] if computed else [])
            else:
                slots = cdiv(min(end + cfg.lookahead, cfg.max_model_len), bs)
                assert len(table) >= slots, (f"INV-ALLOC-2: group {g} of {name} has "
                                             f"{len(table)} blocks, needs {slots}")
                read = range(first_token_read(spec, computed) // bs, cdiv(end, bs))
            for i in read:
                assert i < len(table) and not table[i].is_null, (
                    f"INV-ALLOC-2: group {g} of {name}: the step computes tokens "
                    f"{computed}..{end - 1} and reads block position {i}, but the table "
                    f"is {ids(table)}")

    def _record_written_blocks(self, name):
        """The model's memory: a block full of verified tokens holds the request's
        prefix up to its end. A block seen full before must hold the same."""
        req = self.live[name]
        verified = min(req.num_computed_tokens, req.num_tokens)
        if self.config.enable_caching:
            assert len(req.block_hashes) == req.num_tokens // self.config.hash_block_size, \
                f"INV-CHAIN-1: {name} has {len(req.block_hashes)} block hashes"
        for g, (spec, table) in enumerate(zip(self.specs, self.manager.get_blocks(name).blocks)):
            if isinstance(spec, CrossAttentionSpec):
                continue
            for i in range(min(len(table), verified // spec.block_size)):
                block = table[i]
                if block.is_null:
                    continue
                expected = self._content_of(req, g, i)
                held = self.content.setdefault(block.block_id, expected)
                if held is expected and isinstance(spec, MambaSpec):
                    self.states_written_this_step.add(block.block_id)
                assert held == expected, (
                    f"INV-CONTENT-1: block {block.block_id} at position {i} of {name}'s "
                    f"group {g} holds {held}, but {name} computed {expected} there")

    def _content_of(self, req, group, index) -> Content:
        end = (index + 1) * self.specs[group].block_size
        lora = req.lora_request.lora_name if req.lora_request else None
        return Content(group, lora, req.cache_salt, tuple(req.all_token_ids[:end]))

    # ----------------------------------------------------------------- helpers

    def _positions(self, name) -> dict[int, tuple[int, int]]:
        return {b.block_id: (g, i)
                for g, table in enumerate(self.manager.get_blocks(name).blocks)
                for i, b in enumerate(table) if not b.is_null}

    def _hashes(self) -> dict[int, bytes]:
        return {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None}

    def _pool_state(self):
        """(free queue, model refs, block hashes, blocks handed out so far this step)."""
        return (ids(free_blocks_in_order(self.pool.free_block_queue)), dict(self.observer.refs), self._hashes(),
                len(self.observer.handed_out))

    def _holders(self) -> dict[int, int]:
        count = {b.block_id: 0 for b in self.pool.blocks[1:]}
        for name in self.live:
            for table in self.manager.get_blocks(name).blocks:
                for block in table:
                    if not block.is_null:
                        count[block.block_id] += 1
        for _, popped in self.in_flight:
            for block in popped:
                if not block.is_null:
                    count[block.block_id] += 1
        return count

    # -- the invariants' parts ---------------------------------------------------------

    def _check_reference_counts(self):
        actual = {b.block_id: b.ref_cnt for b in self.pool.blocks[1:]}
        holders = self._holders()
        assert actual == holders, f"INV-MGR-1: ref_cnt {diff(actual, holders)} (actual, holders)"
        assert actual == self.observer.refs, \
            f"INV-MGR-1: ref_cnt {diff(actual, self.observer.refs)} (actual, model)"

    def _check_free_queue(self):
        queue = self.pool.free_block_queue
        forward = ids(free_blocks_in_order(queue))
        backward, node = [], queue.fake_free_list_tail.prev_free_block
        while node is not queue.fake_free_list_head and len(backward) <= len(self.pool.blocks):
            backward.append(node.block_id)
            node = node.prev_free_block
        assert backward == forward[::-1], f"INV-QUEUE-1: forward {forward}, backward {backward}"
        assert queue.num_free_blocks == len(forward), "INV-QUEUE-2: stale num_free_blocks"
        unreferenced = sorted(b.block_id for b in self.pool.blocks[1:] if b.ref_cnt == 0)
        assert sorted(forward) == unreferenced, \
            f"INV-QUEUE-4/5: queued {sorted(forward)}, unreferenced {unreferenced}"
        assert forward == self.observer.free_list, (
            f"INV-EVICT-1: free queue {forward}, but the model's eviction order is "
            f"{self.observer.free_list} (unhashed first, then cached least recently "
            "freed first, a request's tail before its head)")

    def _check_null_block(self):
        null = self.pool.null_block
        assert null is self.pool.blocks[0] and null.is_null
        assert null.block_hash is None, "INV-POOL-6: the null block was hashed"
        assert null.prev_free_block is None and null.next_free_block is None, \
            "INV-POOL-6: the null block was put in the free queue"
        assert not any(b.is_null for b in self.pool.blocks[1:]), "INV-POOL-2: a second null block"
        for _key, block in index_items(self.pool.cached_block_hash_to_block):
            assert not block.is_null, "INV-POOL-3: the null block is indexed"

    def _check_usage_and_leaks(self):
        usage = self.manager.usage
        used = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert 0.0 <= usage <= 1.0, f"INV-POOL-5: usage {usage}"
        assert usage == pytest.approx(used / (self.pool.num_gpu_blocks - 1)), \
            f"INV-POOL-5: usage {usage}, but {used} blocks are in use"
        if not self.running and not self.in_flight:
            free, usable = self.pool.get_num_free_blocks(), self.pool.num_gpu_blocks - 1
            assert free == usable, \
                f"INV-MGR-1 (leak): nothing runs, yet only {free} of {usable} blocks are free"

    def _check_cached_contents(self):
        for key, block in index_items(self.pool.cached_block_hash_to_block):
            assert block.block_hash == key, \
                f"INV-HASH-1: block {block.block_id} is indexed under another key"
            held = self.content.get(block.block_id)
            assert held is not None, (
                f"INV-CONTENT-1: block {block.block_id} is cached, but was never "
                "filled (cached before it was full, or reused without losing its hash)")
            first = self.content_of_key.setdefault(key, held)
            assert first == held, (f"INV-CONTENT-1: key {key.hex()[:12]} names {first}, but "
                                   f"block {block.block_id} cached under it holds {held}")
            known = self.key_of_content.setdefault(held, key)
            assert known == key, (f"INV-CONTENT-1: content {held} was cached under two keys; "
                                  "the hash misses something that changes the content")
        for block in self.pool.blocks:
            if block.block_hash is not None:
                assert self.pool.cached_block_hash_to_block.contain(block.block_hash,
                                                                    block.block_id), \
                    f"INV-HASH-2: block {block.block_id} has a hash but is not indexed"

    def _check_event_consumer(self):
        events = self.manager.take_events()
        for stored in events:
            if hasattr(stored, "block_size"):
                assert stored.block_size == self.specs[stored.group_idx].block_size
        if any(type(e).__name__ == "BlockRemoved" for e in events):
            event("a cached block was evicted")
        self.consumer.apply(events)
        assert_consumer_agrees(self.consumer, self.pool)

    def _check_tables_only_grow(self):
        """INV-MGR-9: a table never shrinks, and an entry only ever turns into the null block."""
        for name in self.live:
            now = [ids(t) for t in self.manager.get_blocks(name).blocks]
            before = self.tables_seen.get(name)
            if before is not None:
                for g, (old, new) in enumerate(zip(before, now)):
                    assert len(new) >= len(old) and all(
                        a == b or b == 0 for a, b in zip(old, new)), \
                        f"INV-MGR-9: group {g} of {name} went from {old} to {new}"
            self.tables_seen[name] = now


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def diff(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


# One machine per config class; the class name opens every shrunk story.
