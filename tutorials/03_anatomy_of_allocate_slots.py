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
# # Lesson 03: the anatomy of `allocate_slots`
#
# Every step, vLLM's scheduler asks `KVCacheManager.allocate_slots` (in
# `vllm/v1/core/kv_cache_manager.py`) for room for each request it wants to run.
# The answer is new blocks, or `None`: "not now", and then nothing was
# allocated. The request's tokens, as the call sees them:
#
# ```
# | comp | new_comp | ext_comp | new | lookahead |
#                              |<-- computed now -->|
#        |<-------------- to allocate ------------>|
# ```
#
# - `comp`: `request.num_computed_tokens`, already in the request's blocks;
# - `new_comp`: this step's prefix hit (`num_new_computed_tokens`, with its
#   blocks `new_computed_blocks`), first allocation only;
# - `ext_comp`: tokens a KV connector will load (`num_external_computed_tokens`);
# - `new`: tokens the model computes this step, unverified draft tokens included;
# - `lookahead`: slots for the drafts an EAGLE-style proposer writes next.
#
# Then the gates that make it return `None`, and the watermark.

# %%
from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, RequestStatus, SlidingWindowSpec, get_request_block_hasher,
                   init_none_hash, sha256)
from kvref.viz import render_pool

from _lesson import claim, finish, section, show, start

args = start("The anatomy of allocate_slots")
init_none_hash(sha256)   # NONE_HASH, the first block's parent hash (lesson 02)
BLOCK_SIZE = 4


def make_manager(num_blocks, spec=None, watermark=0.0):
    spec = spec or FullAttentionSpec(BLOCK_SIZE)
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True,
                          watermark=watermark)


