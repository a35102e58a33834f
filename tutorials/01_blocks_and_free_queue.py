# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 01: blocks, the null block and the free queue
#
# vLLM cuts the KV cache into fixed-size **blocks** of `block_size` token slots.
# One `BlockPool` (`vllm/v1/core/block_pool.py`) owns them all and keeps the
# unused ones in a **free queue** (`FreeKVCacheBlockQueue` in
# `vllm/v1/core/kv_cache_utils.py`): a doubly linked list threaded through the
# blocks themselves, head = reused next.
#
# This lesson drives kvref's pool through the scheduler-facing `KVCacheManager`
# and watches four things: the null block, allocation from the head, the order
# in which freed blocks return (tail first, unhashed ones to the front), and a
# prefix hit pulling a block out of the middle of the queue.
#
# Run: `python tutorials/01_blocks_and_free_queue.py`. In the pictures:
# `∅` null block, `●n` in use by n requests, `◉n` in use and cached,
# `○` free but still cached (can be hit or evicted), `·` free and empty.

# %%
from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, SlidingWindowSpec, get_request_block_hasher,
                   init_none_hash, sha256)
from kvref.kv_events import BlockRemoved
from kvref.viz import render_pool
from kvref.viz.html_player import Player
from kvref.viz.player import TracePlayer
from kvref.viz.workloads import record_workload

from _lesson import claim, finish, section, show, start

args = start("Blocks, the null block and the free queue")
# Block hashes chain from NONE_HASH, the first block's parent; set it once per
# process before any request is hashed (lesson 02: where it comes from).
init_none_hash(sha256)
BLOCK_SIZE = 4


def make_manager(spec, num_blocks=10):
    """A one-group manager with prefix caching and KV events on."""
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True,
                          enable_kv_cache_events=True)


def request(rid, tokens):
    return Request(rid, tokens, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def queue_ids(manager):
    """The free queue, head (evicted first) to tail."""
    return [b.block_id for b in manager.block_pool.free_block_queue]


# %% [markdown]
# ## 1. Ten blocks, and block 0 is not one you can have
#
# The pool pops its first block at start-up and keeps it as the **null block**:
# a placeholder that fills table slots a request no longer needs (outside a
# sliding window, before a local-attention chunk, old Mamba states). It is never
# in the free queue, so a 10-block pool has 9 blocks to give.

# %%
section("1. A fresh pool")
manager = make_manager(FullAttentionSpec(block_size=BLOCK_SIZE))
pool = manager.block_pool
show(render_pool(manager))
claim(pool.null_block.block_id == 0 and pool.null_block.is_null,
      "block 0 is the null block")
claim(pool.get_num_free_blocks() == 9, "9 of 10 blocks are free: the null block is never handed out")
claim(queue_ids(manager) == list(range(1, 10)), "the free queue starts in block-id order 1..9")

# %% [markdown]
# ## 2. Allocation pops from the head
#
# Request `a` has a 10-token prompt. Ten tokens need `ceil(10 / 4) = 3` blocks;
# the last one holds 2 tokens and 2 empty slots. That waste, at most
# `block_size - 1` slots per request, is all the fragmentation paging leaves
# (lesson 00 measures it).
#
# Blocks that are *full* get their hash at once (`cache_blocks` runs inside
# `allocate_slots`): from now on another request can hit them.

# %%
section("2. Allocate 10 tokens")
a = request("a", list(range(10)))
new = manager.allocate_slots(a, 10)
show(render_pool(manager))
claim(new.get_block_ids() == ([1, 2, 3],), "the 3 blocks come from the head of the queue: 1, 2, 3")
claim([pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1], "each block is held once (ref_cnt 1)")
claim(pool.blocks[1].block_hash is not None and pool.blocks[2].block_hash is not None
      and pool.blocks[3].block_hash is None,
      "the two full blocks are cached at once; the half-full block 3 has no hash")

# %% [markdown]
# ## 3. Freeing: the tail first, and unhashed blocks to the front
#
# `free(a)` hands the blocks back **in reverse** (3, 2, 1): the order in which
# they should be evicted. Then the pool sorts them:
#
# - block 3 has no hash, so nobody can ever hit it: it goes to the **head** and
#   is reused first;
# - blocks 2 and 1 are cached: they go to the **tail**, in the order given, so
#   block 2 (the end of the prefix) is evicted before block 1 (its start). A hit
#   on block 2 needs block 1 anyway (hashes chain), while block 1 alone still
#   serves every request that shares the first 4 tokens.
#
# Freed is not forgotten: blocks 1 and 2 keep their hash at `ref_cnt` 0.

# %%
section("3. Free request a")
manager.free(a)
show(render_pool(manager))
queue = queue_ids(manager)
claim(queue[0] == 3, "the unhashed block 3 is at the head: reused first")
claim(queue[-2:] == [2, 1], "cached blocks go to the tail, prefix end (2) before prefix start (1)")
claim(pool.blocks[1].ref_cnt == 0 and pool.blocks[1].block_hash is not None,
      "block 1 is free (ref_cnt 0) and still cached")

# %% [markdown]
# ## 4. A prefix hit revives blocks from the middle of the queue
#
# Request `b` starts with the same 8 tokens. `get_computed_blocks` finds blocks
# 1 and 2 by hash; `allocate_slots` *touches* them: their `ref_cnt` goes to 1 and
# they leave the free queue. They sit anywhere in the queue, which is why it is
# a linked list: unlinking a block is O(1), where a `deque` would scan.

# %%
section("4. Request b hits the cached prefix")
b = request("b", list(range(8)) + [100, 101, 102])
hit, num_hit = manager.get_computed_blocks(b)
manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit)
show(render_pool(manager))
claim(hit.get_block_ids() == ([1, 2],) and num_hit == 8, "b hits blocks 1 and 2: 8 tokens")
claim(1 not in queue_ids(manager) and 2 not in queue_ids(manager),
      "the hit blocks left the free queue (they cannot be evicted while in use)")
