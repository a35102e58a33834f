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
# # Lesson 05: prefix caching with a real model
#
# Lesson 02 showed that a request whose prompt starts like an earlier one finds
# that prefix's blocks by hash. Here a model actually runs: kvref's engine
# (`kvref.engine.LLM`, the shape of vLLM's offline `LLM.generate`) schedules
# requests over `KVCacheManager`, and a plain-torch Llama reads and writes its
# keys and values through the block tables (lesson 04). A prefix hit means the
# engine *skips computing* those prompt tokens: their keys and values are
# already in the hit blocks.
#
# The claim to check: the same prompts give the same tokens with prefix caching
# on and off, and with it on, fewer prompt tokens are computed. The model is a
# tiny Llama with random weights, built here (nothing is downloaded). Section 5
# then opens a recording of vLLM's own engine running on kvref's KV layer.
#
# Run: `python tutorials/05_prefix_caching_with_a_model.py [--device cuda]`.

# %%
import time

import torch
from rich.table import Table

from kvref.engine import LLM, SamplingParams
from kvref.verify.trace_replay import replay
from kvref.viz import render_pool
from kvref.viz.panels import render_frame, render_summary
from kvref.viz.player import TracePlayer, read_trace, summarize

from _lesson import TUTORIALS_DIR, claim, finish, section, show, start, tiny_llama

args = start("Prefix caching with a real model", uses_tensors=True)
BLOCK_SIZE, MAX_TOKENS = 4, 6


model = tiny_llama()
g = torch.Generator().manual_seed(1)
system = torch.randint(0, 96, (21,), generator=g).tolist()       # a shared "system prompt"
questions = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 3, 9, 6)]
prompts = [system + q for q in questions]
params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# One throwaway run first, so that neither timed run pays torch's start-up costs.
LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=64, max_model_len=64,
    device=args.device).generate([prompts[0]], params)


def run(enable_prefix_caching):
    """Generate: the first prompt alone (it warms the cache), then the other three
    together. Returns the outputs, the engine and the seconds it took."""
    llm = LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=64, max_model_len=64,
              enable_prefix_caching=enable_prefix_caching, device=args.device)
    began = time.perf_counter()
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    return outputs, llm, time.perf_counter() - began


# %% [markdown]
# ## 1. The same workload, caching off and on
#
# Four prompts share a 21-token system prompt: 5 full blocks of 4 tokens, and 1
# token in a sixth block. The first runs alone; when it is admitted, its full
# blocks are cached (hashed) at once. The other three then hit those 5 blocks:
# 20 tokens each they do not compute. The 21st shared token sits in a block that
# also holds each prompt's own tokens, so its hash differs: never a hit.

# %%
section("1. Generate twice")
off, llm_off, seconds_off = run(False)
on, llm_on, seconds_on = run(True)
table = Table("prompt", "tokens", "cached tokens", "output (caching off)", "output (on)")
for i, (a, b) in enumerate(zip(off, on)):
    table.add_row(str(i), str(len(prompts[i])), str(b.num_cached_tokens),
                  str(a.outputs[0].token_ids), str(b.outputs[0].token_ids))
show(table)
claim(all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(off, on)),
      "every prompt generates the same 6 tokens with and without prefix caching")
with torch.no_grad():
    alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)).long(),
                            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
claim([o.outputs[0].token_ids for o in on] == alone,
      "and they are what transformers' own generate() gives for each prompt alone, unpaged")
claim([o.num_cached_tokens for o in on] == [0, 20, 20, 20] and
      all(o.num_cached_tokens == 0 for o in off),
      "with caching, prompts 1..3 start with 20 cached tokens (5 blocks); without, none")

# %% [markdown]
# ## 2. What it saved
#
# `llm.stats` counts prompt tokens the model computed and prompt tokens served by
# the cache. Every prompt token is one or the other, so the totals add up to the
# same 107 prompt tokens both ways. Time is shown for interest only: on a model
# this small, scheduling costs as much as the saved arithmetic, and timings vary
# from run to run (on a real model and long prompts the saving is the point).

# %%
section("2. Prompt tokens computed")
total = sum(len(p) for p in prompts)
show(f"caching off: {llm_off.stats.prompt_tokens_computed} prompt tokens computed, "
     f"{seconds_off * 1e3:.0f} ms")
show(f"caching on:  {llm_on.stats.prompt_tokens_computed} computed + "
     f"{llm_on.stats.prompt_tokens_cached} from the cache, {seconds_on * 1e3:.0f} ms")