def request(rid, tokens, status=RequestStatus.WAITING):
    req = Request(rid, tokens, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.status = status
    return req


def hashed(manager, rid):
    """Per block of the request's table: does it carry a hash?"""
    return [b.block_hash is not None for b in manager.get_blocks(rid).blocks[0]]


# %% [markdown]
# ## 1. All five regions in one call
#
# An earlier request left the first 8 tokens cached. Request `r` has a 20-token
# prompt: 8 hit the cache (`new_comp`), a KV connector says it holds the next 4
# (`ext_comp`), 8 are computed now (`new`), and EAGLE wants 3 lookahead slots.
# That is `8 + 4 + 8 + 3 = 23` tokens, 6 blocks.

# %%
section("1. new_comp + ext_comp + new + lookahead")
manager = make_manager(16)
prefix = list(range(8))
warm = request("warm", prefix + [99])
manager.allocate_slots(warm, warm.num_tokens)
manager.free(warm)

r = request("r", prefix + list(range(100, 112)))
hit, num_hit = manager.get_computed_blocks(r)
new = manager.allocate_slots(r, num_new_tokens=8, num_new_computed_tokens=num_hit,
                             new_computed_blocks=hit, num_external_computed_tokens=4,
                             num_lookahead_tokens=3)
table = manager.get_block_ids("r")[0]
show(render_pool(manager))
show(f"hit {hit.get_block_ids()[0]}, returned as new {new.get_block_ids()[0]}, table {table}")
claim(num_hit == 8 and len(table) == 6, "8 hit tokens; the table holds 6 blocks for 23 tokens")
claim(table[:2] == hit.get_block_ids()[0], "the table starts with the two hit blocks, touched, not copied")
claim(new.get_block_ids()[0] == table[3:],
      "the call returns only the blocks for new + lookahead tokens; the connector's block (table[2]) is not among them")
claim(hashed(manager, "r") == [True] * 5 + [False],
      "blocks are cached up to request.num_tokens (20 = 5 blocks); the lookahead block is not")

# %% [markdown]
# ## 2. Decode: most steps need no block
#
# A running request computes one token per step. Only a step that crosses a
# block boundary takes a block; the others return the manager's one shared
# empty answer, `manager.empty_kv_cache_blocks`.

# %%
section("2. Decode steps")
manager = make_manager(16)
d = request("d", list(range(6)))
manager.allocate_slots(d, 6)
d.status = RequestStatus.RUNNING
d.num_computed_tokens = 6
got_block = []
for step in range(6):
    d.append_output_token_ids(1000 + step)
    out = manager.allocate_slots(d, 1)
    got_block.append(out is not manager.empty_kv_cache_blocks)
    d.num_computed_tokens += 1
show(f"token positions 6..11: new block at step? {got_block}")
claim(got_block == [False, False, True, False, False, False],
      "of 6 decode steps only the one computing token 8 (a new block's first slot) allocates")

# %% [markdown]
# ## 3. Draft tokens get slots but are not cached
#
# With speculative decoding, `new` includes draft tokens that the target model
# may reject. They get slots, but caching stops at `request.num_tokens` (the
# drafts are not appended to the request until verified): a rejected draft must
# never be a prefix hit.

# %%
section("3. Draft tokens")
manager = make_manager(16)
s = request("s", list(range(15)))
manager.allocate_slots(s, 15)
s.status = RequestStatus.RUNNING
s.num_computed_tokens = 15
s.append_output_token_ids(500)          # num_tokens 16; 4 drafts ride along
manager.allocate_slots(s, 1 + 4)
claim(len(manager.get_block_ids("s")[0]) == 5 and hashed(manager, "s") == [True] * 4 + [False],
      "slots for 20 tokens (5 blocks); only the 4 blocks of the 16 real tokens are cached")

# %% [markdown]
# ## 4. The gates: when the answer is `None`
#
# In vLLM's order:
#
# 1. `num_new_tokens == 0` with nothing to load is a caller error (`ValueError`);
# 2. `full_sequence_must_fit`: the *whole* request must fit, not just this chunk.
#    vLLM's scheduler passes `scheduler_reserve_full_isl`, true by default, so a
#    long prompt prefilled in chunks is not admitted only to be preempted halfway;
# 3. blocks left of an attention window are freed (even if the call then fails);
# 4. the blocks needed must fit in `free - reserved_blocks - watermark`.
#
# A refused call allocates nothing.

# %%
section("4a. Nothing to compute")
manager = make_manager(16)
try:
    manager.allocate_slots(request("z", [1, 2, 3]), 0)
    raised = False
except ValueError:
    raised = True
claim(raised, "allocate_slots(req, 0) without external tokens raises ValueError")

# %% [markdown]
# **Too few free blocks**, and **the whole sequence must fit**: a pool with 5
# free blocks; a 40-token prompt (10 blocks) scheduled in a first chunk of 8
# tokens (2 blocks).

# %%
section("4b. Free blocks and full_sequence_must_fit")
manager = make_manager(6)
long = request("long", list(range(40)))
before = manager.block_pool.get_num_free_blocks()
refused = manager.allocate_slots(long, 8, full_sequence_must_fit=True)
claim(refused is None and manager.block_pool.get_num_free_blocks() == before == 5
      and manager.get_block_ids("long") == ([],),
      "with full_sequence_must_fit, 10 blocks do not fit in 5: None, and nothing changed")
claim(manager.allocate_slots(long, 8) is not None,
      "without it, the 8-token chunk (2 blocks) is admitted")
claim(manager.allocate_slots(request("huge", list(range(400, 424))), 24) is None,
      "24 more tokens need 6 blocks, 3 are free: None")

# %% [markdown]
# **A hit can cost free blocks.** Hit blocks that nobody holds sit in the free
# queue (lesson 01). Touching them takes them out, so they count against the
# free blocks exactly like new ones. Below, 3 blocks are free and 2 of them are
# the hit: a request needing 2 new blocks on top of its hit is refused.

# %%
section("4c. Free cached hit blocks count as needed")
manager = make_manager(6)
warm = request("warm", list(range(8)) + [99])
manager.allocate_slots(warm, warm.num_tokens)
manager.free(warm)
hog = request("hog", list(range(300, 308)))
manager.allocate_slots(hog, 8)
show(render_pool(manager))
one_more = request("one-more", list(range(8)) + [7, 7, 7, 7])      # hit 8, 1 new block
two_more = request("two-more", list(range(8)) + [7] * 8)           # hit 8, 2 new blocks
hit2, n2 = manager.get_computed_blocks(two_more)
refused = manager.allocate_slots(two_more, two_more.num_tokens - n2, n2, hit2)
hit1, n1 = manager.get_computed_blocks(one_more)
admitted = manager.allocate_slots(one_more, one_more.num_tokens - n1, n1, hit1)
claim(manager.block_pool.get_num_free_blocks() == 0 and refused is None and admitted is not None,
      "2 hit + 2 new = 4 > 3 free: refused; 2 hit + 1 new = 3: admitted, and the pool is full")

# %% [markdown]
# **The watermark** keeps a fraction of the pool free when *admitting* requests
# (status `WAITING` or `PREEMPTED`), so that running requests can still grow
# without being preempted. It applies only when some request is already
# scheduled (`has_scheduled_reqs`), so an engine with nothing running still
# admits. Here
# `watermark=0.2` of 20 blocks keeps 4 blocks back.

# %%
section("4d. The watermark")
manager = make_manager(20, watermark=0.2)
filler = request("filler", list(range(48)), status=RequestStatus.RUNNING)
manager.allocate_slots(filler, 48)                        # 12 blocks, 7 free left
show(f"watermark_blocks = {manager.watermark_blocks}, free = "
     f"{manager.block_pool.get_num_free_blocks()}")
waiting = request("waiting", list(range(600, 616)))       # needs 4 blocks
claim(manager.watermark_blocks == 4, "watermark_blocks = int(0.2 * 20) = 4")
claim(manager.allocate_slots(waiting, 16) is None,
      "a WAITING request needing 4 of 7 free blocks is refused: 4 + 4 > 7")
claim(manager.allocate_slots(waiting, 16, has_scheduled_reqs=False) is not None,
      "the same request is admitted when nothing else is scheduled")
manager.free(waiting)
filler.num_computed_tokens = 48
filler.append_output_token_ids(list(range(900, 916)))
claim(manager.allocate_slots(filler, 16) is not None,
      "a RUNNING request may take 4 blocks: the watermark is not for it")

# %% [markdown]
# **Sliding windows free first.** Before checking space, `allocate_slots` frees
# the blocks no future token reads; vLLM keeps that freeing even when the call
# then returns `None` (it only helps). A window of 4 with 16 tokens computed
# reads tokens 13..16: the first 3 blocks go back to the pool although the
# request asks for far more than fits.

# %%
section("4e. A refused call still frees out-of-window blocks")
manager = make_manager(6, spec=SlidingWindowSpec(BLOCK_SIZE, sliding_window=4))
w = request("w", list(range(16)), status=RequestStatus.RUNNING)
manager.allocate_slots(w, 16)
w.num_computed_tokens = 16
w.append_output_token_ids(list(range(40)))
free_before = manager.block_pool.get_num_free_blocks()
refused = manager.allocate_slots(w, 40)
show(render_pool(manager))
claim(refused is None and free_before == 1 and manager.block_pool.get_num_free_blocks() == 4,
      "the call returned None, yet the 3 blocks outside the window went back (1 -> 4 free)")
claim(manager.get_block_ids("w")[0][:3] == [0, 0, 0], "their places in w's table hold the null block")

# %%
finish()
