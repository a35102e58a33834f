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
# # Lesson 12: capacity math
#
# Before serving anything, vLLM turns the GPU memory left over for the KV cache
# into a number of blocks, and logs how many requests of `max_model_len` tokens
# fit ("Maximum concurrency"). The arithmetic lives in
# `vllm/v1/core/kv_cache_utils.py` and in each spec's `max_memory_usage_bytes`
# (`vllm/v1/kv_cache_interface.py`); kvref mirrors it under the same names
# (`get_num_blocks`, `get_uniform_page_size`, `max_memory_usage_bytes`,
# `get_max_concurrency_for_kv_cache_config`, `estimate_max_model_len`; see
# `specs/capacity.md`). vLLM reads the lengths from its `VllmConfig`; kvref's
# functions take them as keyword arguments (or, in vLLM's form, a config).
# Section 5 builds the groups themselves from per-layer specs, as vLLM does.
#
# The sizes below are real models' shapes, in bytes; nothing is allocated. Each
# answer is then checked on a small pool with the real `KVCacheManager`.

# %%
from rich.table import Table

from kvref import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                   KVCacheGroupSpec, KVCacheManager, MambaSpec, Request, SlidingWindowSpec,
                   capacity_config, estimate_max_model_len, get_kv_cache_configs,
                   get_max_concurrency_for_kv_cache_config, get_num_blocks,
                   get_uniform_page_size, max_memory_usage_bytes)

from _lesson import claim, finish, section, show, start

args = start("Capacity math")
GiB = 2**30

# %% [markdown]
# ## 1. Bytes to blocks
#
# One block of one attention layer holds a key and a value per token, KV head
# and channel: `page_size_bytes = 2 * block_size * num_kv_heads * head_size *
# dtype_size`. Every layer keeps its own tensor with one page per block, so a
# budget buys `available_memory // page_size // num_layers` blocks, the null
# block among them. A Llama-3-8B layer (8 KV heads of 128 channels, bfloat16)
# with block size 16 takes 64 KiB per block; 8 GiB over its 32 layers buys
# 4096 blocks.

# %%
section("1. A Llama-3-8B-shaped pool")
layer = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype="bfloat16")
num_blocks = get_num_blocks(num_layers=32, available_memory=8 * GiB,
                            page_size=layer.page_size_bytes)
show(f"page_size_bytes {layer.page_size_bytes}, num_blocks {num_blocks}, "
     f"tokens {(num_blocks - 1) * 16} (the null block holds none)")
claim(layer.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536, "one page is 64 KiB")
claim(num_blocks == 4096, "8 GiB / 64 KiB / 32 layers = 4096 blocks")

# %% [markdown]
# ## 2. Blocks a request holds at its peak, per attention type
#
# `L = max_model_len`, `T = max_num_batched_tokens` (the largest chunk a step
# schedules), `B` the block size, `S` Mamba's speculative blocks:
#
# | type | peak blocks | why |
# |---|---|---|
# | full | `cdiv(L, B)` | nothing is freed before the end |
# | sliding window `W` | `cdiv(min(W - 1 + T, L), B) + 1` | the window's `W - 1` tokens and one chunk, plus a block for a window that starts mid-block |
# | chunked local `C` | `cdiv(min(C + T, L), B)` | one attention chunk and one step's chunk |
# | Mamba `all` / `align` / `none` | `cdiv(L, B) + S` / `2 + S` / `1 + S` | lesson 08 |
#
# Below for `L = 32768`, `T = 2048`, `B = 16`.

# %%
section("2. Peak blocks per request")
L, T, BS = 32768, 2048, 16
specs = {
    "full attention": FullAttentionSpec(BS),
    "sliding window 1024": SlidingWindowSpec(BS, 1024),
    "chunked local 8192": ChunkedLocalAttentionSpec(BS, 8192),
    "Mamba all": MambaSpec(BS, "all"),
    "Mamba align": MambaSpec(BS, "align"),
    "Mamba none": MambaSpec(BS, "none"),
}
peaks = {name: spec.max_num_blocks_per_request(max_model_len=L, max_num_batched_tokens=T)
         for name, spec in specs.items()}
