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
# # Lesson 10: speculative decoding, and a real defect of vLLM 0.25.1
#
# With speculative decoding a cheap proposer guesses `k` **draft** tokens and
# the target model checks them all in one step. For the KV cache that means
# three things, all in `KVCacheManager.allocate_slots` and the scheduler
# (section 2b watches the second on a real model):
#
# 1. **lookahead slots**: EAGLE/MTP drafters write the keys of their next
#    drafts, so the scheduler asks for `num_lookahead_tokens` extra slots;
# 2. **rejected tokens**: the step computes every draft; the scheduler then
#    takes the rejected ones back (`num_computed_tokens -= num_rejected`) and
#    their slots are simply written over later;
# 3. **the EAGLE last-block drop**: a prefix hit gives up its last block, so
#    that the target recomputes it and the EAGLE head gets the hidden states
#    it drafts from.
#
# Then section 4: with a full-attention + Mamba model the drop goes wrong in
# vLLM 0.25.1, and kvref, which answers as vLLM does, goes wrong the same way.
# The lesson follows it into the tensors. Section 5 turns to async scheduling
# (vLLM's default on GPUs), where the scheduler runs a step ahead of the model
# and schedules placeholders for the tokens and drafts it cannot know yet.

# %%
import torch
from rich.table import Table

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   MambaManager, MambaSpec, Request, RequestStatus, get_request_block_hasher,
                   init_none_hash, sha256)
from kvref.attention import default_scale, make_kv_cache, paged_attention, write_kv
from kvref.engine import (LLM, AsyncScheduler, ModelFreeRunner, NgramProposer, SamplingParams,
                          Scheduler)
from kvref.engine.core import make_engine_core
from kvref.verify.invariants import (InvariantViolation, check, check_kv_cache_manager,
                                     check_prefix_hit)
from kvref.viz import render_pool
from kvref.worker import BlockTable

from _lesson import claim, finish, section, show, start, tiny_llama
from _reference import dense_attention

args = start("Speculative decoding", uses_tensors=True)
device = torch.device(args.device)
init_none_hash(sha256)   # NONE_HASH, the first block's parent hash (lesson 02)
B = 4                       # block size of every group


def make_manager(specs, num_blocks, use_eagle):
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([f"layer.{i}"], s)
                                        for i, s in enumerate(specs)])
    return KVCacheManager(config, max_model_len=64, scheduler_block_size=B, hash_block_size=B,
                          enable_caching=True, use_eagle=use_eagle)


def request(rid, tokens):
    return Request(rid, list(tokens), block_hasher=get_request_block_hasher(B, sha256))


def hashed(manager, rid, group=0):
    """Per block of the request's table in ``group``: does it carry a hash?"""
    return [b.block_hash is not None for b in manager.get_blocks(rid).blocks[group]]


# %% [markdown]
# ## 1. Lookahead slots
#
# A request with a 6-token prompt and 3 lookahead slots needs room for 9
# tokens: 3 blocks. Only the 4 tokens of the one full prompt block are cached;
# the lookahead slots will hold drafts that may be rejected, so they never are.

# %%
section("1. Lookahead slots")
manager = make_manager([FullAttentionSpec(B)], 16, use_eagle=True)
r = request("r", range(6))
manager.allocate_slots(r, 6, num_lookahead_tokens=3)
claim(len(manager.get_block_ids("r")[0]) == 3 and hashed(manager, "r") == [True, False, False],
      "6 prompt tokens + 3 lookahead slots take 3 blocks; only the full prompt block is cached")

# %% [markdown]
# ## 2. Rejected tokens keep their slots
#
# Next step: the request has sampled token 6 and carries 3 drafts. The step
# computes 1 + 3 = 4 tokens (positions 6..9) and again keeps 3 lookahead slots:
# room for 13 tokens, 4 blocks. The target accepts 1 draft and rejects 2; it
# appends the accepted draft and one token of its own (9 tokens now), and the
# scheduler sets `num_computed_tokens` back from 10 to 8. The table keeps its 4
# blocks: the rejected keys at positions 8 and 9 are overwritten next step.
# Caching never went past the verified tokens.