claim(llm_off.stats.prompt_tokens_computed == total == 107,
      "without caching the model computes all 107 prompt tokens")
claim(llm_on.stats.prompt_tokens_computed == total - 60 and llm_on.stats.prompt_tokens_cached == 60,
      "with caching it computes 47 and takes 60 (3 x 20) from the cache")

# %% [markdown]
# ## 3. The pool afterwards
#
# Every request has finished, so nothing is in use; but the full blocks stay
# cached in the free queue (`○`) until a new allocation evicts them (lesson 01).
# Only caching-on blocks carry hashes.

# %%
section("3. The pool after the run (caching on)")
show(render_pool(llm_on.kv_cache_manager))
pool_on, pool_off = llm_on.kv_cache_manager.block_pool, llm_off.kv_cache_manager.block_pool
cached_on = sum(b.block_hash is not None for b in pool_on.blocks)
claim(cached_on > 0 and all(b.block_hash is None for b in pool_off.blocks),
      "blocks stay cached after their requests finish; with caching off none is hashed")
claim(pool_on.get_num_free_blocks() == 63, "all 63 usable blocks are free again, cached or not")

# %% [markdown]
# ## 4. The same prompt again: the last token is always computed
#
# Sending prompt 0 once more hits its own blocks, but never its last token: the
# model must run on at least one token to produce the logits of the next one
# (lesson 02). Its 26 tokens hold 6 full blocks, yet the hit stops at 24 tokens
# (the block boundary at or below 25 tokens).

# %%
section("4. Prompt 0 again")
before = llm_on.stats.prompt_tokens_computed
again = llm_on.generate(prompts[:1], params)[0]
claim(again.num_cached_tokens == 24 and llm_on.stats.prompt_tokens_computed - before == 2,
      "a 26-token prompt seen before hits 24 tokens and computes the last 2")
claim(again.outputs[0].token_ids == on[0].outputs[0].token_ids,
      "and generates the same tokens as the first time")

# %% [markdown]
# ## 5. The same pool inside vLLM's own engine
#
# Everything above ran kvref's engine. `tools/vllm_engine_run.py` runs vLLM
# 0.25.1's *real* engine (`vllm.LLM.generate`: its scheduler, CPU model runner
# and attention kernels) with kvref's KV layer in place of vLLM's, and with
# `--record` it writes down every call vLLM's scheduler made to that layer. The
# file read here is such a recording, vendored so that this lesson needs no vLLM
# (made by `python3 tools/vllm_engine_run.py --workload evict --record FILE`):
# seven requests whose prompts share their first 16 tokens, in a pool of only 10
# blocks of 16 tokens, so the real scheduler evicts cached blocks and preempts a
# request. kvref replays every call and must answer exactly as it answered inside
# vLLM; `kvref viz FILE` steps through it, and the frame below is the step where
# vLLM's scheduler preempted a request to make room.

# %%
section("5. vLLM's own engine, through kvref's viewer")
recording = read_trace(str(TUTORIALS_DIR / "data" / "vllm_engine_evict.json.gz"))
replayed = replay(recording, compare_hashes=True, check_invariants=True)
claim(recording["generator"]["engine"] == "vllm.LLM.generate"
      and recording["generator"]["vllm"] == "0.25.1",
      "the recording comes from vLLM 0.25.1's own LLM.generate")
claim(replayed.divergence is None and replayed.num_ops == len(recording["ops"]) == 568,
      "kvref replays all 568 recorded calls with the recorded answers, invariants checked")
summary = summarize(recording)
show(render_summary(summary, title="vLLM's engine on kvref's layer: the evict recording"))
claim(summary.num_steps == 52 and summary.evictions == 9 and summary.preemptions == 1,
      "in 52 engine steps the real scheduler evicted 9 cached blocks and preempted once")
player = TracePlayer(recording)
player.seek(len(player.ops))
preempted_at = next(f.index for f in player.facts if f.is_preemption)
player.seek_op(preempted_at)
show(render_frame(player))
asked = max(i for i in range(preempted_at) if player.ops[i]["op"] == "allocate_slots")
claim(player.ops[preempted_at]["op"] == "free" and "ret" in player.ops[asked]["expect"]
      and player.ops[asked]["expect"]["ret"] is None,
      "vLLM preempted right after an allocate_slots found no room (it returned None)")

# %%
finish()
