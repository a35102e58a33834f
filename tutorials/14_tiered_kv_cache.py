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
# # Lesson 14: a tiered KV cache
#
# The device pool is small and expensive; host memory is large and cheap.
# A CPU offload tier (`SimpleCPUOffloadConnector`, timed as vLLM 0.25.1's, in
# its default eager mode) copies the blocks the engine has computed into a
# second block pool in host memory, keyed by their block hashes. When the
# device pool has evicted a prefix, a later prompt finds its blocks on the
# host and loads them back instead of computing them: an *external hit*,
# added after the local one.
#
# The workload is a multi-turn chat: four conversations, each turn resending
# the whole history plus a new question. Between one conversation's turns the
# others run, and the small device pool evicts its blocks. What to look for:
# the same tokens with and without the tier, fewer prompt tokens computed
# with it, and what it cost in bytes moved.
#
# Run: `python tutorials/14_tiered_kv_cache.py` (CPU; seconds).

# %%
from collections import Counter

import torch
from rich.table import Table

from kvref import RequestStatus
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.engine import LLM, SamplingParams

from _lesson import claim, finish, section, show, start, tiny_llama

args = start("A tiered KV cache", uses_tensors=True)
model = tiny_llama()
OPTIONS = dict(block_size=4, max_model_len=96, max_num_batched_tokens=32, num_gpu_blocks=30,
               device=args.device)
params = SamplingParams(max_tokens=4)
g = torch.Generator().manual_seed(3)


def tokens(n):
    return torch.randint(0, 96, (n,), generator=g).tolist()


conversations = [tokens(12) for _ in range(4)]          # each one's opening message
questions = [[tokens(6) for _ in range(3)] for _ in range(4)]


def chat(llm):
    """Three turns of four conversations, round robin; returns every turn's answer."""
    history = [list(c) for c in conversations]
    answers = []
    for turn in range(3):
        prompts = [h + questions[i][turn] for i, h in enumerate(history)]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        answers.append(outs)
        history = [p + out for p, out in zip(prompts, outs)]
    return answers


# %% [markdown]
# ## The same chat, with and without the tier

# %% [markdown]
# The tier is sized as vLLM sizes it, in bytes (`cpu_bytes_to_use`, 8 GiB
# unless told); here, 64 blocks' worth (one block of every layer each).

# %%
section("Device pool alone, then device pool + 64 host blocks")
plain = LLM(model, **OPTIONS)
plain_answers = chat(plain)
block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                  for g in plain.kv_cache_config.kv_cache_groups)


def tier_config(**extra):
    return KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": 64 * block_bytes,
                                                       **extra})


tiered = LLM(model, kv_transfer_config=tier_config(), **OPTIONS)
claim(tiered.scheduler.connector.num_cpu_blocks == 64, "64 blocks' worth of bytes: 64 host blocks")
waited = []
tiered.after_step.append(lambda llm: waited.append(sum(
    r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in llm.scheduler.skipped_waiting)))
steps_loading = Counter()                 # request -> steps that ended with it loading
tiered.after_step.append(lambda llm: steps_loading.update(
    r for r in llm.scheduler.skipped_waiting
    if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS))
tiered_answers = chat(tiered)
claim(tiered_answers == plain_answers, "the tier changes no token")

worker = tiered.model_runner.kv_connector
hits = tiered.scheduler.connector_prefix_cache_stats
table = Table("", "device only", "device + host tier")
for name, a, b in [
        ("prompt tokens computed", plain.stats.prompt_tokens_computed,
         tiered.stats.prompt_tokens_computed),
        ("served by the device prefix cache", plain.stats.prompt_tokens_cached,
         tiered.stats.prompt_tokens_cached),
        ("loaded from the host tier", 0, tiered.stats.prompt_tokens_external),
        ("blocks copied to the host", 0, worker.stats.num_saved_blocks),
        ("blocks loaded back", 0, worker.stats.num_loaded_blocks),
        ("bytes moved (both ways)", 0, worker.stats.bytes_saved + worker.stats.bytes_loaded)]:
    table.add_row(name, str(a), str(b))
