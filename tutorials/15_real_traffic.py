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
# # Lesson 15: real traffic
#
# The other lessons make their workloads up. This one replays production
# traffic: the Mooncake FAST'25 conversation trace (one hour of a chatbot,
# 12,031 requests, vendored in `kvref/data/mooncake/` with its Apache-2.0
# licence), where each prompt is given as ids of 512-token blocks, equal ids
# meaning an identical prefix. `kvref simulate` turns each id into a run of
# tokens and sends the requests through kvref's scheduler and KV cache (the
# ones vLLM 0.25.1's own recorded decisions replay on) with no model: each
# step takes a linear time model's seconds, each request generates its
# trace's output length in stand-in tokens.
#
# What to look for: how much of the prompt a real pool serves from the cache;
# why every other prompt token was computed (`specs/simulate.md` gives each
# one a cause); what a host tier behind the GPU serves; how the hit ratio grows with capacity, beside what the paper
# claims; and three real "0 % hit rate" reports, reproduced and explained.
#
# Run: `python tutorials/15_real_traffic.py` (CPU; under a minute; slices of
# the trace; `kvref simulate conversation` runs the whole of it).

# %%
import json
from pathlib import Path

import kvref
from kvref.simulate import (NAMED_SHAPES, TraceRequest, load_trace, pool_from_memory,
                            pool_from_tokens, simulate)
from kvref.simulate.report import render_report
from kvref.simulate.sweep import capacity_curve

from _lesson import claim, finish, section, show, start

args = start("Real traffic", uses_tensors=False)
# The repository (the committed whole-trace curve is in benchmarks/), found from kvref.
REPO = Path(kvref.__file__).resolve().parent.parent

# %% [markdown]
# ## 1. One GPU's worth of KV cache
#
# A Llama-3-8B-shaped model (32 layers, 8 KV heads of 128, bfloat16) on one
# 80 GiB GPU at vLLM's default utilization 0.9: the weights take 15 GiB, and
# after 2 GiB set aside for activations (vLLM measures that by profiling;
# kvref takes it as a flag) the rest buys blocks of 16 tokens at 128 KiB a
# token across the layers (lesson 12's arithmetic). The scheduler keeps
# `vllm serve`'s limits on such a GPU: 8,192 tokens and 1,024 requests a step.
# The first 150 requests arrive at their trace times, outputs cut at 32
# tokens to keep the lesson short. At the default step time (10 ms + 0.04 ms a
# token) one GPU is too slow for this traffic, so requests queue: Mooncake
# served it with a cluster.
#
# The report names three figures the way every kvref command does
# (`kvref/stats.py`). **vLLM's hit rate** is hits over queries as vLLM's
# `vllm:prefix_cache_hits` and `vllm:prefix_cache_queries` count them: a lookup
# each time the scheduler tries to admit a request
# (`vllm/v1/core/kv_cache_manager.py:231-244`), and a request refused for
# lack of blocks is tried again next step, so under that kind of pressure the
# queries exceed the prompt tokens and the rate reads low. **Preempted
# requests, counted apart**: a resumed request's lookups, which vLLM keeps out
# of that rate (each retry after a preemption is a query). **Served from the
# cache, once per request** (`hit_ratio_once`): the prompt tokens each
# request's first admission took from the cache, over all prompt tokens.

# %%
section("1. The conversation trace on one GPU")
llama = NAMED_SHAPES["llama-3-8b-like"]
pool = pool_from_memory(llama, gpu_memory_gib=80, max_model_len=131072,
                        max_num_batched_tokens=8192)
show(pool.how)
claim(pool.num_blocks == 28181 and pool.tokens == 450_880,
      "80 GiB x 0.9 - 15 GiB of weights - 2 GiB buys 28,181 blocks: 450,880 tokens")
requests = load_trace("conversation", max_requests=150)
result = simulate(requests, pool, arrivals="timestamps", max_output_tokens=32)
show(render_report(result, trace="conversation, first 150 requests"))
causes = result.misses_by_cause
claim(sum(causes.values()) == result.prompt_tokens_computed,
      "every computed prompt token has one cause: they sum to the prompt tokens computed")
claim(result.prompt_tokens == result.prompt_tokens_computed + result.prompt_tokens_cached_once,
      "nothing was preempted, so each prompt token was computed or served, once")
