#!/usr/bin/env python3
"""Seeded bugs: do the tests catch realistic mistakes?

Two catalogues of small, plausible bugs, each written as a text edit of one
kvref source file. For each bug the script copies the project to a temporary
folder, applies the edit, runs a suite there and reports whether it failed
("killed") and what failed first. A bug a suite survives is a hole in the
checks.

- ``--catalogue core`` (the default, ``CATALOGUE``): the KV layer
  (``kvref/core``, hashing), against ``tests/stateful`` alone (the state
  machines: no unit test, no recorded trace); the report names the invariant
  id the failure cites. With ``--also-other-suites`` it then runs the rest of
  ``tests/`` on the same copy and reports whether they catch the bug too.
- ``--catalogue tensor-engine`` (``TENSOR_ENGINE_CATALOGUE``): the tensor side
  and the engine (``kvref/attention``, ``kvref/worker``, ``kvref/sched``,
  ``kvref/model_executor``, ``kvref/spec_decode``, ``kvref/engine``),
  against ``tests/tensor`` and ``tests/engine`` alone, without the tests that
  replay answers recorded from vLLM (``TRACE_FILES``, ``TRACE_TESTS``) and
  without lessons, the suite of the bug's own side first, fastest files
  first, stopping at the first failure, with the Hypothesis profile "seeded"
  (the ci examples, no shrinking); the report names the first failing test.
- ``--catalogue connector`` (``CONNECTOR_CATALOGUE``): the scheduler's KV
  connector path and async scheduling (``kvref/sched/scheduler.py``,
  ``async_scheduler.py``), against ``tests/engine`` (its connector and async
  tests first), ``tests/distributed`` and ``tests/viz/test_disagg_life.py``, in
  the same way: no recorded vLLM trace, no lesson, first failure reported.

    python tools/seeded_bugs.py                 # every core bug, a table at the end
    python tools/seeded_bugs.py -k hit-cap      # bugs whose id contains "hit-cap"
    python tools/seeded_bugs.py --list          # the catalogue only
    python tools/seeded_bugs.py -k mm- --also-other-suites
    python tools/seeded_bugs.py -k swa -- -k "not scheduler_paths"   # pytest arguments
    python tools/seeded_bugs.py --catalogue tensor-engine -j 1       # the tensor/engine bugs
    python tools/seeded_bugs.py --catalogue tensor-engine -k ngram- --list
    python tools/seeded_bugs.py --catalogue connector -j 1           # connector + async bugs

Exit status 0 only if every selected bug is killed. An edit whose text is not
found exactly once in its file is an error, reported before anything runs: the
catalogue must follow the code, and a bug whose edit no longer applies never
counts as survived or killed. A run that exceeds ``--timeout`` seconds is
reported as TIMEOUT and counts as not killed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SeededBug:
    bug_id: str
    description: str
    path: str       # relative to the repository root
    old: str        # text that must occur exactly once in the file
    new: str
    kind: str = ""  # tensor-engine catalogue: the blind spot it probes (KINDS)


# allocate_slots' step 3 (free what the window left behind) and step 4 (the capacity
# gate); the seeded bug swaps them, so the freed blocks cannot serve the same call.
_SKIP = ("        self.coordinator.remove_skipped_blocks(request.request_id, total_computed,\n"
         "                                               num_prompt_tokens=request.num_prompt_tokens)\n")
_GATE = ("        # 4. The capacity gate: the blocks needed, the watermark, the reserved blocks.\n"
         "        needed = self.coordinator.get_num_blocks_to_allocate(\n"
         "            request_id=request.request_id, num_tokens=num_tokens_need_slot,\n"
         "            new_computed_blocks=hit_blocks, num_encoder_tokens=num_encoder_tokens,\n"
         "            total_computed_tokens=num_local_computed + num_external_computed_tokens,\n"
         "            num_tokens_main_model=num_tokens_main_model)\n"
         "        available = self.block_pool.get_num_free_blocks() - reserved_blocks\n"
         "        if needed + watermark_blocks > available:\n"
         "            return None\n")
SKIP_AFTER_ROOM_CHECK_OLD = _SKIP + "\n" + _GATE
SKIP_AFTER_ROOM_CHECK_NEW = _GATE + _SKIP

CATALOGUE: list[SeededBug] = [
    SeededBug("hit-cap-off-by-one",
              "the prefix hit may cover the whole prompt (cap num_tokens, not num_tokens - 1)",
              "kvref/core/kv_cache_manager.py",
              "request.block_hashes, request.num_tokens - 1)",
              "request.block_hashes, request.num_tokens)"),
    SeededBug("touch-keeps-free",
              "a prefix-hit block that sat in the free queue is not taken out of it",
              "kvref/core/block_pool.py",
              "            if block.ref_cnt == 0 and not block.is_null:\n"
              "                self.free_block_queue.remove(block)\n",
              "            pass\n"),
    SeededBug("free-forward-order",
              "a request's blocks are freed head first, so its prefix is evicted before its tail",
              "kvref/core/single_type_kv_cache_manager.py",
              "self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
              "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))"),
    SeededBug("watermark-for-running",
              "the admission watermark is applied to running requests too",
              "kvref/core/kv_cache_manager.py",
              "if has_scheduled_reqs and request.status in (RequestStatus.WAITING,\n"
              "                                                     RequestStatus.PREEMPTED):",
              "if has_scheduled_reqs:"),
    SeededBug("cache-partial-block",
              "a block is cached before it is full (ceil instead of floor)",
              "kvref/core/single_type_kv_cache_manager.py",
              "        num_full = num_tokens // self.block_size\n",
              "        num_full = cdiv(num_tokens, self.block_size)\n"),
    SeededBug("cache-draft-tokens",
              "unverified draft tokens are cached (no cap at request.num_tokens)",
              "kvref/core/kv_cache_manager.py",
              "request, min(total_computed + num_new_tokens, request.num_tokens))",
              "request, total_computed + num_new_tokens + num_lookahead_tokens)"),
    SeededBug("reuse-keeps-hash",
              "a cached block handed out again keeps its old hash and index entry",
              "kvref/core/block_pool.py",
              "            if self.enable_caching and (block.block_hash is not None\n"
              "                                        or self.cached_block_hashes_by_block):\n"
              "                self._maybe_evict_cached_block(block)\n",
              ""),
    SeededBug("hybrid-one-pass",
              "the hybrid fixed point stops after the first pass",
              "kvref/core/kv_cache_coordinator.py",
              "            if is_simple_hybrid:\n                break\n",
              "            break\n"),
    SeededBug("unhashed-to-tail",
              "freed blocks without a hash go to the back of the queue, not the front",
              "kvref/core/block_pool.py",
              "self.free_block_queue.prepend_n(uncached, check=False)",
              "self.free_block_queue.append_n(uncached, check=False)"),
    SeededBug("free-queues-held-block",
              "freeing a block two requests share queues it while the other still holds it",
              "kvref/core/block_pool.py",
              "if block.ref_cnt > 0 or block.is_null:",
              "if block.ref_cnt > 1 or block.is_null:"),
    SeededBug("hashed-to-head",
              "freed cached blocks go to the front of the queue (evicted first)",
              "kvref/core/block_pool.py",
              "self.free_block_queue.append_n(cached, check=False)",
              "self.free_block_queue.prepend_n(cached, check=False)"),
    SeededBug("evict-silently",
              "evicting a cached block emits no BlockRemoved event",
              "kvref/core/block_pool.py",
              "        if self.enable_kv_cache_events:\n"
              "            self.kv_event_queue.append(BlockRemoved(",
              "        if False:\n"
              "            self.kv_event_queue.append(BlockRemoved("),
    SeededBug("null-block-freed",
              "the null block is put into the free queue when its count drops to 0",
              "kvref/core/block_pool.py",
              "            if block.ref_cnt > 0 or block.is_null:\n",
              "            if block.ref_cnt > 0:\n"),
    SeededBug("swa-run-too-short",
              "a sliding-window hit needs one block fewer than the window reads",
              "kvref/core/single_type_kv_cache_manager.py",
              "return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)",
              "return max(cdiv(sliding_window - 1, block_size) - 1, 1) + (1 if use_eagle else 0)"),
    SeededBug("swa-skip-too-many",
              "the sliding window frees one token (a block) too early",
              "kvref/core/single_type_kv_cache_manager.py",
              "return max(0, num_computed_tokens - self.sliding_window + 1)",
              "return max(0, num_computed_tokens - self.sliding_window + 2)"),
    SeededBug("reset-while-in-use",
              "reset_prefix_cache succeeds while blocks are in use",
              "kvref/core/block_pool.py",
              "        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:\n"
              "            return False\n",
              ""),
    SeededBug("no-ref-on-alloc",
              "get_new_blocks does not take a reference on the blocks it hands out",
              "kvref/core/block_pool.py",
              "                self._maybe_evict_cached_block(block)\n"
              "            block.ref_cnt += 1\n",
              "                self._maybe_evict_cached_block(block)\n"),
    SeededBug("queue-half-unlinked",
              "removing from the free queue forgets the backward link",
              "kvref/core/kv_cache_utils.py",
              "        next_block.prev_free_block = prev_block\n"
              "        block.prev_free_block = block.next_free_block = None\n"
              "        self.num_free_blocks -= 1\n",
              "        block.prev_free_block = block.next_free_block = None\n"
              "        self.num_free_blocks -= 1\n"),
    SeededBug("queue-count-drift",
              "removing from the free queue does not update its count",
              "kvref/core/kv_cache_utils.py",
              "        block.prev_free_block = block.next_free_block = None\n"
              "        self.num_free_blocks -= 1\n",
              "        block.prev_free_block = block.next_free_block = None\n"),
    SeededBug("mamba-same-step-hit",
              "a Mamba state cached in this step is served as a hit",
              "kvref/core/single_type_kv_cache_manager.py",
              "        if new_computed_blocks and \\\n"
              "                new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:",
              "        if False:"),
    SeededBug("eagle-no-drop",
              "with EAGLE, full attention keeps the last hit block",
              "kvref/core/single_type_kv_cache_manager.py",
              "        if drop_eagle_block and computed[0]:\n"
              "            for blocks in computed:\n"
              "                blocks.pop()\n"
              "        _pop_until_aligned(computed, block_size, alignment_tokens)\n"
              "        return computed\n\n    def get_num_common_prefix_blocks",
              "        _pop_until_aligned(computed, block_size, alignment_tokens)\n"
              "        return computed\n\n    def get_num_common_prefix_blocks"),
    SeededBug("chunk-skip-too-many",
              "chunked local attention frees the blocks of the current chunk",
              "kvref/core/single_type_kv_cache_manager.py",
              "return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size",
              "return (num_computed_tokens // self.attention_chunk_size + 1)"
              " * self.attention_chunk_size"),
    SeededBug("mamba-frees-live-state",
              "Mamba frees the state block of the last computed token too (n, not n - 1)",
              "kvref/core/single_type_kv_cache_manager.py",
              "    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:\n"
              "        return num_computed_tokens - 1\n",
              "    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:\n"
              "        return num_computed_tokens\n"),
    SeededBug("stats-ignore-preemption",
              "prefix-cache stats count preempted requests as new ones",
              "kvref/core/kv_cache_manager.py",
              "preempted=request.num_preemptions > 0)",
              "preempted=False)"),
    SeededBug("lora-not-hashed",
              "the LoRA adapter name is left out of the block hash",
              "kvref/core/kv_cache_utils.py",
              "    if request.lora_request:\n"
              "        keys.append(request.lora_request.lora_name)\n",
              ""),
    SeededBug("salt-not-hashed",
              "the cache salt is left out of the first block's hash",
              "kvref/core/kv_cache_utils.py",
              "    if start_token_idx == 0 and request.cache_salt:\n"
              "        keys.append(request.cache_salt)\n",
              ""),
    # -- The paths of vLLM's scheduler that tests/stateful/test_scheduler_paths_machine.py
    # drives (specs/scheduler.md); each keeps every safety invariant and is
    # caught only by the exact model.
    SeededBug("swa-skip-too-few",
              "the sliding window frees one token (at a block edge, a block) too late",
              "kvref/core/single_type_kv_cache_manager.py",
              "return max(0, num_computed_tokens - self.sliding_window + 1)",
              "return max(0, num_computed_tokens - self.sliding_window)"),
    SeededBug("chunk-skip-too-few",
              "chunked local attention skips by the last computed token's chunk, "
              "not the next token's (frees nothing exactly at a chunk edge)",
              "kvref/core/single_type_kv_cache_manager.py",
              "return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size",
              "return max(0, num_computed_tokens - 1) // self.attention_chunk_size"
              " * self.attention_chunk_size"),
    SeededBug("skip-after-room-check",
              "allocate_slots frees blocks left of the window only after checking for "
              "room, so they cannot serve the same step",
              "kvref/core/kv_cache_manager.py",
              SKIP_AFTER_ROOM_CHECK_OLD,
              SKIP_AFTER_ROOM_CHECK_NEW),
    SeededBug("finish-skip-args-swapped",
              "remove_skipped_blocks (the scheduler's call at finish) passes the prompt "
              "length where the computed count belongs",
              "kvref/core/kv_cache_manager.py",
              "        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens,\n"
              "                                               num_prompt_tokens)\n",
              "        self.coordinator.remove_skipped_blocks(request_id, num_prompt_tokens,\n"
              "                                               total_computed_tokens)\n"),
    SeededBug("partial-block-marked-cached",
              "a chunk that stops mid-block marks the partial block as cached, so it "
              "is never cached once full",
              "kvref/core/single_type_kv_cache_manager.py",
              "        self.num_cached_block[request.request_id] = num_full\n",
              "        self.num_cached_block[request.request_id] = cdiv(num_tokens, self.block_size)\n"),
    SeededBug("external-tokens-not-skipped",
              "a new request's null prefix ignores its external tokens (window counted "
              "from the local hit only)",
              "kvref/core/single_type_kv_cache_manager.py",
              "        total = num_local_computed_tokens + num_external_computed_tokens\n"
              "        num_skipped = self.get_num_skipped_tokens(total) // self.block_size\n",
              "        total = num_local_computed_tokens + num_external_computed_tokens\n"
              "        num_skipped = self.get_num_skipped_tokens(num_local_computed_tokens)"
              " // self.block_size\n"),
    SeededBug("delay-cache-ignored",
              "blocks of an asynchronous KV load are cached at allocation, before the "
              "load lands (delay_cache_blocks ignored)",
              "kvref/core/kv_cache_manager.py",
              "        if self.enable_caching and not delay_cache_blocks:\n",
              "        if self.enable_caching:\n"),
    SeededBug("reserved-blocks-ignored",
              "allocate_slots ignores the blocks reserved for in-flight KV loads",
              "kvref/core/kv_cache_manager.py",
              "        available = self.block_pool.get_num_free_blocks() - reserved_blocks\n",
              "        available = self.block_pool.get_num_free_blocks()\n"),
    SeededBug("full-sequence-no-watermark",
              "full_sequence_must_fit forgets the watermark",
              "kvref/core/kv_cache_manager.py",
              "            if needed + watermark_blocks > num_free_blocks:\n",
              "            if needed > num_free_blocks:\n"),
    SeededBug("free-clears-new-block-ids",
              "freeing a request (a preemption in mid-step) drops the fresh block ids "
              "of every request allocated earlier in the step, so they are not zeroed",
              "kvref/core/single_type_kv_cache_manager.py",
              "        self.num_cached_block.pop(request_id, None)\n"
              "        return self.req_to_blocks.pop(request_id, [])\n",
              "        self.num_cached_block.pop(request_id, None)\n"
              "        self.new_block_ids = []\n"
              "        return self.req_to_blocks.pop(request_id, [])\n"),
    SeededBug("lora-first-block-only",
              "the LoRA name is hashed into the first block only (like the salt)",
              "kvref/core/kv_cache_utils.py",
              "    if request.lora_request:\n"
              "        keys.append(request.lora_request.lora_name)\n",
              "    if request.lora_request and start_token_idx == 0:\n"
              "        keys.append(request.lora_request.lora_name)\n"),
    SeededBug("salt-every-block",
              "the cache salt is hashed into every block, not only the first",
              "kvref/core/kv_cache_utils.py",
              "    if start_token_idx == 0 and request.cache_salt:\n",
              "    if request.cache_salt:\n"),
    SeededBug("mm-offset-absolute",
              "a multimodal item's key carries its prompt offset, not its offset in the block",
              "kvref/core/kv_cache_utils.py",
              "keys.append((feature.identifier, offset - start))",
              "keys.append((feature.identifier, offset))"),
    SeededBug("mm-item-keyed-once",
              "an image spanning several blocks is hashed into the first of them only",
              "kvref/core/kv_cache_utils.py",
              "        if end >= offset + length:\n"
              "            mm_idx += 1  # the item ends here; the next one may start in this block\n"
              "        else:\n"
              "            break  # the item runs into the next block\n",
              "        mm_idx += 1\n"),
    SeededBug("mm-not-hashed",
              "multimodal items are left out of the block hash",
              "kvref/core/kv_cache_utils.py",
              "    keys.extend(mm_keys)\n",
              ""),
]

# -- The tensor side and the engine (--catalogue tensor-engine) ------------------------
# Each bug is a mistake a reimplementer of the tensor side (kvref/attention,
# kvref/worker) or the engine (kvref/sched, kvref/model_executor, ...) could
# plausibly make; "kind" says which blind spot of the tests it probes (issue 24):
# most are invisible to models with regular weights, to batches that never
# shrink, to runs that stay clear of max_model_len, or to a component checked
# only against itself.

KINDS = {
    "weights": "invisible with regular weights (norms at one, biases at zero, tied heads)",
    "edges": "only at max_model_len or at a size that is not a multiple of the block size",
    "buffers": "a persistent buffer keeps a previous, longer step's or row's tail",
    "vllm-rule": "a component that agrees with itself but not with vLLM's rule",
    "every-chunk": "a scheduler limit kept on the first chunk only",
    "kernel": "a plain mistake in a mask, a head mapping, a merge or a page table",
    "engine": "a plain mistake in the runner, the model or the scheduler",
}

TENSOR_ENGINE_CATALOGUE: list[SeededBug] = [
    # -- worker: block tables and slot mapping --------------------------------------
    SeededBug("slot-buffer-stale-tail",
              "the slot-mapping buffer is not reset, so a shorter step leaves the "
              "previous step's slots in its tail",
              "kvref/worker/block_table.py",
              "        self.slot_mapping[n:] = PAD_SLOT_ID\n",
              "", kind="buffers"),
    SeededBug("block-table-floor-width",
              "rows hold max_model_len // block_size blocks, not cdiv",
              "kvref/worker/block_table.py",
              "max_num_blocks = [cdiv(max_model_len, bs) for bs in block_sizes]",
              "max_num_blocks = [max_model_len // bs for bs in block_sizes]", kind="edges"),
    SeededBug("clear-row-keeps-count",
              "clear_row zeroes the row but keeps its block count",
              "kvref/worker/block_table.py",
              "        self.block_table[row_idx, :self.num_blocks_per_row[row_idx]] = 0\n"
              "        self.num_blocks_per_row[row_idx] = 0\n",
              "        self.block_table[row_idx, :self.num_blocks_per_row[row_idx]] = 0\n",
              kind="buffers"),
    SeededBug("move-row-keeps-target-count",
              "move_row copies the blocks but leaves the target row's old block count",
              "kvref/worker/block_table.py",
              "        self.num_blocks_per_row[tgt] = n\n", "", kind="buffers"),
    SeededBug("slot-offset-manager-block",
              "with split kernel blocks, the slot offset is taken modulo the manager's "
              "block size",
              "kvref/worker/block_table.py",
              "slots.append(row[block_idx] * self.block_size + p % self.block_size)",
              "slots.append(row[block_idx] * self.block_size\n"
              "                             + p % (self.block_size * self.blocks_per_kv_block))",
              kind="edges"),
    SeededBug("kernel-blocks-interleaved",
              "a manager block b splits into kernel blocks b, b + k, ... instead of "
              "b*k .. b*k + k - 1",
              "kvref/worker/block_table.py",
              "return [int(b) * k + j for b in kv_manager_block_ids for j in range(k)]",
              "return [int(b) + j * k for b in kv_manager_block_ids for j in range(k)]",
              kind="kernel"),
    # -- attention: masks, grouped heads, cascade, FlashInfer, Mamba ------------------
    SeededBug("window-mask-one-wider",
              "the sliding-window mask lets a query see W + 1 keys",
              "kvref/attention/paged_attention.py",
              "        mask = mask & (k >= q - sliding_window + 1)",
              "        mask = mask & (k >= q - sliding_window)", kind="kernel"),
    SeededBug("chunk-mask-as-window",
              "chunked-local attention masked as a sliding window of the chunk size",
              "kvref/attention/paged_attention.py",
              "        mask = mask & (k // attention_chunk_size == q // attention_chunk_size)",
              "        mask = mask & (q - k < attention_chunk_size)", kind="kernel"),
    SeededBug("gqa-heads-interleaved",
              "reference attention: query head h reads KV head h % num_kv_heads, "
              "not h // group",
              "kvref/attention/paged_attention.py",
              "    q = query.to(work).reshape(num_q, num_kv_heads, group, head_size)",
              "    q = query.to(work).reshape(num_q, group, num_kv_heads, head_size)"
              ".transpose(1, 2)", kind="kernel"),
    SeededBug("fast-gqa-decode-interleaved",
              "fast path: a decode's query heads are folded onto KV heads h % num_kv_heads",
              "kvref/attention/fast_paged_attention.py",
              "        q = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_size)",
              "        q = q.view(num_reqs, num_heads // num_kv_heads, num_kv_heads, head_size)"
              ".transpose(1, 2)", kind="kernel"),
    SeededBug("fast-unseen-slots-kept",
              "fast path: gathered slots no query may see are not zeroed (a NaN there "
              "reaches the output)",
              "kvref/attention/fast_paged_attention.py",
              "    if batch.unseen is not None:\n",
              "    if False:\n", kind="buffers"),
    SeededBug("fast-repeated-block-visible",
              "fast path: key positions follow the clamped columns, so a shorter "
              "request's repeated last block is attended twice",
              "kvref/attention/fast_paged_attention.py",
              "    k_pos = first_t[:mask_reqs, None] * block_size + torch.arange(num_keys, "
              "device=device)",
              "    k_pos = (cols[:mask_reqs, :, None] * block_size\n"
              "             + torch.arange(block_size, device=device)).reshape(mask_reqs, -1)",
              kind="buffers"),
    SeededBug("fast-decode-unmasked",
              "fast path: a decode batch is run without its mask",
              "kvref/attention/fast_paged_attention.py",
              "attn_mask=None if seen_all and q_len == 1 else mask[:, None],",
              "attn_mask=None if q_len == 1 else mask[:, None],", kind="kernel"),
    SeededBug("cascade-prefix-not-capped",
              "the cascade prefix is not capped by the batch's least context length",
              "kvref/attention/cascade.py",
              "    common = min(common, min(num_computed_tokens))\n", "", kind="kernel"),
    SeededBug("cascade-merge-by-max",
              "the log-sum-exp merge keeps the larger side's lse instead of adding them",
              "kvref/attention/cascade.py",
              "    lse = torch.logaddexp(prefix_lse.float(), suffix_lse.float())",
              "    lse = torch.maximum(prefix_lse.float(), suffix_lse.float())", kind="kernel"),
    SeededBug("flashinfer-window-left-off-by-one",
              "FlashInfer's window_left read as the window itself (vLLM passes W - 1)",
              "kvref/attention/flashinfer.py",
              "    window = None if window_left < 0 else window_left + 1",
              "    window = None if window_left < 0 else window_left", kind="kernel"),
    SeededBug("flashinfer-full-last-page-zero",
              "a full last page gets kv_last_page_len 0 instead of the page size",
              "kvref/attention/flashinfer.py",
              "        last.append((seq_len - 1) % block_size + 1)",
              "        last.append(seq_len % block_size)", kind="edges"),
    SeededBug("mamba-reads-next-block",
              "a Mamba step reads its state from table[context_len // B], not "
              "(context_len - 1) // B",
              "kvref/attention/mamba_state.py",
              "            h = state_cache[table[(context_len - 1) // block_size]].clone()",
              "            h = state_cache[table[context_len // block_size]].clone()",
              kind="edges"),
    SeededBug("mamba-align-writes-boundaries",
              "align mode also writes every block-boundary state (mode all's rule)",
              "kvref/attention/mamba_state.py",
              '            if mamba_cache_mode == "all" and num_done % block_size == 0:',
              "            if num_done % block_size == 0:", kind="kernel"),
    # -- engine: model ------------------------------------------------------------------
    SeededBug("qk-norm-shared",
              "Qwen3's keys are normalised with the query norm's weights",
              "kvref/model_executor/model.py",
              "self.k_norm(qk[:, heads:])",
              "self.q_norm(qk[:, heads:])", kind="weights"),
    SeededBug("mlp-reads-input-norm",
              "the MLP reads the input layernorm instead of the post-attention one",
              "kvref/model_executor/model.py",
              "        return hidden + self.mlp(self.post_attention_layernorm(hidden))",
              "        return hidden + self.mlp(self.input_layernorm(hidden))", kind="weights"),
    SeededBug("rmsnorm-weight-before-normalising",
              "RMSNorm scales by its weight before normalising (the weight cancels out)",
              "kvref/model_executor/model.py",
              "        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)\n"
              "        return self.weight * x32.to(x.dtype)",
              "        x32 = self.weight.float() * x32\n"
              "        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)\n"
              "        return x32.to(x.dtype)", kind="weights"),
    SeededBug("mlp-bias-ignored",
              "Llama's mlp_bias is not read from the config",
              "kvref/config/model.py",
              'mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),',
              "mlp_bias=False,", kind="weights"),
    SeededBug("tied-head-not-tied",
              "tie_word_embeddings leaves lm_head at its random initial weights",
              "kvref/model_executor/model.py",
              "            self.lm_head.weight = self.embed_tokens.weight\n",
              "            pass\n", kind="weights"),
    SeededBug("rope-interleaved-pairs",
              "rotary embedding rotates interleaved pairs (GPT-J) instead of halves",
              "kvref/model_executor/model.py",
              "    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)",
              "    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)",
              kind="engine"),
    # -- engine: runner -----------------------------------------------------------------
    SeededBug("runner-resume-keeps-no-blocks",
              "a resumed request is treated as running: its new table is appended to "
              "the empty one",
              "kvref/worker/gpu_input_batch.py",
              "            if req_id in cached.resumed_req_ids:",
              "            if False:", kind="engine"),
    SeededBug("logits-row-one-early",
              "the sampled logits are taken one row before each request's last token",
              "kvref/worker/gpu_model_runner.py",
              "logits_indices.extend(range(end - len(draft) - 1, end))",
              "logits_indices.extend(range(end - len(draft) - 2, end - 1))", kind="engine"),
    SeededBug("persistent-row-other-request",
              "a table row is taken to hold the same request as last step whoever holds "
              "it now, so after the batch shrinks it only gets appended to",
              "kvref/worker/gpu_model_runner.py",
              "        if held is not None and held[0] is state.block_ids:",
              "        if held is not None:", kind="buffers"),
    SeededBug("sampler-multiplies-temperature",
              "sampling multiplies the logits by the temperature instead of dividing",
              "kvref/worker/gpu_model_runner.py",
              "probs = torch.softmax(logits[rows] / params.temperature, dim=-1)",
              "probs = torch.softmax(logits[rows] * params.temperature, dim=-1)", kind="engine"),
    SeededBug("seq-len-without-context",
              "a request's seq_len is its query length (the context is not attended)",
              "kvref/worker/gpu_model_runner.py",
              "            seq_lens.append(start + n)",
              "            seq_lens.append(n)", kind="engine"),
    # -- engine: scheduler --------------------------------------------------------------
    SeededBug("threshold-first-chunk-only",
              "long_prefill_token_threshold caps a request when admitted, not its later "
              "chunks",
              "kvref/sched/scheduler.py",
              "                          - request.num_computed_tokens)\n"
              "        if 0 < self.long_prefill_token_threshold < num_new_tokens:\n"
              "            num_new_tokens = self.long_prefill_token_threshold\n",
              "                          - request.num_computed_tokens)\n",
              kind="every-chunk"),
    SeededBug("max-model-len-cap-off-by-one",
              "a running request may be scheduled up to position max_model_len "
              "(drafts reach past the last position)",
              "kvref/sched/scheduler.py",
              "                             self.max_model_len - 1 - request.num_computed_tokens)",
              "                             self.max_model_len - request.num_computed_tokens)",
              kind="edges"),
    SeededBug("max-num-seqs-off-by-one",
              "one request more than max_num_seqs may run",
              "kvref/sched/scheduler.py",
              "            if len(self.running) >= self.max_num_running_reqs:",
              "            if len(self.running) > self.max_num_running_reqs:",
              kind="every-chunk"),
    SeededBug("running-budget-uncapped",
              "a running request's chunk is not cut to the remaining token budget",
              "kvref/sched/scheduler.py",
              "        num_new_tokens = min(num_new_tokens, token_budget,\n"
              "                             self.max_model_len - 1 - request.num_computed_tokens)",
              "        num_new_tokens = min(num_new_tokens,\n"
              "                             self.max_model_len - 1 - request.num_computed_tokens)",
              kind="every-chunk"),
    SeededBug("drafts-not-cut-to-budget",
              "the whole draft is scheduled although the budget cut the step",
              "kvref/sched/scheduler.py",
              "request.spec_token_ids[:num_spec]", "request.spec_token_ids",
              kind="every-chunk"),
    SeededBug("victim-oldest",
              "a full pool preempts the oldest running request, not the last admitted",
              "kvref/sched/scheduler.py",
              "            victim = self.running.pop()",
              "            victim = self.running.pop(0)", kind="engine"),
    SeededBug("stop-one-past-max-model-len",
              "check_stop lets a request reach max_model_len + 1 tokens",
              "kvref/sched/utils.py",
              "if request.num_tokens >= max_model_len or",
              "if request.num_tokens > max_model_len or", kind="edges"),
    # -- engine: statistics -------------------------------------------------------------
    SeededBug("num-cached-overwritten-on-resume",
              "num_cached_tokens is overwritten by a resume after the first token",
              "kvref/sched/scheduler.py",
              "        if not request.output_token_ids:\n"
              "            request.num_cached_tokens = num_computed_tokens\n",
              "        request.num_cached_tokens = num_computed_tokens\n",
              kind="vllm-rule"),
    SeededBug("cached-stat-counts-outputs",
              "prompt_tokens_cached counts a resumed request's cached output tokens too",
              "kvref/sched/scheduler.py",
              "min(num_hit, request.num_prompt_tokens)", "num_hit", kind="vllm-rule"),
    # -- engine: n-gram proposer --------------------------------------------------------
    SeededBug("ngram-latest-copy",
              "the draft follows the latest earlier copy of the suffix, not the earliest",
              "kvref/spec_decode/ngram_proposer.py",
              "            for start in range(0, total - n):",
              "            for start in reversed(range(0, total - n)):", kind="vllm-rule"),
    SeededBug("ngram-shortest-first",
              "the shortest matching n-gram wins, not the longest",
              "kvref/spec_decode/ngram_proposer.py",
              "        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):",
              "        for n in range(self.min_n, min(self.max_n, total - 1) + 1):",
              kind="vllm-rule"),
    SeededBug("ngram-no-overlap",
              "an earlier copy may not overlap the suffix itself",
              "kvref/spec_decode/ngram_proposer.py",
              "            for start in range(0, total - n):",
              "            for start in range(0, total - 2 * n + 1):", kind="vllm-rule"),
    SeededBug("ngram-ignores-max-model-len",
              "drafts are not cut at max_model_len (the scheduler's cap hides it)",
              "kvref/spec_decode/ngram_proposer.py",
              "        k = min(self.k, self.max_model_len - total)",
              "        k = self.k", kind="edges"),
]


# -- KV connectors and async scheduling (--catalogue connector) -------------------------
# Each bug is a mistake a reimplementer of vLLM's connector path or of its
# AsyncScheduler could plausibly make (kvref/sched/scheduler.py's connector
# methods, async_scheduler.py). Each runs against tests/engine (the connector and
# async tests first), tests/distributed and docs/pictures.md's disaggregated-request
# tables, without the tests that replay recorded vLLM traces and without lessons.

_SCHED = "kvref/sched/scheduler.py"
_ASYNC = "kvref/sched/async_scheduler.py"

CONNECTOR_CATALOGUE: list[SeededBug] = [
    SeededBug("load-cached-before-landing",
              "an asynchronous load's blocks are cached when allocated, before the KV lands",
              _SCHED, "            delay_cache_blocks=hit.load_kv_async,\n",
              "            delay_cache_blocks=False,\n", kind="connector"),
    SeededBug("reserved-blocks-ignored-by-scheduler",
              "an asynchronous load is admitted without reserving what prefills in flight "
              "still need",
              _SCHED, "        reserved_blocks = self._inflight_prefill_reserved_blocks() \\\n"
                      "            if hit.load_kv_async else 0\n",
              "        reserved_blocks = 0\n", kind="connector"),
    SeededBug("producer-frees-at-once",
              "a producer's blocks are freed when its request finishes, while they are "
              "still being sent",
              _SCHED, "        if not (delay_free_blocks or connector_delay_free_blocks):\n",
              "        if not delay_free_blocks:\n", kind="connector"),
    SeededBug("held-requests-not-awaited",
              "the engine stops stepping while a producer still holds blocks to send",
              _SCHED, "        return bool(self.finished_req_ids) or \\\n"
                      "            len(self.requests) > self.get_num_unfinished_requests()\n",
              "        return bool(self.finished_req_ids)\n", kind="connector"),
    SeededBug("deferred-free-released-early",
              "a deferred free goes back to the pool one step before its step is processed",
              _SCHED, "self.deferred_frees[0][0] <= self.processed_step_seq:",
              "self.deferred_frees[0][0] <= self.processed_step_seq + 1:", kind="async"),
    SeededBug("consumer-never-defers",
              "a KV consumer under async scheduling frees blocks a step in flight still "
              "writes (the fence is never on)",
              _SCHED, "self.defer_block_free = self.kv_consumer and self.max_concurrent_batches > 1",
              "self.defer_block_free = self.kv_consumer and self.max_concurrent_batches > 2",
              kind="async"),
    SeededBug("deferred-free-head-first",
              "deferred blocks are freed head first, so the request's prefix is evicted first",
              _SCHED, "            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))\n",
              "            self.kv_cache_manager.block_pool.free_blocks(blocks)\n", kind="async"),
    SeededBug("fence-counts-empty-steps",
              "the deferred-free fence counts steps that schedule nothing (whose output "
              "never advances it)",
              _SCHED, "        if self.defer_block_free and output.total_num_scheduled_tokens > 0:\n",
              "        if self.defer_block_free:\n", kind="async"),
    SeededBug("whole-load-no-recompute",
              "a load of the whole prompt leaves nothing to compute (the last prompt token "
              "is not recomputed for its logits)",
              _SCHED, "                request.num_computed_tokens = request.num_tokens - 1\n",
              "                pass\n", kind="connector"),
    SeededBug("failed-block-kept",
              "a failed load goes back to the block after the first failed one, keeping it",
              _SCHED, "                request.num_computed_tokens = index * block_size\n",
              "                request.num_computed_tokens = (index + 1) * block_size\n",
              kind="connector"),
    SeededBug("fail-policy-inverted",
              "kv_load_failure_policy is read the wrong way round",
              _SCHED, 'kv_transfer_config.kv_load_failure_policy == "recompute"',
              'kv_transfer_config.kv_load_failure_policy != "recompute"', kind="connector"),
    SeededBug("failed-blocks-stay-cached",
              'under "fail" the failed blocks of a synchronous load stay in the prefix cache',
              _SCHED, "                self.kv_cache_manager.evict_blocks(sync_blocks)\n",
              "                pass\n", kind="connector"),
    SeededBug("abort-during-load-frees-now",
              "a request aborted while its load is in flight frees the blocks the load still "
              "writes into",
              _SCHED, "                delay_free_blocks = request_id not in "
                      "self.finished_recving_kv_req_ids\n",
              "                delay_free_blocks = False\n", kind="connector"),
    SeededBug("skipped-order-reversed",
              "requests skipped this step (loading, or told to ask again) come back in "
              "reverse order",
              _SCHED, "        self.skipped_waiting.extendleft(reversed(step.skipped))\n",
              "        self.skipped_waiting.extendleft(step.skipped)\n", kind="connector"),
    SeededBug("placeholders-cached",
              "async: update_from_output caches up to num_computed_tokens, placeholders "
              "included",
              _ASYNC, "                request, request.num_computed_tokens - "
                      "request.num_output_placeholders)",
              "                request, request.num_computed_tokens)", kind="async"),
    SeededBug("placeholder-for-prefill-chunk",
              "async: a prefill chunk, which samples nothing, gets an output placeholder",
              _ASYNC, "            if request.is_prefill_chunk:\n"
                      "                continue                          # samples nothing: "
                      "no placeholder\n",
              "", kind="async"),
    SeededBug("placeholders-released-per-step",
              "async: a step's placeholders are released one per step, not one per token "
              "kept",
              _ASYNC, "        request.num_output_placeholders -= len(new_token_ids)\n",
              "        request.num_output_placeholders -= min(1, len(new_token_ids))\n",
              kind="async"),
    SeededBug("load-not-reserved-for",
              "an asynchronous load is not counted among the prefills in flight (vLLM "
              "counts it, which is how stall 4's ghost reservation arises)",
              _SCHED, "        self._inflight_prefills.add(request)\n"
                      "        step.skipped.append(request)\n",
              "        step.skipped.append(request)\n", kind="connector"),
]

INVARIANT_ID = re.compile(r"\bINV-[A-Z]+-\d+\b")
FAILED_TEST = re.compile(r"^(?:FAILED|ERROR) (tests/\S+?)(?: - |$)", re.MULTILINE)

# The tensor/engine suites, fastest and most pointed files first (a bug stops
# at its first failure); files not named here run after these, in name order.
TENSOR_FIRST = ["test_block_table.py", "test_batch_buffers.py", "test_paged_attention.py",
                "test_fast_paged_attention.py", "test_cascade.py", "test_flashinfer.py",
                "test_mamba_state.py", "test_properties.py"]
ENGINE_FIRST = ["test_scheduler.py", "test_ngram_proposer.py", "test_engine_statistics.py",
                "test_max_model_len.py", "test_model_parameters.py", "test_sampling.py"]
# What replays answers recorded from vLLM is a trace, not a test of the tensor
# side or the engine: left out, so that every kill is the tests' own.
TRACE_FILES = ["tests/engine/test_vllm_scheduler_traces.py"]
TRACE_TESTS = ["tests/engine/test_ngram_proposer.py::"
               "test_vllm_recorded_cases_are_what_the_spec_and_kvref_propose"]


@dataclass
class Outcome:
    bug: SeededBug
    killed: bool            # by the catalogue's suite alone
    caught_by: str
    seconds: float
    others: bool | None = None   # unit/conformance tests also fail (None: not run)
    suite: str = ""              # tensor-engine: "tensor" or "engine", the first failure's


def check_applicable(bug: SeededBug, root: Path) -> str:
    """The file's text; ``SystemExit`` unless the bug's text occurs exactly once."""
    text = (root / bug.path).read_text()
    count = text.count(bug.old)
    if count != 1:
        raise SystemExit(f"seeded bug {bug.bug_id}: its text occurs {count} times in "
                         f"{bug.path} (must be exactly once); update the catalogue")
    return text


def apply(bug: SeededBug, root: Path) -> None:
    text = check_applicable(bug, root)
    (root / bug.path).write_text(text.replace(bug.old, bug.new))


def _copy_project(dest: Path, with_traces: bool = False) -> None:
    skip = [".git", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info"]
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        *skip, *([] if with_traces else ["traces"])))


def _ordered_tests(root: Path, folder: str, first: list[str]) -> list[str]:
    names = sorted(p.name for p in (root / "tests" / folder).glob("test_*.py"))
    ordered = [f"tests/{folder}/{n}" for n in [*(f for f in first if f in names),
                                                *(n for n in names if n not in first)]]
    return [path for path in ordered if path not in TRACE_FILES]


# The connector catalogue's suite: the connector and async tests first.
CONNECTOR_FIRST = ["test_connector_paths.py", "test_vllm_connector_stalls.py",
                   "test_async_scheduling.py", "test_scheduler.py", "test_kv_connectors.py",
                   "test_disaggregated_prefill.py", "test_kv_connector_properties.py"]


def connector_tests(root: Path) -> list[str]:
    """``tests/engine`` (connector and async tests first), ``tests/distributed``, and
    docs/pictures.md's tables of one disaggregated request."""
    return [*_ordered_tests(root, "engine", CONNECTOR_FIRST),
            *_ordered_tests(root, "distributed", []), "tests/viz/test_disagg_life.py"]


