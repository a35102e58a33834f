"""The manager machine's model of the world: what kvref cannot tell it about itself.

Not a scheduler (the machine in ``test_kv_cache_manager_machine.py`` plays the
scheduler); this module holds the facts the machine checks kvref against:

- ``Content``: what a block holds, recorded by the model when the block is
  written. A key or value at position ``t`` depends on every token up to ``t``
  (and a Mamba state is the whole prefix folded up), so a block's content is the
  request's *entire* prefix up to the block's end, plus its group and the extra
  keys (LoRA, cache salt) that change what the model computes.
- ``PoolObserver``: the free queue as the model expects it, kept by watching
  every ``get_new_blocks`` / ``touch`` / ``free_blocks`` call the managers make,
  and checking that each call hands out the head of the queue and frees tail first.
- ``blocks_read_from``: the blocks a token at a given position reads, per
  attention type; the machine checks hits and block tables against it.
- ``SHARED_PREFIXES``, ``fresh_tokens``, ``greedy_next_token``: the prompts
  and the deterministic "model" that decodes them, chosen so requests share
  prefixes and equal prompts decode equal tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvref import CrossAttentionSpec, KVCacheSpec, MambaSpec

from .backend import KVCacheBlock, free_blocks_in_order

from .exact_model import return_to_queue, skipped_tokens

# Prompts share these prefixes; "sys-A+tools" extends "sys-A", so hits nest.
SHARED_PREFIXES: dict[str, list[int]] = {
    "none": [],
    "sys-A": list(range(100, 110)),
    "sys-A+tools": list(range(100, 116)),
    "sys-B": list(range(200, 213)),
}


def fresh_tokens(n: int, first: int = 600) -> list[int]:
    """Tokens a request adds after a shared prefix; equal counts give equal
    tokens, so two requests with the same prefix and count have the same prompt."""
    return list(range(first, first + n))


def greedy_next_token(tokens) -> int:
    """The 'model': a deterministic next token from a vocabulary of three, so
    requests with the same prompt decode the same tokens (and share blocks)."""
    return 900 + (len(tokens) * 7 + tokens[-1]) % 3


@dataclass(frozen=True)
class Content:
    """What one block holds: the whole prefix up to its end, for one group."""

    group: int
    lora: str | None
    salt: str | None
    prefix: tuple[int, ...]

    def __repr__(self) -> str:
        extras = "".join(f", {k}={v!r}" for k, v in (("lora", self.lora), ("salt", self.salt))
                         if v)
        return (f"<group {self.group}: first {len(self.prefix)} tokens "
                f"...{list(self.prefix[-3:])}{extras}>")


def first_token_read(spec: KVCacheSpec, position: int) -> int:
    """The first earlier token that the token at ``position`` attends to: the
    tokens before it are the ones skipped once ``position`` tokens are computed."""
    return skipped_tokens(spec, position)


def blocks_read_from(spec: KVCacheSpec, num_tokens: int) -> range | list[int]:
    """Indices of the blocks that the token at position ``num_tokens`` needs
    from the ``num_tokens`` tokens before it, i.e. what a prefix hit of
    ``num_tokens`` tokens must provide for real (everything else may be null)."""
    bs = spec.block_size
    if isinstance(spec, CrossAttentionSpec):
        return []
    if isinstance(spec, MambaSpec):
        return [num_tokens // bs - 1] if num_tokens else []
    return range(first_token_read(spec, num_tokens) // bs, num_tokens // bs)


class PoolObserver:
    """Wraps the pool's allocation entry points and keeps the model's free list.

    The model of the queue: blocks start in id order; ``get_new_blocks(n)``
    takes the first ``n``; a touched block at ref_cnt 0 leaves the list; a
    freed block reaching 0 goes to the front if it has no hash and to the back
    if it is cached. ``positions`` (block id -> (group, table index)) says whose
    blocks may be freed now; each free call must release them tail first.
    """

    def __init__(self, pool, on_reuse: Callable[[int], None]) -> None:
        self.pool = pool
        self.on_reuse = on_reuse
        self.free_list = [b.block_id for b in free_blocks_in_order(pool.free_block_queue)]
        self.refs = {b.block_id: 0 for b in pool.blocks[1:]}
        self.positions: dict[int, tuple[int, int]] | None = None
        self.handed_out: list[int] = []   # every block get_new_blocks returned, in order
        self._get_new_blocks = pool.get_new_blocks
        self._touch = pool.touch
        self._free_blocks = pool.free_blocks
        pool.get_new_blocks = self.get_new_blocks
        pool.touch = self.touch
        pool.free_blocks = self.free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        expected = self.free_list[:num_blocks]
        blocks = self._get_new_blocks(num_blocks)
        got = [b.block_id for b in blocks]
        assert got == expected, (
            f"INV-EVICT-1: get_new_blocks({num_blocks}) handed out {got}, but the "
            f"least recently freed blocks (head of the model's queue) are {expected}")
        del self.free_list[:num_blocks]
        self.handed_out.extend(got)
        for block_id in got:
            assert self.refs[block_id] == 0, f"INV-MGR-1: block {block_id} handed out while in use"
            self.refs[block_id] = 1
            self.on_reuse(block_id)
        return blocks

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        self._touch(blocks)
        for block in blocks:
            if block.is_null:
                continue
            if self.refs[block.block_id] == 0:
                assert block.block_id in self.free_list, \
                    f"INV-QUEUE-5: touched block {block.block_id} had ref_cnt 0 but was not free"
                self.free_list.remove(block.block_id)
            self.refs[block.block_id] += 1

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        self._check_tail_first(blocks)
        self._free_blocks(blocks)
        released = []
        for block in blocks:
            if block.is_null:
                continue
            self.refs[block.block_id] -= 1
            if self.refs[block.block_id] == 0:
                released.append(block)
        self.free_list = return_to_queue(self.free_list, released)

    def _check_tail_first(self, blocks: list[KVCacheBlock]) -> None:
        real = [b.block_id for b in blocks if not b.is_null]
        if not real:
            return
        assert self.positions is not None, f"blocks {real} were freed outside any request's release"
        last_index: dict[int, int] = {}
        for block_id in real:
            assert block_id in self.positions, \
                f"block {block_id} was freed, but the request being released does not hold it"
            group, index = self.positions[block_id]
            if group in last_index:
                assert index < last_index[group], (
                    f"INV-EVICT-1: group {group}'s blocks were freed in the order {real}; "
                    "a request frees its tail first, so its prefix stays cached longest")
            last_index[group] = index