claim(result.prefix_cache_queries == result.prompt_tokens,
      "vLLM's prefix_cache_queries equal the prompt tokens: every request got its blocks "
      "at its first lookup (requests waited for the token budget, not for blocks)")

# %% [markdown]
# ## 2. A host tier behind it
#
# Lesson 14's `SimpleCPUOffloadConnector` (timed as vLLM 0.25.1's) copies each
# block a request has confirmed to a host pool, and loads it back, before the
# request runs, when the device pool has evicted it. vLLM sets it up from
# `--kv-offloading-size GIB` (`vllm/config/vllm.py:796-824`); so does
# `kvref simulate`, with the tier's own scheduler half inside the scheduler
# and its own worker half in the runner, copying no tensors: a copy is found
# done at the next step. Same GPU, same 150 requests, with 165 GiB of host
# memory behind it (3 x the device's 55 GiB), then 220 GiB (4 x).

# %%
section("2. A host tier behind the GPU")
tiers = {gib: simulate(requests, pool, arrivals="timestamps", max_output_tokens=32,
                       kv_offloading_size=gib) for gib in (165, 220)}
for gib, tiered in tiers.items():
    show(f"host {gib} GiB ({tiered.num_cpu_blocks:,} blocks): "
         f"{tiered.prompt_tokens_cached_once:,} tokens from the GPU cache, "
         f"{tiered.prompt_tokens_from_host:,} from the host, "
         f"{tiered.prompt_tokens_computed:,} computed "
         f"({tiered.host_blocks_stored:,} blocks stored, {tiered.host_blocks_loaded:,} loaded)")
    claim(tiered.prompt_tokens == tiered.prompt_tokens_cached_once
          + tiered.prompt_tokens_from_host + tiered.prompt_tokens_computed
          and tiered.num_preemptions == 0,
          f"{gib} GiB: each prompt token came from the GPU cache, from the host, or was "
          "computed, once")
    claim(sum(tiered.misses_by_cause.values()) == tiered.prompt_tokens_computed,
          "the causes still sum to the tokens computed (a token loaded from the host "
          "has none, rule S5 of specs/simulate.md)")
    claim(tiered.free_gpu_blocks_at_end == pool.num_blocks - 1
          and tiered.tier_holds_at_end == 0
          and tiered.free_cpu_blocks_at_end == tiered.num_cpu_blocks - 1,
          "at the end every GPU block is free and the tier holds nothing")
host = tiers[220]
claim(host.num_cpu_blocks == 220 * 1024 // 2 and host.prompt_tokens_cached_once
      == result.prompt_tokens_cached_once,
      "220 GiB holds 112,640 blocks of 2 MiB (16 tokens x 128 KiB), about 4 x the GPU's "
      "28,180; the GPU cache serves what it served alone")
claim(0 < host.prompt_tokens_from_host < causes["evicted_before_reuse"]
      and host.prompt_tokens_computed
      == result.prompt_tokens_computed - host.prompt_tokens_from_host,
      f"the host serves {host.prompt_tokens_from_host:,} of the "
      f"{causes['evicted_before_reuse']:,} tokens the GPU had evicted: that many fewer "
      "are computed")
claim(host.misses_by_cause["first_occurrence"] == causes["first_occurrence"],
      "and no tier helps a first occurrence")
claim(tiers[165].prompt_tokens_from_host < host.prompt_tokens_from_host / 4,
      f"at 165 GiB it serves only {tiers[165].prompt_tokens_from_host:,}: the host keeps "
      "copies of blocks the GPU still holds too, so it adds less than its size")

# %% [markdown]
# How much less? The same requests on one device pool of 4 x the GPU's
# blocks serve, from the cache, exactly the tokens the GPU plus its 220 GiB
# host serve between them here: on this slice the host tier is worth what its own size
# is worth as device memory, not the device's size plus its own.

# %%
bigger = pool_from_tokens(4 * (pool.num_blocks - 1) + 1, how="4 x the GPU pool")
more = simulate(requests, bigger, arrivals="timestamps", max_output_tokens=32)
show(f"one pool of 4 x the blocks: {more.prompt_tokens_cached_once:,} tokens from the "
     f"cache; the GPU and its 220 GiB host: "
     f"{host.prompt_tokens_cached_once + host.prompt_tokens_from_host:,}")