table = Table("type", "peak blocks per request", "tokens of KV that is", box=None,
              header_style="bold")
for name, peak in peaks.items():
    table.add_row(name, str(peak), str(peak * BS) if "Mamba" not in name else "(states)")
show(table)
claim(peaks == {"full attention": 2048, "sliding window 1024": 193, "chunked local 8192": 640,
                "Mamba all": 2048, "Mamba align": 2, "Mamba none": 1},
      "full 2048, window 193, chunked 640, Mamba all 2048 / align 2 / none 1")

# %% [markdown]
# The window's bound is what a request really reaches. A small case: window 6,
# block 4, chunks of 5 tokens: the bound is `cdiv(6 - 1 + 5, 4) + 1 = 4`. An
# 80-token prompt prefilled chunk by chunk through the real manager holds at
# most 4 real blocks at once, while its table grows to 20 entries.

# %%
window = SlidingWindowSpec(4, 6)
bound = window.max_num_blocks_per_request(max_model_len=200, max_num_batched_tokens=5)
manager = KVCacheManager(KVCacheConfig(64, [KVCacheGroupSpec(["swa.0"], window)]),
                         max_model_len=200, scheduler_block_size=4, hash_block_size=4,
                         max_num_batched_tokens=5, enable_caching=False)
r = Request("long", list(range(80)))
peak = 0
while r.num_computed_tokens < 80:
    chunk = min(5, 80 - r.num_computed_tokens)
    manager.allocate_slots(r, chunk)
    r.num_computed_tokens += chunk
    peak = max(peak, sum(not b.is_null for b in manager.get_blocks("long").blocks[0]))
show(f"bound {bound}, peak {peak}, table entries {len(manager.get_block_ids('long')[0])}")
claim(bound == 4 and peak == 4, "the request peaks at exactly the bound, 4 blocks")

# %% [markdown]
# The same per-group numbers, summed, are the smallest pool an engine starts
# with: vLLM's start-up check (`_check_enough_kv_cache_memory` over
# `_max_memory_usage_bytes_from_groups`) wants one request of `max_model_len`
# to fit, and kvref's `LLM` refuses a smaller `num_gpu_blocks` with the same
# sum (plus the null block). A window can need one block more than the whole
# sequence: with `max_model_len` 64, block 4, window 8 and a 2048-token batch,
# `cdiv(min(8 - 1 + 2048, 64), 4) + 1 = 17`, while the sequence fills 16.

# %%
short = SlidingWindowSpec(4, 8).max_num_blocks_per_request(max_model_len=64,
                                                           max_num_batched_tokens=2048)
show(f"window 8, block 4, max_model_len 64: {short} blocks; full attention: "
     f"{FullAttentionSpec(4).max_num_blocks_per_request(max_model_len=64)}")
claim(short == 17, "the window group's start-up share is 17 blocks, one more than 64 / 4")

# %% [markdown]
# ## 3. How many requests fit
#
# `get_max_concurrency_for_kv_cache_config` divides the pool by one request's
# peak, summed over groups: the "Maximum concurrency for N tokens per request"
# vLLM logs at start-up. For the Llama pool of section 1 and `L = 8192`:
# `4096 / 512 = 8`. It assumes every request reaches `L` and shares nothing,
# and it divides all blocks, the null block included, so for such requests it
# is slightly high; real traffic (shorter requests, shared prefixes) fits more.
#
# On a pool of 9 blocks of 4 tokens, `L = 8` gives `9 / 2 = 4.5`: the real
# manager admits 4 requests of 8 tokens and refuses a fifth.