show(table)
claim(tiered.stats.prompt_tokens_computed < plain.stats.prompt_tokens_computed,
      f"with the tier the engine computed {tiered.stats.prompt_tokens_computed} prompt tokens, "
      f"{plain.stats.prompt_tokens_computed} without")
claim(tiered.stats.prompt_tokens_external > 0 and worker.stats.num_loaded_blocks > 0,
      "the saving is external hits: blocks the device had evicted came back from the host")
rate = (hits.hits + hits.preempted_hits) / max(1, hits.queries + hits.preempted_queries)
show(f"host-tier hit rate: {rate:.0%} of the tokens asked beyond the local hit")
claim(0 < rate < 1, "the tier served part, not all, of what the device cache missed")

# %% [markdown]
# The device prefix cache serves more tokens with the tier than without it,
# though the tier adds no device block: it is timing. A prompt loaded from
# the host is not computed, so the turns ahead of a request finish in fewer
# steps and the request is looked up earlier, while its previous turn's
# blocks are still in the device pool instead of evicted. The first lookup
# of each request, from the scheduler's step records, shows which:

# %%
section("Why the device cache serves more with the tier")


def first_lookups(llm):
    """request id -> (step, tokens hit in the device cache) at its first lookup."""
    first = {}
    for record in llm.scheduler.step_records:
        for req_id, num_hit in record.prefix_hit_tokens.items():
            first.setdefault(req_id, (record.step, num_hit))
    return first


before, after = first_lookups(plain), first_lookups(tiered)
moved = sorted((r for r in before if before[r][1] != after[r][1]), key=int)
for req_id in moved:
    show(f"request {req_id}: looked up at step {before[req_id][0]} without the tier, "
         f"{before[req_id][1]} tokens hit; at step {after[req_id][0]} with it, "
         f"{after[req_id][1]} tokens hit")
claim(bool(moved) and all(after[r][1] > before[r][1] and after[r][0] < before[r][0]
                          for r in moved),
      "every request that hit more of the device cache with the tier was looked up "
      "earlier, before its blocks were evicted")
claim(tiered.stats.prompt_tokens_cached - plain.stats.prompt_tokens_cached
      == sum(after[r][1] - before[r][1] for r in moved),
      f"those requests account for the whole rise, {plain.stats.prompt_tokens_cached} -> "
      f"{tiered.stats.prompt_tokens_cached} tokens served by the device cache")

# %% [markdown]
# ## When a block reaches the host
#
# A store copies only blocks whose KV is *confirmed*: computed in an earlier
# step (`num_computed_tokens - num_output_placeholders` when the step is
# planned, whole blocks). The copy is launched by the worker after the step's
# forward, and the host block becomes a hit only when every worker has
# reported the copy done, at the poll that finds it so (kvref's worker: the
# next step's). Follow one 14-token prompt (three full blocks) decoding three
# tokens, on a fresh tier:

# %%
section("One request's blocks on their way to the host")
one = LLM(model, kv_transfer_config=tier_config(), **OPTIONS)
tier = one.scheduler.connector
timeline = []
one.after_step.append(lambda llm: timeline.append((
    llm.scheduler.running[0].num_computed_tokens if llm.scheduler.running else "finished",
    tier.has_pending_stores(), len(tier.cpu_block_pool.cached_block_hash_to_block))))
one.generate([conversations[0] + questions[0][0][:2]], SamplingParams(max_tokens=3))
table = Table("step", "tokens computed", "store in flight", "host blocks hittable")
for step, (computed, pending, hittable) in enumerate(timeline):
    table.add_row(str(step), str(computed), str(pending), str(hittable))
show(table)
claim(timeline[0] == (14, False, 0),
      "step 0 computes the prompt's three full blocks and stores none of them")
claim(timeline[1] == (15, True, 0),
      "step 1 stores them (confirmed now); copied, but not a hit yet")
claim(timeline[2][1:] == (False, 3), "step 2: the worker reported the copy done: three hits")