claim(more.prompt_tokens_cached_once
      == host.prompt_tokens_cached_once + host.prompt_tokens_from_host,
      "a host of about 4 x the GPU's blocks serves what a GPU pool of 4 x would, no more")

# %% [markdown]
# ## 3. The capacity curve, beside the paper's claims
#
# Mooncake's Figure 9 replays its traces one request after another through
# caches of 10^4 to 10^9 tokens and reports that about 50 M tokens nearly
# reach the maximum, and that 3 M tokens reach less than half of it in most
# workloads. Here: the first 300 requests, order only, 512-token blocks (the
# trace's own), outputs of one token (a Mooncake trace holds no output
# tokens, so outputs never hit), and the maximum: a pool that never evicts.

# %%
section("3. Hit ratio against capacity")
curve = capacity_curve("conversation", [2e5, 1e6, 3e6], block_size=512, max_requests=300,
                       workers=1)
ratios = {p["point"]["kv_cache_tokens"]: p["hit_ratio_once"] for p in curve}
show("  ".join(f"{c:,.0f} tokens: {r:.1%}" for c, r in ratios.items()))
claim(list(ratios.values()) == sorted(ratios.values()),
      "the hit ratio never falls as the cache grows")
claim(ratios[3e6] > 0.8 * ratios[float("inf")] and 2 * ratios[1e6] < ratios[float("inf")],
      f"a slice of 300 requests is small: 3 M tokens hold nearly all of it "
      f"({ratios[3e6] / ratios[float('inf')]:.0%} of the maximum), 1 M less than half")

# %% [markdown]
# The whole trace (`benchmarks/simulate_curve.py`, committed with its
# picture as `benchmarks/simulate_curve.png`) is where the paper's claims
# apply: 12,031 requests, 93.6 M distinct tokens.

# %%
whole = REPO / "benchmarks" / "simulate_curve.json"
if whole.exists():                       # a checkout (not an installed wheel)
    points = json.loads(whole.read_text())["points"]
    top = next(p["hit_ratio_once"] for p in points if p["point"]["kv_cache_tokens"] == "inf")
    at = {p["point"]["kv_cache_tokens"]: p["hit_ratio_once"] for p in points
          if "hit_ratio_once" in p and p["point"]["kv_cache_tokens"] != "inf"}
    show("whole trace: " + "  ".join(f"{c / 1e6:g} M: {r:.1%}" for c, r in at.items())
         + f"  maximum: {top:.1%}")
    inside = next(p["misses_by_cause"]["shared_prefix_ends_inside_block"] for p in points
                  if p["point"]["kv_cache_tokens"] == "inf")
    prompt_tokens = points[-1]["prompt_tokens"]
    claim(abs(top + inside / prompt_tokens - 0.3736) < 0.0001,
          f"the maximum, {top:.2%}, is the trace README's 37.36 % less the "
          f"{inside:,} tokens of shared partial blocks, which are never cached")
    claim(at[3e6] < top / 2,
          f"3 M tokens reach {at[3e6] / top:.0%} of the maximum: less than half, as the "
          "paper says")
    claim(at[5e7] > 0.9 * top,
          f"50 M tokens reach {at[5e7] / top:.0%} of it: nearly the maximum, as the paper says")

# %% [markdown]
# ## 4. Three "0 % hit rate" reports, reproduced
#
# **A shared prefix shorter than the block.** A 240-token system prompt in
# front of every request, on a hybrid model whose attention block vLLM
# raised to 784 tokens to fit its Mamba state: only full blocks are cached,
# and the 240 shared tokens never fill one. The same requests on 16-token
# blocks hit 240 tokens each (15 full blocks).

# %%
section("4a. A prefix shorter than the block")
system = list(range(100, 340))
chats = [TraceRequest(f"u{i}", 260, 8, 0.1 * i,
                      tokens=system + [5000 + 20 * i + j for j in range(20)])
         for i in range(6)]
big_blocks = simulate(chats, pool_from_tokens(64, block_size=784))
small_blocks = simulate(chats, pool_from_tokens(6400, block_size=16))
show(f"block 784: {big_blocks.prefix_cache_hits} hits, misses "
     f"{ {k: v for k, v in big_blocks.misses_by_cause.items() if v} }")