# %%
section("2. Rejected drafts")
r.status = RequestStatus.RUNNING
r.num_computed_tokens = 6
r.append_output_token_ids(6)
manager.allocate_slots(r, 1 + 3, num_lookahead_tokens=3)
r.num_computed_tokens += 1 + 3                     # the step ran all four
num_rejected = 2
r.num_computed_tokens -= num_rejected              # vLLM's Scheduler.update_from_output
r.append_output_token_ids([7, 42])                 # the accepted draft, the target's own token
show(f"num_tokens {r.num_tokens}, num_computed_tokens {r.num_computed_tokens}, "
     f"table {manager.get_block_ids('r')[0]}")
claim(r.num_computed_tokens == r.num_tokens - 1 == 8,
      "after the rollback the request is one token short, as after any decode step")
claim(len(manager.get_block_ids("r")[0]) == 4
      and hashed(manager, "r") == [True, False, False, False],
      "the 4 blocks stay; still only block 0 is cached (drafts are never hashed)")

# %% [markdown]
# ### With a real model: n-gram drafts through the engine
#
# kvref's engine implements vLLM's n-gram proposer
# (`vllm/v1/spec_decode/ngram_proposer.py`): the drafts are the tokens that
# followed an earlier occurrence of the sequence's final 2 or 3 tokens.
# A tiny random Llama decodes 40 tokens for two prompts, with up to 3 drafts a
# step and without any. Random weights make poor guesses, so most drafts are
# rejected; the tokens must not change either way. A hook checks, after every
# step, that each running request was rolled back to exactly one token short
# of its sequence, whatever was rejected.

# %%
section("2b. n-gram speculative decoding with a real model")
model = tiny_llama()
gen = torch.Generator().manual_seed(2)
prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (10, 9)]
params = SamplingParams(max_tokens=40, ignore_eos=True)
plain = LLM(model, block_size=B, num_gpu_blocks=64, max_model_len=64, device=args.device)
speculative = LLM(model, block_size=B, num_gpu_blocks=64, max_model_len=64, device=args.device,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 3})
rolled_back = []
speculative.after_step.append(lambda engine: rolled_back.append(all(
    r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)))
expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
got = [o.outputs[0].token_ids for o in speculative.generate(prompts, params)]
stats = speculative.stats
show(f"drafts proposed {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}, "
     f"rejected {stats.num_draft_tokens - stats.num_accepted_tokens}")
claim(got == expected, "with n-gram drafts the engine generates exactly the same 80 tokens")
claim(stats.num_draft_tokens > stats.num_accepted_tokens > 0,
      "some drafts were accepted, more were rejected")
claim(len(rolled_back) == stats.num_steps and all(rolled_back),
      "after every step each running request is one token short: rejected drafts rolled back")

# %% [markdown]
# ## 3. The EAGLE last-block drop
#
# Two identical pools, each holding a finished 12-token request (3 cached
# blocks). A 16-token request sharing those 12 tokens looks for a hit. Without
# EAGLE it gets all 3 blocks; with EAGLE (`use_eagle=True`) the full-attention
# manager finds 3 and drops the last one: the target recomputes tokens 8..11
# and the EAGLE head gets their hidden states.

# %%
section("3. Hit length with and without EAGLE")
hits = {}
for use_eagle in (False, True):
    m = make_manager([FullAttentionSpec(B)], 16, use_eagle=use_eagle)
    done = request("done", range(12))
    m.allocate_slots(done, 12)
    m.free(done)
    hits[use_eagle] = m.get_computed_blocks(request("probe", list(range(12)) + [90] * 4))[1]
show(f"hit without EAGLE {hits[False]} tokens, with EAGLE {hits[True]} tokens")
claim(hits == {False: 12, True: 8}, "EAGLE gives up the last hit block: 12 -> 8 tokens")