# %%
section("3. Maximum concurrency")
llama = KVCacheConfig(4096, [KVCacheGroupSpec([f"layers.{i}" for i in range(32)], layer)])
llama_concurrency = get_max_concurrency_for_kv_cache_config(llama, max_model_len=8192)
small = KVCacheConfig(9, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
small_concurrency = get_max_concurrency_for_kv_cache_config(small, max_model_len=8)
manager = KVCacheManager(small, max_model_len=8, scheduler_block_size=4, hash_block_size=4,
                         enable_caching=False)
admitted = [manager.allocate_slots(Request(f"r{i}", list(range(8))), 8) is not None
            for i in range(5)]
show(f"Llama-3-8B, 8 GiB, L = 8192: {llama_concurrency}; small pool: {small_concurrency}, "
     f"admitted {admitted}")
claim(llama_concurrency == 8.0, "4096 blocks / 512 per request = 8 requests of 8192 tokens")
claim(small_concurrency == 4.5 and admitted == [True] * 4 + [False],
      "9 blocks / 2 = 4.5; the manager admits 4 and refuses the fifth")

# %% [markdown]
# ## 4. What a hybrid layout saves
#
# A Gemma-3-like model: 48 layers, of which 40 use a sliding window of 1024 and
# 8 full attention (8 KV heads of 128, bfloat16, block 16), 8 GiB of KV cache,
# `L = 32768`, `T = 2048`. Compare two layouts:
#
# - **as if every layer were full attention**: one group of 48 layers;
# - **hybrid**, as vLLM lays it out: groups of equal size, here 6 groups of 8
#   layers (1 full, 5 window). Every group's `j`-th layer shares tensor `j`, so
#   there are 8 tensors, each `num_blocks` pages: the pool has `8 GiB / page /
#   8` blocks, about six times as many, and a request takes blocks in all 6
#   groups.
#
# A window layer holds 193 blocks at its peak instead of 2048, so a request's
# peak falls from `48 * 2048` pages to `8 * 2048 + 40 * 193`.

# %%
section("4. Full attention everywhere vs. the hybrid layout")
L = 32768
full = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype="bfloat16")
swa = SlidingWindowSpec(16, 1024, num_kv_heads=8, head_size=128, dtype="bfloat16")
page = get_uniform_page_size([full, swa])
all_full = KVCacheConfig(
    get_num_blocks(num_layers=48, available_memory=8 * GiB, page_size=page),
    [KVCacheGroupSpec([f"layers.{i}" for i in range(48)], full)])
groups = [KVCacheGroupSpec([f"full.{i}" for i in range(8)], full)] + \
    [KVCacheGroupSpec([f"swa{g}.{i}" for i in range(8)], swa) for g in range(5)]
hybrid = KVCacheConfig(get_num_blocks(num_layers=8, available_memory=8 * GiB, page_size=page),
                       groups)
per_request = {
    "all full": max_memory_usage_bytes([full] * 48, max_model_len=L, max_num_batched_tokens=T),
    "hybrid": max_memory_usage_bytes([full] * 8 + [swa] * 40, max_model_len=L,
                                     max_num_batched_tokens=T)}
concurrency = {
    "all full": get_max_concurrency_for_kv_cache_config(all_full, max_model_len=L,
                                                        max_num_batched_tokens=T),
    "hybrid": get_max_concurrency_for_kv_cache_config(hybrid, max_model_len=L,
                                                      max_num_batched_tokens=T)}
longest = {
    "all full": estimate_max_model_len([full] * 48, 8 * GiB, max_model_len=10**6,
                                       max_num_batched_tokens=T),
    "hybrid": estimate_max_model_len([full] * 8 + [swa] * 40, 8 * GiB, max_model_len=10**6,
                                     max_num_batched_tokens=T)}
per_group = Table("hybrid group", "layers", "peak blocks per request", box=None,
                  header_style="bold")
group_peaks = [g.kv_cache_spec.max_num_blocks_per_request(max_model_len=L,
                                                          max_num_batched_tokens=T)
               for g in hybrid.kv_cache_groups]
for g, (group, peak) in enumerate(zip(hybrid.kv_cache_groups, group_peaks)):
    per_group.add_row(f"{g}: {type(group.kv_cache_spec).__name__}",
                      str(len(group.layer_names)), str(peak))
per_group.add_row("a request, all groups", "48", str(sum(group_peaks)))
show(per_group)
claim(group_peaks == [2048] + [193] * 5,
      "per group: 2048 blocks for the full-attention group, 193 for each window group")
table = Table("layout", "pool blocks", "peak bytes per request", "requests of 32768 tokens",
              "longest request alone", box=None, header_style="bold")