claim(big_blocks.prefix_cache_hits == 0
      and big_blocks.misses_by_cause["shared_prefix_ends_inside_block"] == 5 * 240,
      "block 784: 0 hits; the 5 x 240 shared tokens end inside a block")
claim(small_blocks.prompt_tokens_cached_once == 5 * 240,
      "block 16: the same requests take 5 x 240 tokens from the cache")

# %% [markdown]
# **A Mamba hybrid with prefix caching on that hits nothing**
# (vllm-project/vllm#51198: request B, request A's prompt plus a suffix,
# sent after A finished, hit 0 tokens on a Mamba-2 hybrid). A
# Nemotron-H-8B-shaped model (4 attention layers, 24 Mamba-2 layers) in
# Mamba cache mode `"align"`: vLLM raises its block to 528 tokens so one
# page holds one Mamba state, and keeps a state only where a step ends on a
# block boundary. One request at a time, each prompt computed in one step
# that ends mid-block: the full-attention blocks are cached, but no Mamba
# state is, so the hit every group accepts is 0. Mode `"all"` (vLLM's pick
# for models that support it) keeps a state per block and hits.

# %%
section("4b. A Mamba hybrid in align mode")
nemotron = NAMED_SHAPES["nemotron-h-8b-like"]
shared = list(range(1000, 3000))
prompts = [TraceRequest(f"m{i}", 2050, 4, float(i),
                        tokens=shared + [50000 + 100 * i + j for j in range(50)])
           for i in range(4)]
align = simulate(prompts, pool_from_tokens(400, shape=nemotron, mamba_cache_mode="align"))
every = simulate(prompts, pool_from_tokens(400, shape=nemotron, mamba_cache_mode="all"))
show(f"align: block {align.block_size}, hits {align.per_request_hits}; "
     f"all: block {every.block_size}, hits {every.per_request_hits}")
claim(align.block_size == 528 and every.block_size == 640,
      "vLLM's rule: 528-token blocks in align mode, 640 (a multiple of the 128-token "
      "Mamba chunk) in all mode")
claim(align.prompt_tokens_cached_once == 0 and align.misses_by_cause[
      "window_or_mamba_limit"] == 3 * 1584,
      "align: 0 hits; the 3 x 1,584 tokens full attention had cached wait for a Mamba state")
claim(every.prompt_tokens_cached_once == 3 * 1920, "all: 3 x 1,920 tokens hit")

# %% [markdown]
# **Recompute after preemption counted as hits** (vllm-project/vllm#25780).
# A preempted request resumes by looking its own blocks up again; those hits
# are its own work from before, not sharing. vLLM 0.25.1 counts such lookups
# apart (`preempted_queries`, `preempted_hits`, not in
# `vllm:prefix_cache_hits`): kvref's report shows them as "preempted
# requests, counted apart". Six unrelated requests in a pool too small for
# them all: no prompt shares anything, vLLM's hit rate stays at 0, and the
# preempted lookups hit; added together, as the report saw them, they
# would show a hit rate where nothing is shared.

# %%
section("4c. Recompute after preemption")
unrelated = [TraceRequest(f"p{i}", 30, 30, 0.0,
                          tokens=list(range(1000 * (i + 1), 1000 * (i + 1) + 30)))
             for i in range(6)]
tight = simulate(unrelated, pool_from_tokens(17), arrivals="timestamps", max_model_len=64)
mixed = (tight.prefix_cache_hits + tight.preempted_prefix_cache_hits) / (
    tight.prefix_cache_queries + tight.preempted_prefix_cache_queries)
show(f"{tight.num_preemptions} preemptions; prefix_cache_hits {tight.prefix_cache_hits}, "
     f"preempted_prefix_cache_hits {tight.preempted_prefix_cache_hits}; counted together "
     f"{mixed:.1%}")
claim(tight.num_preemptions > 0 and tight.prefix_cache_hits == 0
      and tight.preempted_prefix_cache_hits > 0,
      "no sharing, 0 hits in vLLM's counter, yet the resumed requests hit their own blocks")
claim(tight.misses_by_cause["recompute_after_preemption"] > 0,
      "what they could not find again is computed twice: recompute_after_preemption")

# %%
finish()