# %% [markdown]
# ## 4. Full attention + Mamba + EAGLE: a hit one block too long
#
# The exception written up under INV-HIT-2 in `specs/coordinator.md` (the
# recorded trace `tests/conformance/traces/hybrid_full_mamba/
# hybrid_full_mamba-public-00005`, op 8, shows it in vLLM itself): a model with
# full-attention and Mamba layers, served with EAGLE or MTP and prefix caching.
# No KV cache group is marked `is_eagle_group` (the usual case: the project's
# defect notes find only DeepSeek-V4 marking one), and then vLLM's coordinator
# falls back to applying the drop to **every** group. Each EAGLE group
# searches up to one block past the candidate length (never past the
# `num_tokens - 1` cap) and drops one block. Full attention, searched first at
# the cap, just drops its last block; `MambaManager.find_longest_cache_hit`
# receives `drop_eagle_block` and never reads it, so it searches one block
# past full attention's shortened length and keeps it. So Mamba returns the state one
# block *past* full attention, the fixed point accepts that length, and the
# final trim of the full-attention list can only shorten it.
#
# Request `a` (10 tokens) runs and finishes. Request `b` shares its first 8.

# %%
torch.manual_seed(0)
# One full-attention layer of the hybrid model in section 4, all NaN to start.
kv_cache = make_kv_cache(21, B, 1, 8, device=device, fill=float("nan"))
emb = {name: torch.randn(128, 1, 8, device=device) for name in ("q", "k", "v")}
pos = {name: torch.randn(64, 1, 8, device=device) for name in ("q", "k", "v")}


def qkv(tokens, positions):
    t, p = torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
    return [emb[n][t] + pos[n][p] for n in ("q", "k", "v")]


def run_step(block_ids, tokens, start, seq_len):
    """Write the keys and values of positions ``start..seq_len-1`` through the
    request's table, then attend from them: ``[n, 1, 8]``."""
    bt = BlockTable(B, max_num_reqs=1, max_num_blocks_per_req=16, max_num_batched_tokens=32,
                    device=device)
    bt.add_row(block_ids, 0)
    positions = list(range(start, seq_len))
    slots = bt.compute_slot_mapping(1, torch.tensor([0, len(positions)]),
                                    torch.tensor(positions))
    q, k, v = qkv(tokens[start:seq_len], positions)
    write_kv(kv_cache, k, v, slots)
    return paged_attention(q, kv_cache, query_start_loc=[0, len(positions)], seq_lens=[seq_len],
                           block_table=bt.get_device_tensor(1), scale=default_scale(8))


def dense(tokens, start, seq_len):
    """The same queries over keys computed from scratch, no cache at all."""
    q, k, v = qkv(tokens[:seq_len], list(range(seq_len)))
    return dense_attention(q[start:], k, v, default_scale(8))


section("4a. b's lookup")
FULL, MAMBA = FullAttentionSpec(B, num_kv_heads=1, head_size=8, dtype="float32"), \
    MambaSpec(B, mamba_cache_mode="all", num_speculative_blocks=2)
manager = make_manager([FULL, MAMBA], 21, use_eagle=True)
pool = manager.block_pool

a = request("a", range(10))
manager.new_step_starts()
manager.allocate_slots(a, 10, num_lookahead_tokens=2)
a_table, a_mamba = manager.get_block_ids("a")
out_a = run_step(a_table, a.all_token_ids, 0, 10)      # a's step: keys of positions 0..9
a.num_computed_tokens = 10
manager.free(a)                                   # a finished; its blocks stay cached

b = request("b", list(range(8)) + [50, 51])
manager.new_step_starts()
hit, num_hit = manager.get_computed_blocks(b)
table = Table("group", "hit blocks", "tokens they cover", "hit length")
for g, (spec, blocks) in enumerate(zip((FULL, MAMBA), hit.get_block_ids())):
    table.add_row(type(spec).__name__, str(blocks), str(len(blocks) * spec.block_size),
                  str(num_hit))
show(table)


