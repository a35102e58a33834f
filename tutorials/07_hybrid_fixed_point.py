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
# # Lesson 07: hybrid models, one hit length every group accepts
#
# A hybrid model mixes layer types: full attention with sliding-window layers
# (Gemma 3, gpt-oss), or with Mamba-style linear-attention layers (Jamba,
# NemotronH, Qwen3-Next). vLLM gives each type its own **KV cache group**; all
# groups share one block pool, and each group caches its own blocks.
#
# A prefix hit is only usable if *every* group can serve it, and each type
# answers differently:
#
# - full attention needs every block of the prefix;
# - a sliding window needs only the last `ceil((window - 1) / block_size)` blocks
#   before the hit's end;
# - Mamba needs only the single state block at the hit's end.
#
# `HybridKVCacheCoordinator.find_longest_cache_hit`
# (`vllm/v1/core/kv_cache_coordinator.py`) finds the answer as a **fixed
# point**: start from the longest possible length, let each type cut it down to
# what it can serve, repeat until nobody cuts. Lengths only go down, so it ends.
# This lesson records each lookup the real coordinator makes and draws it
# (`_fixed_point.py` next to this file wraps each type's search in a recorder;
# the real search still runs).

# %%
from rich.text import Text

from kvref import (FullAttentionManager, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                   KVCacheManager, MambaManager, MambaSpec, Request, SlidingWindowManager,
                   SlidingWindowSpec, get_request_block_hasher, init_none_hash, sha256)

from _fixed_point import cached_row, draw_lookups, recorded_lookups
from _lesson import claim, finish, section, show, start

args = start("Hybrid models: the fixed point")
init_none_hash(sha256)   # NONE_HASH, the first block's parent hash (lesson 02)
BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE)
WINDOW_8 = SlidingWindowSpec(BLOCK_SIZE, sliding_window=8)
MAMBA = MambaSpec(BLOCK_SIZE, mamba_cache_mode="all")
GROUP_NAMES = {FullAttentionManager: "full", SlidingWindowManager: "window 8",
               MambaManager: "mamba"}