for name, config in (("all full", all_full), ("hybrid", hybrid)):
    table.add_row(name, str(config.num_blocks), f"{per_request[name] / GiB:.2f} GiB",
                  f"{concurrency[name]:.2f}", f"{longest[name]} tokens")
show(table)
claim(all_full.num_blocks == 2730 and hybrid.num_blocks == 16384,
      "8 GiB of 64 KiB pages: 2730 blocks over 48 tensors, 16384 over 8 (about 6 times as many)")
claim(per_request["hybrid"] == (8 * 2048 + 40 * 193) * page,
      "a request's peak: 8 full layers of 2048 pages + 40 window layers of 193")
claim(round(concurrency["all full"], 2) == 1.33 and round(concurrency["hybrid"], 2) == 5.44,
      "1.33 requests of 32768 tokens fit if every layer keeps everything, 5.44 with the "
      "hybrid layout (2730 / 2048 and 16384 / (2048 + 5 * 193))")
claim(longest == {"all full": 43680, "hybrid": 246704},
      "the longest request that fits alone: 43680 tokens, or 246704 with the hybrid layout")

# %% [markdown]
# ## 5. Who decides the groups: the KV cache config builder
#
# Section 4 wrote the hybrid layout down by hand. In vLLM nobody does: the
# model runner reports one spec per layer, `{layer name: spec}`, and
# `get_kv_cache_configs` (`kv_cache_utils.py`) turns that and the free bytes
# into the `KVCacheConfig` every lesson starts from:
#
# 1. **groups** (`get_kv_cache_groups`): equal specs make one group; several
#    attention types are first given one page size, then each type's layers
#    are dealt round-robin (`layers[i::n]`) into groups of one size, the
#    smallest type's layer count (8 full layers here, so 40 window layers make
#    5 groups of 8);
# 2. **tensors** (`get_kv_cache_config_from_groups`): tensor `j` is shared by
#    layer `j` of every group, and the budget buys `available // page //
#    group_size` blocks.
#
# Which manager serves which spec, and which specs may share a group, comes
# from the spec registry (`kvref.kv_cache_spec_registry`). The builder reads
# its numbers from a vLLM `VllmConfig`; `capacity_config` makes a small object
# with the same attributes. With `disable_hybrid_kv_cache_manager` the window
# layers become full attention that remembers its window: one group, the
# "all full" layout of section 4.

# %%
section("5. The same model from per-layer specs")
layer_specs = {f"layers.{i}": full if i % 6 == 5 else swa for i in range(48)}
(built,) = get_kv_cache_configs(capacity_config(L, max_num_batched_tokens=T),
                                [dict(layer_specs)], [8 * GiB])
built_table = Table("group", "spec", "layers", box=None, header_style="bold")
for g, group in enumerate(built.kv_cache_groups):
    built_table.add_row(str(g), type(group.kv_cache_spec).__name__,
                        ", ".join(group.layer_names[:3]) + ", ...")
show(built_table)
claim([len(g.layer_names) for g in built.kv_cache_groups] == [8] * 6
      and type(built.kv_cache_groups[5].kv_cache_spec) is FullAttentionSpec,
      "the builder finds section 4's layout: 5 window groups and 1 full group of 8 layers")
claim(built.kv_cache_groups[0].layer_names[:2] == ["layers.0", "layers.6"],
      "window layers are dealt round-robin: group 0 holds layers 0, 6, 12, ...")
claim(built.num_blocks == hybrid.num_blocks == 16384 and len(built.kv_cache_tensors) == 8
      and all(len(t.shared_by) == 6 for t in built.kv_cache_tensors),
      "16384 blocks in 8 tensors, each shared by one layer of every group")
(one_group,) = get_kv_cache_configs(
    capacity_config(L, max_num_batched_tokens=T, disable_hybrid_kv_cache_manager=True),
    [dict(layer_specs)], [8 * GiB])
claim(len(one_group.kv_cache_groups) == 1 and one_group.num_blocks == all_full.num_blocks,
      "with the hybrid manager disabled: one group of 48 layers and section 4's 2730 blocks")

# %%
finish()