def tensor_engine_tests(bug: SeededBug, root: Path) -> list[str]:
    """``tests/tensor`` and ``tests/engine``, the bug's own side first."""
    tensor = _ordered_tests(root, "tensor", TENSOR_FIRST)
    engine = _ordered_tests(root, "engine", ENGINE_FIRST)
    tensor_side = bug.path.startswith(("kvref/attention/", "kvref/worker/block_table.py"))
    return tensor + engine if tensor_side else engine + tensor


def _run_pytest(args: list[str], copy: Path, timeout: float) -> tuple[int | None, str]:
    """pytest in ``copy``: (exit status or None on timeout, its output)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=copy, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return None, out if isinstance(out, str) else out.decode(errors="replace")
    return proc.returncode, proc.stdout + proc.stderr


def run_one(bug: SeededBug, pytest_args: list[str], also_other_suites: bool = False,
            catalogue: str = "core", timeout: float = 1800.0) -> Outcome:
    start = time.monotonic()
    others = None
    with tempfile.TemporaryDirectory(prefix=f"kvref-{bug.bug_id}-") as tmp:
        copy = Path(tmp) / "kvref"
        _copy_project(copy, with_traces=also_other_suites or catalogue != "core")
        apply(bug, copy)
        if catalogue != "core":
            tests = tensor_engine_tests(bug, copy) if catalogue == "tensor-engine" \
                else connector_tests(copy)
            status, output = _run_pytest(
                [*tests, "-x", "-q", "-p", "no:cacheprovider",
                 "--hypothesis-profile=seeded",
                 *(f"--deselect={test}" for test in TRACE_TESTS), *pytest_args],
                copy, timeout)
            return _tensor_engine_outcome(bug, status, output, time.monotonic() - start)
        status, output = _run_pytest(["tests/stateful", "-x", "-q", "-p", "no:cacheprovider",
                                      *pytest_args], copy, timeout)
        if also_other_suites:
            rest, _ = _run_pytest(["tests", "--ignore=tests/stateful", "-x", "-q",
                                   "-p", "no:cacheprovider"], copy, timeout)
            others = rest != 0
    killed = status not in (0, None)
    # The failing assertion's own line ("E   AssertionError: INV-QUEUE-2: ...")
    # names the invariant; other ids in the output come from printed source.
    # Several distinct failures come as an exception group, each line behind "| ".
    error_lines = [line for line in output.splitlines()
                   if line.startswith("E ") or line.lstrip(" |").startswith("AssertionError")]
    ids = INVARIANT_ID.findall("\n".join(error_lines))
    if status is None:
        caught_by = f"TIMEOUT after {timeout:.0f}s"
    elif ids:
        caught_by = ids[0]
    elif killed:
        caught_by = error_lines[0].lstrip(" |E").strip()[:70] if error_lines else "test failure"
    else:
        caught_by = "-"
    return Outcome(bug, killed, caught_by, time.monotonic() - start, others)


def _tensor_engine_outcome(bug: SeededBug, status: int | None, output: str,
                           seconds: float) -> Outcome:
    if status is None:
        return Outcome(bug, False, "TIMEOUT (a hang is no kill: add a step guard)", seconds)
    if status == 0:
        return Outcome(bug, False, "-", seconds)
    failed = FAILED_TEST.findall(output)
    if status not in (1, 2) or not failed:
        # 3 (internal error), 4 (usage), 5 (no tests): the run itself is broken.
        raise SystemExit(f"seeded bug {bug.bug_id}: pytest exited {status} without a "
                         f"failing test:\n{output[-3000:]}")
    test = failed[0]
    return Outcome(bug, True, test, seconds, suite=test.split("/")[1])


def write_markdown(path: Path, outcomes: list[Outcome],
                   suites: str = "tests/tensor and tests/engine") -> None:
    """The kill table as markdown: one row per bug, what it breaks and what failed first."""
    lines = ["| bug | kind | file | what it breaks | killed by (first failing test) | time |",
             "|---|---|---|---|---|---|"]
    for o in outcomes:
        verdict = f"`{o.caught_by}`" if o.killed else f"**SURVIVED** ({o.caught_by})"
        lines.append(f"| `{o.bug.bug_id}` | {o.bug.kind} | `{o.bug.path.removeprefix('kvref/')}`"
                     f" | {o.bug.description} | {verdict} | {o.seconds:.0f}s |")
    killed = sum(o.killed for o in outcomes)
    lines.append("")
    lines.append(f"{killed} of {len(outcomes)} killed by {suites} alone.")
    path.write_text("\n".join(lines) + "\n")


CATALOGUES = {"core": lambda: CATALOGUE, "tensor-engine": lambda: TENSOR_ENGINE_CATALOGUE,
              "connector": lambda: CONNECTOR_CATALOGUE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="select", default="",
                        help="only bug ids containing this (or any of several, comma-separated)")
    parser.add_argument("--catalogue", choices=sorted(CATALOGUES), default="core",
                        help="core: the KV layer against tests/stateful; tensor-engine: "
                             "worker, attention and engine against tests/tensor+tests/engine; "
                             "connector: the scheduler's connector and async paths against "
                             "tests/engine+tests/distributed")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="bugs run in parallel")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one bug's run may take (TIMEOUT: not killed)")
    parser.add_argument("--also-other-suites", action="store_true",
                        help="core catalogue: also run the unit and conformance tests on "
                             "each bug and report whether they catch it too")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="tensor-engine catalogue: also write the kill table there")
    parser.add_argument("pytest_args", nargs="*",
                        help="extra pytest arguments, e.g. --hypothesis-profile=deep")
    args = parser.parse_args(argv)
    tensor_engine = args.catalogue != "core"     # tensor-engine or connector: same report
    suites = ("tests/engine + tests/distributed" if args.catalogue == "connector"
              else "tests/tensor + tests/engine")
    if tensor_engine and args.also_other_suites:
        parser.error("--also-other-suites is for the core catalogue")
    wanted = args.select.split(",")
    bugs = [b for b in CATALOGUES[args.catalogue]() if any(w in b.bug_id for w in wanted)]
    if args.list:
        for bug in bugs:
            print(f"{bug.bug_id:30} {bug.kind:14} {bug.path:40} {bug.description}")
        return 0
    # Fail fast on a stale catalogue before spending minutes on the runs.
    for bug in bugs:
        check_applicable(bug, ROOT)

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    outcomes: list[Outcome] = []
    suite_name = suites if tensor_engine else "the stateful suite"
    with Progress(console=console) as progress, ThreadPoolExecutor(args.jobs) as pool:
        task = progress.add_task(f"running {suite_name} on each bug", total=len(bugs))
        futures = [pool.submit(run_one, bug, args.pytest_args, args.also_other_suites,
                               args.catalogue, args.timeout)
                   for bug in bugs]
        for future in futures:
            outcome = future.result()
            outcomes.append(outcome)
            progress.console.print(f"{outcome.bug.bug_id}: "
                                   f"{'killed' if outcome.killed else 'SURVIVED'} "
                                   f"({outcome.caught_by}, {outcome.seconds:.0f}s)")
            progress.advance(task)

    survived = [o.bug.bug_id for o in outcomes if not o.killed]
    if tensor_engine:
        table = Table(title=f"Seeded bugs against {suites} (descriptions: --list)")
        for column in ("bug", "kind", "verdict", "first failing test", "time"):
            table.add_column(column)
        for o in outcomes:
            table.add_row(o.bug.bug_id, o.bug.kind,
                          "[green]killed[/green]" if o.killed else "[red]SURVIVED[/red]",
                          o.caught_by, f"{o.seconds:.0f}s")
        console.print(table)
        if args.markdown:
            write_markdown(args.markdown, outcomes, suites.replace(" + ", " and "))
        console.print(f"{len(outcomes) - len(survived)} of {len(outcomes)} seeded bugs killed "
                      f"by {suites} alone (no trace, no lesson)"
                      + (f"; survived: {', '.join(survived)}" if survived else ""))
        return 1 if survived else 0

    table = Table(title="Seeded bugs against tests/stateful")
    columns = ["bug", "what it breaks", "stateful suite alone", "caught by"]
    if args.also_other_suites:
        columns.append("unit/conformance too")
    for column in (*columns, "time"):
        table.add_column(column)
    for o in outcomes:
        row = [o.bug.bug_id, o.bug.description,
               "[green]killed[/green]" if o.killed else "[red]SURVIVED[/red]", o.caught_by]
        if args.also_other_suites:
            row.append("yes" if o.others else "no")
        table.add_row(*row, f"{o.seconds:.0f}s")
    console.print(table)
    console.print(f"{len(outcomes) - len(survived)} of {len(outcomes)} seeded bugs killed "
                  "by the stateful suite alone (tests/stateful, no unit test or trace)"
                  + (f"; survived: {', '.join(survived)}" if survived else ""))
    if args.also_other_suites:
        only = [o.bug.bug_id for o in outcomes if o.killed and not o.others]
        console.print(f"{len(only)} of them caught by the state machines only "
                      "(unit and conformance tests pass)"
                      + (f": {', '.join(only)}" if only else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