# %% [markdown]
# So a request that finishes in the step that fills its last block does not
# store that block itself: by the next plan it is gone. vLLM's words are that
# the block "may be missed" (`vllm/v1/simple_kv_offload/manager.py:544-547`):
# the block stays cached on the device, so a later request whose prefix hits
# it stores it with its own confirmed blocks, and lazy mode stores it when it
# nears eviction. A 12-token prompt (three full blocks) asking for one token is
# computed and finished in one step, and at first nothing comes after it:

# %%
short = LLM(model, kv_transfer_config=tier_config(), **OPTIONS)
short.generate([conversations[1]], SamplingParams(max_tokens=1))
short_tier = short.scheduler.connector
claim(len(short_tier.cpu_block_pool.cached_block_hash_to_block) == 0
      and short.model_runner.kv_connector.stats.num_saved_blocks == 0,
      "a one-step request leaves nothing on the host")

# %% [markdown]
# The blocks were missed, not lost: they are still cached on the device. The
# same prompt again, now asking for three tokens, hits the first two there (a
# hit stops short of the prompt's last token, so the third block is computed
# again), and its plans store its confirmed blocks: the two it hit among them.

# %%
short.generate([conversations[1]], SamplingParams(max_tokens=3))
show(f"hit on the device: {short.stats.prompt_tokens_cached} tokens; on the host now: "
     f"{len(short_tier.cpu_block_pool.cached_block_hash_to_block)} blocks")
claim(short.stats.prompt_tokens_cached == 8
      and len(short_tier.cpu_block_pool.cached_block_hash_to_block) == 3,
      "a later request that hits the device blocks stores them on the host")

# %% [markdown]
# vLLM has a second mode, `lazy_offload`: nothing is stored when computed;
# each step walks the device pool's free queue from where it stopped and
# offloads cached blocks nearest eviction, until a target of free-or-offloaded
# blocks (twice a step's worth) is covered. (kvref's connectors are built
# without the engine's settings, so lazy mode takes `max_num_batched_tokens`
# in the connector's config.)

# %%
section("Lazy mode: offload what is about to be evicted")
lazy = LLM(model, kv_transfer_config=tier_config(
    lazy_offload=True, max_num_batched_tokens=OPTIONS["max_num_batched_tokens"]), **OPTIONS)
claim(chat(lazy) == plain_answers, "lazy mode changes no token either")
lazy_worker = lazy.model_runner.kv_connector
show(f"lazy: {lazy_worker.stats.num_saved_blocks} blocks stored, "
     f"{lazy.stats.prompt_tokens_external} prompt tokens loaded; eager: "
     f"{worker.stats.num_saved_blocks} stored, {tiered.stats.prompt_tokens_external} loaded")
claim(lazy.stats.prompt_tokens_computed < plain.stats.prompt_tokens_computed,
      "lazy mode saves prompt tokens too")

# %% [markdown]
# ## What a load looks like from the scheduler
#
# The tier's loads are asynchronous: in the step that finds the hit, the
# request gets its blocks (uncached, `delay_cache_blocks`) and waits in
# `WAITING_FOR_REMOTE_KVS`; the worker launches the host-to-device copy after
# that step's forward and reports the request in `finished_recving` at the
# poll that finds the copy done (kvref: the next step's; vLLM: usually a later
# step's); the step after caches its blocks and schedules the rest of the
# prompt. So here a hit costs two steps of waiting, and the bytes move instead
# of the FLOPs.

# %%
section("Loads in flight")
claim(max(waited) > 0, f"at most {max(waited)} request(s) waited for a load in one step")
claim(min(steps_loading.values()) >= 2,
      f"every load kept its request waiting for at least two steps "
      f"({len(steps_loading)} requests loaded, the longest waited "
      f"{max(steps_loading.values())})")
claim(worker.stats.bytes_loaded == worker.stats.num_loaded_blocks
      * tiered.scheduler.connector._block_bytes,
      "each loaded block moved one block of every layer: "
      f"{tiered.scheduler.connector._block_bytes} bytes")
pool = tiered.kv_cache_manager.block_pool
host = tiered.scheduler.connector.cpu_block_pool
claim(pool.get_num_free_blocks() == 30 - 1 and not any(b.ref_cnt for b in host.blocks),
      "at the end every device block is free and no host block is held by a copy")

finish()