def hit_violation(req, hit, num_hit):
    """Ask kvref's checker about one lookup (INV-HIT-1, INV-HIT-2 of
    specs/coordinator.md); the InvariantViolation it raises, or None."""
    try:
        check_prefix_hit(manager, req, hit, num_hit)
    except InvariantViolation as violation:
        return violation
    return None


claim(num_hit == 8 and hit.get_block_ids() == ([a_table[0]], [0, a_mamba[1]]),
      "b's hit is 8 tokens: Mamba returns a's state at 8, full attention only block 0 (4 tokens)")
violation = hit_violation(b, hit, num_hit)
show(f"check_prefix_hit(manager, b, hit, {num_hit}) -> {violation}")
claim(violation is not None and violation.invariant == "INV-HIT-2" and "group 0" in str(violation),
      "the checker flags INV-HIT-2 on group 0: its hit blocks cover 4 of the 8 hit tokens")

# %% [markdown]
# **The search a later vLLM does.** Later vLLM releases (v0.28.0, for one)
# changed the coordinator: the EAGLE margin (search one block further, then
# drop) is given only to groups that are not Mamba, because the Mamba finder
# never drops a block and the margin would only lengthen its hit. So Mamba's
# search stops at the attention candidate. Asked that way, kvref's own Mamba
# finder agrees with full attention. (Related upstream pull requests include
# #43650, #45614, #46281, #48375 and #57128.)

# %%
mamba_hit = MambaManager.find_longest_cache_hit(
    b.block_hashes, 4, [1], pool, MAMBA, True, B)   # capped at full attention's 4 tokens
claim(len(mamba_hit[0]) * B == 4,
      "capped at full attention's candidate (4), the Mamba search returns 4 tokens: they agree")

# %% [markdown]
# ## 4b. The allocation hands out a block nobody computes
#
# `allocate_slots(b, 2, num_new_computed_tokens=8, ...)` believes tokens 0..7
# are in the cache. Full attention's table gets the hit block, then **a fresh
# block for positions 4..7**, then one for the 2 new tokens. The model computes
# only positions 8 and 9. Worse, the same call caches the table up to the
# request's tokens, so the fresh, never-written block gets the hash of tokens
# 4..7, the same key as `a`'s real block 1.
#
# After the allocation, kvref's snapshot checker (`kvref.verify.invariants.check`)
# stays silent: every structural invariant holds. Only the lookup itself broke a
# rule (`check_prefix_hit` above); what is wrong now is a block's *contents*
# (INV-CONTENT-1), which only the tensors show.

# %%
section("4b. b's allocation")
manager.allocate_slots(b, 2, num_hit, hit, num_lookahead_tokens=2)
b_table = manager.get_block_ids("b")[0]
fresh = b_table[1]
a1_hash = pool.blocks[a_table[1]].block_hash
show(render_pool(manager))
claim(fresh not in a_table and pool.blocks[fresh].block_hash == pool.blocks[a_table[1]].block_hash,
      "b's full-attention block 1 is a fresh block, cached under the hash of a's block 1")
try:
    check(manager)
    violation = None
except InvariantViolation as e:
    violation = e
claim(violation is None,
      "check(manager) passes: the pool, the queue, the index and the tables are consistent")

# %% [markdown]
# ## 4c. In the tensors: NaN reaches the attention output
#
# One full-attention layer, its KV cache filled with NaN (lesson 04). Each
# token's query, key and value come from fixed random tables indexed by token
# and position (`qkv` in the first cell), so a request that recomputes a prefix
# writes the same keys. `a` wrote positions 0..9 when it ran; `b` writes only
# what it computes, 8 and 9, and attends over 10 positions through its table.

# %%
section("4c. Attention over b's table")
out_b = run_step(b_table, b.all_token_ids, 8, 10)
show(f"b's table {b_table}; block {fresh} holds NaN in every slot: "
     f"{bool(torch.isnan(kv_cache[fresh]).all())}")