claim(manager.get_block_ids("b") == ([1, 2, 3],),
      "b's one new block is block 3, the head of the queue")

# %% [markdown]
# ## 5. Sharing: `ref_cnt` counts the requests holding a block
#
# A third request with the same start holds blocks 1 and 2 too. Freeing it drops
# the count again, but the blocks stay out of the queue: `b` still holds them.

# %%
section("5. Two requests share blocks 1 and 2")
c = request("c", list(range(8)) + [200, 201, 202, 203, 204])
hit, num_hit = manager.get_computed_blocks(c)
manager.allocate_slots(c, c.num_tokens - num_hit, num_hit, hit)
show(render_pool(manager))
claim(pool.blocks[1].ref_cnt == 2 and pool.blocks[2].ref_cnt == 2,
      "blocks 1 and 2 are held by b and c (ref_cnt 2)")
manager.free(c)
claim(pool.blocks[1].ref_cnt == 1 and 1 not in queue_ids(manager),
      "after c is freed, block 1 is still held by b and stays out of the queue")

# %% [markdown]
# ## 6. Eviction happens only when a cached block is reused
#
# Free `b` and ask for one block fewer than the pool has free. `get_new_blocks`
# pops from the head; a cached block it pops loses its hash right there (a
# `BlockRemoved` event). That is the only eviction that makes room; the other
# two calls that drop hashes free no block: `evict_blocks` (a failed KV load,
# lesson 07) and `reset_prefix_cache` (all of them). Two of the
# popped blocks were cached (block 2, and block 4 that `c` filled). The queue put
# block 1 last, so it survives, and a request sharing the first 4 tokens still
# hits it.

# %%
section("6. A big request evicts cached blocks in queue order")
manager.free(b)
manager.take_events()  # start counting events from here
order = queue_ids(manager)
cached_popped = [i for i in order[:8] if pool.blocks[i].block_hash is not None]
show(f"free queue before: {order}; cached among the first 8: {cached_popped}")
big = request("big", list(range(1000, 1000 + 4 * 8)))
manager.allocate_slots(big, big.num_tokens)
removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
show(render_pool(manager))
claim(manager.get_block_ids("big") == (order[:8],), "the 8 blocks are the first 8 of the free queue, in order")
claim(len(removed) == len(cached_popped) == 2,
      "the 2 cached blocks among them lost their hash (2 BlockRemoved events), no other")