def make_manager(*specs):
    config = KVCacheConfig(40, [KVCacheGroupSpec([f"layer.{i}"], spec)
                                for i, spec in enumerate(specs)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK_SIZE,
                          hash_block_size=BLOCK_SIZE, enable_caching=True)


def request(rid, num_tokens):
    return Request(rid, list(range(num_tokens)),
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


# %% [markdown]
# ## 1. A cache with holes
#
# Three groups, block size 4: full attention, a sliding window of 8 (a hit must
# end in 2 cached blocks in a row), Mamba in `all` mode (a hit must end on a
# cached state). One 33-token request caches 8 full blocks in every group.
# Then holes: here `evict_blocks` makes them (vLLM's scheduler calls it to drop
# blocks a KV connector failed to load). In a running server they come from
# eviction itself:
# each group's blocks return to the free queue at different times (a window
# frees what falls out of it while the request still runs), so groups lose
# blocks of the same prefix at different times.
#
# ```
# block            0  1  2  3  4  5  6  7
# full attention   x  x  x  x  x  x  x  x
# sliding window   x  .  x  x  x  .  .  .
# mamba state      x  .  x  .  .  .  .  .
# ```

# %%
section("1. The cache")
manager = make_manager(FULL, WINDOW_8, MAMBA)
seed = request("seed", 33)
manager.allocate_slots(seed, 33)
_, window_ids, mamba_ids = manager.get_block_ids("seed")
manager.evict_blocks({window_ids[i] for i in (1, 5, 6, 7)}
                     | {mamba_ids[i] for i in (1, 3, 4, 5, 6, 7)})
manager.free(seed)
probe = request("probe", 33)
hashes = probe.block_hashes[:8]
rows = ["".join("x" if manager.block_pool.get_cached_block(h, [g]) else "." for h in hashes)
        for g in range(3)]
for name, g in (("full", 0), ("window 8", 1), ("mamba", 2)):
    show(Text(f"{name:>9} ").append(cached_row(manager, g, hashes, BLOCK_SIZE)))
claim(rows == ["xxxxxxxx", "x.xxx...", "x.x....."], "the cache has the holes drawn above")

# %% [markdown]
# ## 2. The fixed point, lookup by lookup
#
# A new 33-token request may hit at most 32 tokens (lesson 02: never the last
# token). Full attention goes first: its left-to-right scan is cheap and gives
# the others a tight start. After its first lookup it is only *trimmed*: a full-
# attention hit is prefix-closed, any shorter length is served too.
#
# Watch the length fall: the window finds its run of 2 at blocks 3-4 (20
# tokens); Mamba's last state at or before block 4 is block 2 (12); in the next
# pass the window has no run of 2 ending by block 2, so only block 0 (4); Mamba
# accepts 4; a third pass changes nothing.

# %%
section("2. Lookups")
with recorded_lookups(GROUP_NAMES) as calls:
    hit, num_hit = manager.get_computed_blocks(probe)
show(draw_lookups(manager, calls, hashes, GROUP_NAMES, BLOCK_SIZE))
lengths = [(GROUP_NAMES[cls], length_in, length_out) for cls, length_in, length_out in calls]
claim(lengths[:3] == [("full", 32, 32), ("window 8", 32, 20), ("mamba", 20, 12)],
      "pass 1: full accepts 32, the window cuts to 20, Mamba to 12")
claim(lengths[3:5] == [("window 8", 12, 4), ("mamba", 4, 4)],
      "pass 2: full is only trimmed (no lookup); the window cuts to 4, Mamba accepts")
claim(lengths[5:] == [("window 8", 4, 4), ("mamba", 4, 4)],
      "pass 3: nobody cuts, so 4 is the fixed point")
claim(num_hit == 4 and hit.get_block_ids() == ([1], [10], [19]),
      "the agreed hit is 4 tokens: one block per group")

# %% [markdown]
# Full attention had 32 tokens cached, yet only 4 are usable. vLLM's scheduler
# reads this gap (`num_uncached_common_prefix_tokens`): tokens of a prefix some
# group cached that the agreed hit does not cover.

# %%
claim(manager.coordinator.num_uncached_common_prefix_tokens == 28,
      "28 tokens were cached in some group but are not part of the hit")

# %% [markdown]
# ## 3. One Mamba state more, and the hit jumps to 20
#
# Keep Mamba's state after block 4 and the first pass already agrees: window 20,
# Mamba 20, and the second pass confirms. The hit blocks show what each type
# really needs: full attention all 5 blocks, the window only its last 2 (the
# rest are the null block), Mamba only its last.

# %%
section("3. Mamba keeps the state after block 4")
manager = make_manager(FULL, WINDOW_8, MAMBA)
seed = request("seed", 33)
manager.allocate_slots(seed, 33)
_, window_ids, mamba_ids = manager.get_block_ids("seed")
manager.evict_blocks({window_ids[i] for i in (1, 5, 6, 7)}
                     | {mamba_ids[i] for i in (1, 3, 5, 6, 7)})
manager.free(seed)
with recorded_lookups(GROUP_NAMES) as calls:
    hit, num_hit = manager.get_computed_blocks(request("probe", 33))
show(draw_lookups(manager, calls, hashes, GROUP_NAMES, BLOCK_SIZE))
show(f"hit block ids per group (0 is the null block): {hit.get_block_ids()}")
claim(num_hit == 20, "the agreed hit is 20 tokens")
claim([sum(not b.is_null for b in group) for group in hit.blocks] == [5, 2, 1],
      "real blocks in the hit: full 5, window 2, Mamba 1; the rest are the null block")

# %% [markdown]
# ## 4. Full attention plus one other type settles in one pass
#
# Most hybrid models have exactly two types, full attention and one other. Then
# one pass is enough: whatever the other type accepts, full attention (prefix-
# closed) accepts too, and vLLM skips the confirming pass.

# %%
section("4. Two types: one pass")
manager = make_manager(FULL, WINDOW_8)
seed = request("seed", 33)
manager.allocate_slots(seed, 33)
manager.evict_blocks({manager.get_block_ids("seed")[1][i] for i in (5, 6, 7)})
manager.free(seed)
with recorded_lookups(GROUP_NAMES) as calls:
    hit, num_hit = manager.get_computed_blocks(request("probe", 33))
show(draw_lookups(manager, calls, hashes, GROUP_NAMES, BLOCK_SIZE))
claim([(GROUP_NAMES[c], i, o) for c, i, o in calls] == [("full", 32, 32), ("window 8", 32, 20)],
      "full + window: two lookups, one pass, no confirming pass")
claim(num_hit == 20 and len(hit.blocks[0]) == 5,
      "the full-attention hit is trimmed to the agreed 20 tokens")

# %%
finish()