claim(torch.allclose(out_a, dense(a.all_token_ids, 0, 10), atol=1e-5),
      "a's attention equals attention computed from scratch")
claim(bool(torch.isnan(kv_cache[fresh]).all()) and bool(torch.isnan(out_b).all()),
      "b's fresh block was never written, and b's attention output is all NaN")
claim(not bool(torch.isnan(dense(b.all_token_ids, 8, 10)).any()),
      "computed from scratch, b's output would be finite")

# %% [markdown]
# On a GPU the unwritten block holds whatever was there before (zeros, or the
# keys of a long-gone request): no NaN, just wrong answers, silently.
#
# ## 4d. Caching spreads it
#
# `b` decodes two tokens, so its block 2 fills and is cached. `a` is long gone:
# a burst of other requests takes the whole pool and evicts `a`'s free cached
# blocks. Now the only block under the key "tokens 4..7 after tokens 0..3" is
# `b`'s unwritten one. Request `c` continues `b`'s conversation (its 12 tokens
# and 3 more): its hit includes that block, and is once more a block longer
# than its full-attention blocks.

# %%
section("4d. A later request hits the unwritten block")
b.status = RequestStatus.RUNNING
b.num_computed_tokens = 10
for token in (60, 61):
    manager.new_step_starts()
    b.append_output_token_ids(token)
    manager.allocate_slots(b, 1, num_lookahead_tokens=2)
    b_table = manager.get_block_ids("b")[0]
    run_step(b_table, b.all_token_ids, b.num_computed_tokens, b.num_computed_tokens + 1)
    b.num_computed_tokens += 1

manager.new_step_starts()
others = []
while True:                                      # other traffic, 4 tokens each, until full
    other = request(f"other{len(others)}", [1000 + 4 * len(others) + j for j in range(4)])
    if manager.allocate_slots(other, 4) is None:
        break
    others.append(other)
evicted_a1 = pool.blocks[a_table[1]].block_hash != a1_hash
for other in others:
    manager.free(other)

manager.new_step_starts()
c = request("c", list(b.all_token_ids) + [70, 71, 72])
hit_c, num_hit_c = manager.get_computed_blocks(c)
manager.allocate_slots(c, c.num_tokens - num_hit_c, num_hit_c, hit_c, num_lookahead_tokens=2)
c_table = manager.get_block_ids("c")[0]
out_c = run_step(c_table, c.all_token_ids, num_hit_c, c.num_tokens)
show(f"c's hit: {hit_c.get_block_ids()}, {num_hit_c} tokens; c's table {c_table}")
claim(evicted_a1 and fresh in hit_c.get_block_ids()[0],
      f"a's block 1 was evicted; c's full-attention hit contains b's unwritten block {fresh}")
violation_c = hit_violation(c, hit_c, num_hit_c)
claim(violation_c is not None and violation_c.invariant == "INV-HIT-2",
      "the checker flags c's hit too: 12 hit tokens, full-attention blocks for 8")
claim(bool(torch.isnan(out_c).all())
      and not bool(torch.isnan(dense(c.all_token_ids, 12, 15)).any()),
      "c's attention output is NaN, where computing from scratch gives finite values")