claim(order[-1] == 1 and pool.blocks[1].block_hash is not None,
      "block 1, last in the queue, was not popped and is still cached")
probe = request("probe", list(range(4)) + [7, 7, 7])
claim(manager.get_computed_blocks(probe)[1] == 4, "a request sharing the first 4 tokens still hits block 1")
manager.free(big)

# %% [markdown]
# ## 7. The null block inside a block table
#
# A sliding-window layer (window 4) never reads a token more than 3 positions
# back. Once 12 tokens are computed, the next token reads tokens 9..12, so the
# first `12 - 4 + 1 = 9` tokens are *skipped* (vLLM's
# `SlidingWindowManager.get_num_skipped_tokens`): their two full blocks are
# freed and the table keeps its length with the null block in their place.
#
# The null block's `ref_cnt` is not kept: freeing a table with null entries
# decrements it, nothing increments it (vLLM's `BlockPool` says so; nothing
# reads it).

# %%
section("7. A sliding window leaves null blocks behind")
sw = make_manager(SlidingWindowSpec(block_size=BLOCK_SIZE, sliding_window=4))
r = request("r", list(range(12)))
sw.allocate_slots(r, 12)
r.num_computed_tokens = 12
r.append_output_token_ids(12)
sw.allocate_slots(r, 1)
show(render_pool(sw))
table = sw.get_block_ids("r")[0]
claim(table[:2] == [0, 0] and 0 not in table[2:],
      "the two blocks of tokens 0..7 became the null block in r's table")
claim(0 not in queue_ids(sw) and len(table) == 4,
      "the table keeps its length (4 blocks for 13 tokens); block 0 is still not in the queue")
sw.free(r)
claim(sw.block_pool.null_block.ref_cnt < 0,
      "after freeing r the null block's ref_cnt is negative: vLLM does not maintain it")

# %% [markdown]
# ## 8. A whole run, op by op
#
# Everything above, at once and under load: the `pressure` workload runs 8 long
# requests through the engine's scheduler on a 24-block pool (the same
# scheduler calls vLLM's makes). The player below is what
# `kvref viz TRACE --export player.html` writes, shown inline: every op's state
# was read from a real replay of the run. It opens at the first allocation that
# evicts: watch the free queue (empty blocks at its head, cached `○` ones behind
# them) and the cells the allocation takes from its head. Keys: `n`/`p` step,
# `.`/`,` op (or the sliders), `c` colours the grid by request, hover a block for
# its ref count, hash, holders and place in the queue.

# %%
section("8. The pressure workload, op by op")
trace = record_workload("pressure")
run = TracePlayer(trace)
run.seek(len(run.ops))
evicting = next(f for f in run.facts if f.evicted)
run.seek(evicting.index)                        # the state just before that op
queue_before = [b.block_id for b in run.manager.block_pool.free_block_queue.get_all_free_blocks()]
new_blocks = [b for group in evicting.observed["ret"] for b in group]
player = Player(trace, start_op=evicting.index)
claim(len(player.data["frames"]) == len(trace["ops"]),
      f"the page holds a state for every one of the {len(trace['ops'])} ops")
claim(new_blocks == queue_before[:len(new_blocks)],
      f"op {evicting.index} takes its new block(s) {new_blocks} from the head of the free queue")
claim(set(evicting.evicted) <= set(new_blocks) and "evicts cached" in
      player.data["ops"][evicting.index][2],
      f"the cached ones among them ({', '.join(map(str, evicting.evicted))}) are evicted, "
      "and the page says so")
show(f"`Player(trace)` in a notebook shows the page; here: kvref record --workload pressure "
     f"-o p.json && kvref viz p.json --op {evicting.index} --export player.html")

# %%
player

# %%
finish()
