"""The manager of a Mamba (linear attention / SSM) group.

Part of vLLM's ``vllm/v1/core/single_type_kv_cache_manager.py`` (``MambaManager``),
kept in its own file because it is the longest. ``kvref.single_type_kv_cache_manager``
re-exports it.

A Mamba layer has no per-token keys and values: one block holds the whole
recurrent state after some token. So a prefix hit needs exactly one cached
block, the state at the end of the prefix, and every older state is garbage
(``get_num_skipped_tokens(n) == n - 1``). Three modes (``MambaSpec.mamba_cache_mode``):

- ``"none"``/``"all"``: the table has a block per ``block_size`` tokens; the
  states left of the last one are replaced by the null block as computation
  moves on. In ``"all"`` mode each full block's state is cached.
- ``"align"``: only the running state and the state at the last block boundary
  are kept; blocks in between are null from the start::

      tokens computed: 40, block size 16, no speculative blocks
      table            [NULL, 8, 9]        8: state at token 32 (cacheable)
                                           9: running state

``num_speculative_blocks`` extra blocks hold states for draft tokens.

One rule is unique to Mamba: a state cached *in this step* by another request
may not be written yet, so a hit on it makes ``get_num_blocks_to_allocate``
return more blocks than the pool has, and the scheduler retries next step.
"""

from __future__ import annotations

from kvref.kv_cache_interface import MambaSpec
from kvref.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from kvref.single_type_kv_cache_manager import SingleTypeKVCacheManager, cdiv


class MambaManager(SingleTypeKVCacheManager):
    """Block tables of one Mamba group (see the module docstring)."""

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Hashes cached since new_step_starts(): not hittable until next step.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # "align" mode: the table index of the state written in the previous
        # step (freed once the next one exists), and the requests that have
        # allocated at least once.
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens):
        """The rightmost cached state on an aligned boundary, nulls before it.

        Block size 4, states cached after blocks 0 and 2, max_length 15:
        ``[NULL, NULL, 9]`` (12 tokens). Only one block is real.
        """
        block_size = kv_cache_spec.block_size
        computed = tuple([] for _ in kv_cache_group_ids)
        for i in range(max_length // block_size - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None or (i + 1) * block_size % alignment_tokens != 0:
                continue
            for blocks, block in zip(computed, cached):
                blocks.extend([block_pool.null_block] * i)
                blocks.append(block)
            break
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_tokens_main_model,
                                   apply_admission_cap=False):
        if new_computed_blocks and \
                new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # More than the pool holds: "cannot allocate now, try next step".
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks, total_computed_tokens, num_tokens_main_model,
                apply_admission_cap)
        # Align mode ignores lookahead tokens (draft models have no Mamba layers)
        # and needs at most one running block (+ speculative ones the first time).
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks[request_id])
        if num_new > 0:
            num_new = 1 if request_id in self._allocated_block_reqs \
                else 1 + self.num_speculative_blocks
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        if not self._align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model)
        return self._allocate_aligned(request_id, num_tokens_main_model)

    def _allocate_aligned(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extend the table to ``cdiv(num_tokens) + spec`` entries, where only the
        last ``1 + spec`` are real: nulls fill the gap, the previous step's
        speculative blocks move to the end, and at most one fresh block (``1 +
        spec`` the first time) is taken. Returns the table's new tail."""
        spec = self.num_speculative_blocks
        blocks = self.req_to_blocks[request_id]
        num_required = cdiv(num_tokens, self.block_size) + spec
        if num_required <= len(blocks):
            return []
        prev_len = len(blocks)
        allocated_before = request_id in self._allocated_block_reqs
        # The running state is the last real block before the speculative ones;
        # after a fresh prefix hit, it is the hit block.
        if allocated_before:
            self.last_state_block_idx[request_id] = prev_len - 1 - spec
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1
        num_state_slots_before = num_required - spec - 1
        blocks.extend([self._null_block] * max(0, num_state_slots_before - prev_len))
        if allocated_before:
            # Reuse last step's speculative blocks: move them to the tail.
            for i in range(prev_len - spec, prev_len):
                if i >= num_state_slots_before:
                    break
                blocks.append(blocks[i])
                blocks[i] = self._null_block
        num_new = num_required - len(blocks)
        limit = 1 if allocated_before else 1 + spec
        if not 0 <= num_new <= limit:
            raise RuntimeError(f"align-mode Mamba would take {num_new} blocks for "
                               f"request {request_id!r} (at most {limit})")
        blocks.extend(self.block_pool.get_new_blocks(num_new))
        self._allocated_block_reqs.add(request_id)
        return blocks[prev_len:]

    def remove_skipped_blocks(self, request_id, total_computed_tokens, num_prompt_tokens=None):
        # With async scheduling the count may include drafts that get rejected;
        # stay conservative (vLLM subtracts the number of speculative *blocks*).
        num_computed = max(0, total_computed_tokens - self.num_speculative_blocks)
        super().remove_skipped_blocks(request_id, num_computed, num_prompt_tokens)
        if not self._align:
            return
        # The state written two steps ago is no longer needed once a newer one exists.
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < cdiv(num_computed, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            if blocks[last] is not self._null_block:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self._null_block

    def cache_blocks(self, request, num_tokens):
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        for block in self.req_to_blocks[request.request_id][before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_blocks_this_step.add(block.block_hash)

    def pop_blocks_for_free(self, request_id):
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