# %% [markdown]
# ## 5. Async scheduling: the scheduler one step ahead
#
# On GPUs vLLM 0.25.1 schedules asynchronously by default
# (`vllm/v1/core/sched/async_scheduler.py`, `EngineCore.step_with_batch_queue`):
# while the model runs step N, the scheduler already plans step N+1, so the
# GPU never waits for the CPU. The scheduler then cannot know the token step
# N will sample. It counts it as an **output placeholder**, and the KV layer
# sees three things it never sees otherwise:
#
# 1. `allocate_slots` for the next decode is called *before* the previous
#    token exists: `num_computed_tokens` already counts the slot of the token
#    in flight (`num_tokens` does not);
# 2. when a step's tokens arrive, `cache_blocks` caches only up to
#    `num_computed_tokens - num_output_placeholders`
#    (`vllm/v1/core/sched/async_scheduler.py:70-74`). The first number counts
#    the input positions of every step scheduled, the second the tokens the
#    steps in flight will sample; behind a step that returned tokens, those
#    are decodes, one placeholder per input position, so the difference is
#    the positions of the steps already processed. A step in flight has
#    sampled nothing yet, so its outputs have no ids and no block hash; its
#    input (the token just sampled) has an id, but is left for the next
#    `allocate_slots` to cache, so a block can be cached a step later than in
#    the synchronous loop. The rule is not "only written KV": `allocate_slots`
#    hashes and caches the blocks a step will fill *before* that step runs,
#    in both loops (`vllm/v1/core/kv_cache_manager.py:450-462`), which is
#    safe because any step that could hit such a block runs after the step
#    that writes it;
# 3. with drafts, the scheduler schedules `k` placeholder drafts (`-1`) and
#    the runner puts its own drafts in their place (section 2's roll-back then
#    also takes rejected drafts off the placeholders).
#
# Below, one request (6 prompt tokens, block size 4, 5 tokens to generate) on
# the model-free engine, with the synchronous and the asynchronous loop. Each
# row is one call into the scheduler: `schedule` (what it asked of
# `allocate_slots`) or `update` (a step's tokens coming back).

# %%
section("5. What the KV layer sees under async scheduling")


def async_rows(async_scheduling, k=0):
    """Run one request; one row per scheduler call (schedule / update)."""
    cls = AsyncScheduler if async_scheduling else Scheduler
    manager = KVCacheManager(KVCacheConfig(24, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))]),
                             max_model_len=64, scheduler_block_size=4, hash_block_size=4)
    scheduler = cls(manager, max_num_batched_tokens=16, num_speculative_tokens=k)
    runner = ModelFreeRunner(96, drafter=NgramProposer(1, 2, k, 64) if k else None,
                             async_scheduling=async_scheduling)
    core = make_engine_core(scheduler, runner)
    req = scheduler.new_request("a", [3, 1, 4, 1, 5, 9],
                                SamplingParams(max_tokens=5, ignore_eos=True))
    rows, outputs = [], []
    schedule, update = scheduler.schedule, scheduler.update_from_output

    def step_of(out):
        return next(i for i, o in enumerate(outputs) if o is out)

    def row(what, drafts=""):
        hashed = 0 if req.is_finished() else sum(
            b.block_hash is not None for b in manager.get_blocks("a").blocks[0])
        rows.append((what, drafts, req.num_computed_tokens, req.num_output_placeholders,
                     req.num_tokens, hashed))

    def logged_schedule():
        out = schedule()
        outputs.append(out)
        n = out.num_scheduled_tokens.get("a", 0)
        row(f"schedule step {step_of(out)}: {n} token(s)" if n else
            f"schedule step {step_of(out)}: nothing",
            str(out.scheduled_spec_decode_tokens.get("a", "")))
        return out

    def logged_update(out, model_output):
        finished = update(out, model_output)
        row(f"update step {step_of(out)}" + (": finished" if finished else ""))
        return finished
    scheduler.schedule, scheduler.update_from_output = logged_schedule, logged_update
    while core.has_work():
        core.step()
        check_kv_cache_manager(manager)
    core.shutdown()
    return rows, req, runner


def rows_table(rows):
    table = Table("call", "drafts scheduled", "num_computed_tokens", "placeholders",
                  "num_tokens", "blocks cached", box=None, header_style="bold")
    for r in rows:
        table.add_row(*map(str, r))
    return table


sync_rows, sync_req, _ = async_rows(False)
async_rows_, async_req, runner5 = async_rows(True)
show("synchronous:")
show(rows_table(sync_rows))
show("asynchronous:")
show(rows_table(async_rows_))
calls = [r[0].split(":")[0] for r in async_rows_]
claim(calls[:4] == ["schedule step 0", "schedule step 1", "update step 0", "schedule step 2"],
      "async: step 1 is scheduled before step 0's token is back")
claim(async_rows_[1][2:5] == (7, 2, 6),
      "when step 1 is planned, num_computed_tokens is 7 (the prompt and the token in "
      "flight) while the request still has 6 tokens")


def first_cached(rows, num_blocks):
    return next(r[0].split(":")[0] for r in rows if r[5] == num_blocks)


update_1 = next(r for r in async_rows_ if r[0].startswith("update step 1"))
claim(first_cached(sync_rows, 2) == "schedule step 2"
      and first_cached(async_rows_, 2) == "schedule step 3" and update_1[2:5] == (8, 1, 8),
      "block 1 (tokens 4-7) is cached when step 2 is planned in the synchronous loop, "
      "before step 2 writes token 7's KV; a step later in the asynchronous one: when "
      "token 7 arrives, 8 computed - 1 placeholder = 7 positions of processed steps "
      "(token 7 is the input of step 2, in flight), so the block waits for the next "
      "allocate_slots")
num_scheduled = sum(1 for r in async_rows_ if r[0].startswith("schedule") and "token" in r[0])
claim(num_scheduled == 5,
      "5 steps with tokens: the step that would make a 6th token is never scheduled "
      "(its in-flight steps already reach max_tokens)")
claim(async_req.output_token_ids == sync_req.output_token_ids
      == runner5.reference_output([3, 1, 4, 1, 5, 9], 5),
      "both loops generate the same 5 tokens")

# %% [markdown]
# With two drafts a step, the async scheduler schedules `[-1, -1]` after every
# decode (`async_scheduler.py:16, 42-44`): it cannot know the drafts, which
# the runner computes from the token it is sampling right now. The runner
# fills them in; the rejected ones come off both `num_computed_tokens` and
# the placeholders when the step returns.
#
# **Not a configuration vLLM runs.** vLLM 0.25.1 refuses
# `async_scheduling=True` with the CPU n-gram proposer (`method: "ngram"`):
# `VllmConfig` raises a `ValueError` unless the drafts come from EAGLE/MTP, a
# draft model, `ngram_gpu` (n-gram matching on the GPU) or DSpark
# (`vllm/config/vllm.py:961-981`); with `async_scheduling` left unset it
# turns async scheduling off, with a warning (`:1004-1015`). kvref has only
# the CPU n-gram proposer, and its `LLM` refuses the pairing as vLLM does.
# The model-free rows above drive kvref's `AsyncScheduler` directly, with the
# n-gram drafts standing in for one of the GPU drafters, whose scheduler side
# is the same: the `-1` placeholders, filled in by the worker. So they show
# what vLLM's `AsyncScheduler` does with drafts, not a setting to try on vLLM.
# A real model on kvref, asynchronously scheduled without drafts, generates
# exactly section 2b's tokens.

# %%
spec_rows, spec_req, spec_runner = async_rows(True, k=2)
show(rows_table(spec_rows[:6]))
claim(all(r[1] in ("", "[-1, -1]") for r in spec_rows) and any(r[1] == "[-1, -1]"
                                                               for r in spec_rows),
      "the async scheduler schedules only -1 placeholders for drafts")
claim(spec_req.output_token_ids == sync_req.output_token_ids, "the tokens do not change")
async_plain = LLM(model, block_size=B, num_gpu_blocks=64, max_model_len=64, device=args.device,
                  async_scheduling=True)
async_plain.after_step.append(lambda e: check_kv_cache_manager(e.kv_cache_manager))
got_plain = [o.outputs[0].token_ids for o in async_plain.generate(prompts, params)]
claim(got_plain == expected,
      "kvref's LLM(async_scheduling=True) generates section 2b's 80 tokens")
try:
    LLM(model, block_size=B, num_gpu_blocks=64, max_model_len=64, device=args.device,
        async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    refusal = ""
except ValueError as error:
    refusal = str(error)
show(refusal)
claim("vllm/config/vllm.py:961-981" in refusal,
      "asked for n-gram drafts with async scheduling, kvref's LLM refuses, as vLLM 0.25.1 does")

# %%
finish()
