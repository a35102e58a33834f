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
# # Lesson 09: memory pressure: preemption, recompute, the watermark
#
# Requests grow one block at a time while they decode. When a running request
# needs a block and the pool has none, vLLM's scheduler
# (`vllm/v1/core/sched/scheduler.py`) **preempts** the last-admitted running
# request (the tail of its running list; a resumed request rejoins the tail):
# it frees all its blocks, sets its `num_computed_tokens` to 0 and puts it at
# the *front* of the waiting queue. Later it is admitted again and
# **recomputes** its prompt and the tokens it had generated. Its full blocks
# went back to the free queue still cached, so the re-admission usually hits
# most of them (lesson 01): recomputing is cheaper than it sounds.
#
# Three rules limit how much the scheduler takes on: a step that had to preempt
# admits nobody new; the **full-sequence gate** (vLLM's
# `scheduler_reserve_full_isl`, on by default) admits a waiting request only if
# the blocks for its whole prompt fit now, so a long prompt is not prefilled
# part way and then thrown out (section 4); and the **watermark** keeps a share
# of the pool free when admitting requests next to running ones, so that these
# can grow.
#
# This lesson runs a tiny random Llama through kvref's engine on a small pool
# and draws the pool at every step.

# %%
import torch

from kvref import KVCacheManager
from kvref.engine import LLM, EngineCore, ModelFreeRunner, SamplingParams, Scheduler
from kvref.viz.workloads import VOCAB, pressure
from kvref.verify.invariants import check_kv_cache_manager

from _draw import pool_row, step_timeline
from _lesson import claim, finish, section, show, start, tiny_llama

args = start("Memory pressure: preemption, recompute, the watermark", uses_tensors=True)
BLOCK_SIZE, MAX_TOKENS = 4, 12

model = tiny_llama()
g = torch.Generator().manual_seed(2)
prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (10, 9, 11, 8)]
params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

# %% [markdown]
# ## 1. Enough memory: the baseline
#
# Each request ends with 11 + 12 tokens at most: 6 blocks. A pool of 40 blocks
# holds all four at once; nothing is preempted.

# %%
def run(num_gpu_blocks, watermark=0.0):
    """Generate all prompts on a pool of ``num_gpu_blocks``; returns the outputs,
    the engine and the pool drawn after every step's scheduling."""
    llm = LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=num_gpu_blocks, max_model_len=32,
              max_num_batched_tokens=16, watermark=watermark, device=args.device)
    pictures = []
    llm.after_step.append(lambda engine: pictures.append(pool_row(engine)))
    return llm.generate(prompts, params), llm, pictures


def preempted_the_last_admitted(records):
    """Replay the running list from the step records: each preempted request
    must be the last one in it (vLLM's FCFS policy pops the last-admitted
    request, the end of its running list: the one admitted or resumed last,
    not the one that arrived last)."""
    running = []
    for record in records:
        for rid in record.preempted:
            if running[-1] != rid:
                return False
            running.pop()
        running += record.admitted + record.resumed
        running = [rid for rid in running if rid not in record.finished]
    return True


section("1. A pool of 40 blocks")
baseline, llm_big, _ = run(40)
claim(llm_big.stats.num_preemptions == 0, "with 40 blocks nobody is preempted")

# %% [markdown]
# ## 2. Too little memory: preemption and recompute
#
# 15 usable blocks for requests that will want up to 23. Read the timeline from
# the top: all four are admitted (their prompts fit; the step's 16-token budget
# cuts request 3's prompt), then they decode and grow; when a request crosses a
# block boundary and no block is free, the last-admitted running request is preempted
# (its blocks turn `○`: free, still cached). It waits at the front of the
# queue; when there is room again it is resumed, and its prefix hit shows how
# much of its recompute the cache saved: whatever of its blocks nobody evicted
# in the meantime.

# %%
section("2. A pool of 16 blocks")
small, llm_small, pictures = run(16)
show(step_timeline(llm_small, pictures))
records = llm_small.scheduler.step_records
preempt_steps = [r for r in records if r.preempted]
resumes = [(r, rid) for r in records for rid in r.resumed]
claim(llm_small.stats.num_preemptions > 0 and len(resumes) == llm_small.stats.num_preemptions,
      "requests were preempted, and each preemption was followed by a resume")
claim(preempted_the_last_admitted(records),
      "the request preempted is always the last-admitted one running (admitted or resumed last)")
claim(all(not r.admitted for r in preempt_steps),
      "a step that preempted admits no new request")
hits = {rid: r.prefix_hit_tokens[rid] for r, rid in resumes}
show(f"prefix hits on resume: {hits}")
claim(hits == {"2": 16, "3": 0},
      "request 2 resumed with 16 of its tokens still cached; 3's blocks had all been "
      "evicted by then, so it recomputed everything")
claim([o.outputs[0].token_ids for o in small] == [o.outputs[0].token_ids for o in baseline],
      "every request generates the same tokens as with the big pool")
extra = llm_small.stats.prompt_tokens_computed - llm_big.stats.prompt_tokens_computed
show(f"prompt tokens computed: {llm_big.stats.prompt_tokens_computed} with 40 blocks, "
     f"{llm_small.stats.prompt_tokens_computed} with 16 (+{extra} recomputed), "
     f"{llm_small.stats.prompt_tokens_cached} served by the cache on re-admission; "
     f"steps {llm_big.stats.num_steps} vs {llm_small.stats.num_steps}")

# %% [markdown]
# ## 3. The watermark
#
# `watermark=0.4` (the scheduler config's `watermark`, passed on to
# `KVCacheManager`; 0.0, off, by default; a pool of 16 blocks needs a coarse
# one) keeps `int(0.4 * 16) = 6` blocks back
# when a request is admitted next to running ones: the admission must leave at
# least 6 blocks free. An idle engine still admits (nothing is running that
# needs room), and running requests may use those blocks as they grow.
#
# Request 3 now waits at step 1 (admitting it would leave 5 free). The pool is
# tighter for fewer requests at a time: fewer preemptions, more steps.

# %%
section("3. The same pool with watermark 0.4")
marked, llm_marked, pictures = run(16, watermark=0.4)
show(step_timeline(llm_marked, pictures))
watermark_blocks = llm_marked.kv_cache_manager.watermark_blocks
beside_running = [r for r in llm_marked.scheduler.step_records
                  if (r.admitted or r.resumed)
                  and len(r.num_scheduled_tokens) > len(r.admitted) + len(r.resumed)]
admitted_at = {rid: r.step for r in llm_marked.scheduler.step_records for rid in r.admitted}
show(f"watermark_blocks = {watermark_blocks}; preemptions: {llm_small.stats.num_preemptions} "
     f"without the watermark, {llm_marked.stats.num_preemptions} with it; steps "
     f"{llm_small.stats.num_steps} vs {llm_marked.stats.num_steps}")
claim(watermark_blocks == 6, "watermark_blocks = int(0.4 * 16) = 6")
claim(len(beside_running) > 0 and all(r.num_free_blocks >= watermark_blocks
                                      for r in beside_running),
      "every admission next to running requests left at least 6 blocks free")
claim(admitted_at["3"] > 1, f"request 3, admitted at step 1 before, waits until step "
      f"{admitted_at['3']}")
claim(llm_marked.stats.num_preemptions < llm_small.stats.num_preemptions,
      "in this run, holding 6 blocks back means fewer preemptions")
claim([o.outputs[0].token_ids for o in marked] == [o.outputs[0].token_ids for o in baseline],
      "and the tokens are still the same")

# %% [markdown]
# ## 4. Long prompts: the full-sequence gate
#
# The gate looks at the prompt only (the "input sequence"; for a resumed
# request its outputs so far too), not at the tokens still to come, so the
# short prompts above always passed it. It matters when a prompt is longer
# than a step's budget: the prefill then takes several steps, and a request
# admitted into a pool that cannot hold its whole prompt is prefilled part way
# and preempted when the pool runs out, its work thrown away.
#
# The smallest case (block size 4, 13 blocks, `max_model_len` 48, a budget of
# 8 tokens): request 0 has 8 prompt tokens and 16 to generate, request 1 has
# 40 prompt tokens (10 blocks) and 2 to generate; they arrive together. At
# step 1 only 9 blocks are free. With the gate, request 1 waits for request 0
# to finish. Without it (`scheduler_reserve_full_isl=False`), request 1 takes
# 7 tokens of every step's budget for four steps, until request 0 needs a
# block and request 1, the last admitted, is preempted after 28 of its prompt
# tokens were computed. Not all 28 are lost: the 24 in its 6 full blocks stay
# cached, and its re-admission hits them, so 4 prompt tokens (the partial
# seventh block) are computed twice.

# %%
section("4. The full-sequence gate on a long prompt")
g = torch.Generator().manual_seed(3)
short, long = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (8, 40))
gate_runs = {}
for gate in (True, False):
    llm_gate = LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks=13, max_model_len=48,
                   max_num_batched_tokens=8, scheduler_reserve_full_isl=gate,
                   device=args.device)
    pictures = []
    llm_gate.after_step.append(lambda engine: pictures.append(pool_row(engine)))
    outputs = llm_gate.generate([short, long], [SamplingParams(max_tokens=16, ignore_eos=True),
                                                SamplingParams(max_tokens=2, ignore_eos=True)])
    gate_runs[gate] = (llm_gate, outputs)
    show(f"scheduler_reserve_full_isl={gate}: the first 7 steps")
    show(step_timeline(llm_gate, pictures[:7]))
with_gate, without_gate = gate_runs[True][0], gate_runs[False][0]
records = without_gate.scheduler.step_records
claim(with_gate.stats.num_preemptions == 0
      and with_gate.scheduler.step_records[1].num_scheduled_tokens == {"0": 1},
      "with the gate, request 1 (10 blocks) waits at step 1: 9 blocks are free")
claim([r.step for r in records if r.preempted == ["1"]] == [5]
      and sum(r.num_scheduled_tokens.get("1", 0) for r in records[:5]) == 28,
      "without it, request 1 is prefilled 28 tokens over steps 1-4 and preempted at step 5")
show(f"prompt tokens computed: {with_gate.stats.prompt_tokens_computed} with the gate, "
     f"{without_gate.stats.prompt_tokens_computed} without (+ "
     f"{without_gate.stats.prompt_tokens_cached} served by the cache on re-admission); "
     f"tokens scheduled {with_gate.stats.total_tokens_scheduled} vs "
     f"{without_gate.stats.total_tokens_scheduled}; steps {with_gate.stats.num_steps} vs "
     f"{without_gate.stats.num_steps}")
claim(without_gate.stats.prompt_tokens_cached == 24
      and without_gate.stats.prompt_tokens_computed - with_gate.stats.prompt_tokens_computed == 4,
      "of the 28 tokens computed before the preemption, 24 are hit on re-admission: "
      "4 are computed twice")
claim(without_gate.stats.total_tokens_scheduled > with_gate.stats.total_tokens_scheduled
      and without_gate.stats.prompt_tokens_computed > with_gate.stats.prompt_tokens_computed,
      "without the gate the engine schedules more tokens for the same outputs")
claim([o.outputs[0].token_ids for o in gate_runs[True][1]]
      == [o.outputs[0].token_ids for o in gate_runs[False][1]],
      "and both generate the same tokens")

# %% [markdown]
# The gate does not make the engine faster here: request 1 starts later, and
# the run takes more steps. What it removes is wasted work. The `pressure`
# workload of `kvref demo` (8 prompts of 18-29 tokens, a 24-block pool, a
# budget of 32; the demo runs it with the gate, and its first refused
# allocation, which `kvref explain` takes apart, is the gate's) shows the same
# thing inside a busier run: at step 22, without the gate, `r6` gets the 3
# tokens left in the budget and is preempted at step 23; with the gate it
# waits until step 29, when the blocks of its whole 24-token prompt are free,
# and is never preempted. The recorded vLLM traces in
# `tests/engine/vllm_scheduler_traces/` (`long_prompts` against `no_gate`)
# are vLLM's own scheduler both ways, and kvref's replays them step for step.

# %%
section("4b. The pressure workload, with and without the gate")


def run_pressure(gate):
    """The demo's pressure preset on the model-free engine, arrivals as the demo has them."""
    preset = pressure()
    manager = KVCacheManager(preset.config, max_model_len=preset.max_model_len,
                             scheduler_block_size=preset.block_size,
                             hash_block_size=preset.block_size,
                             max_num_batched_tokens=preset.max_num_batched_tokens,
                             watermark=preset.watermark, log_stats=True)
    scheduler = Scheduler(manager, max_num_batched_tokens=preset.max_num_batched_tokens,
                          max_num_seqs=preset.max_num_seqs, scheduler_reserve_full_isl=gate)
    core = EngineCore(scheduler, ModelFreeRunner(VOCAB))
    waiting, clock = list(preset.arrivals), 0
    while waiting or scheduler.has_unfinished_requests():
        for arrival in [a for a in waiting if a.step <= clock]:
            waiting.remove(arrival)
            scheduler.new_request(arrival.request_id, arrival.prompt,
                                  SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True))
        clock += 1
        if scheduler.has_unfinished_requests():
            core.step()
            check_kv_cache_manager(manager)
    return scheduler


gated, ungated = run_pressure(True), run_pressure(False)


def r6_steps(scheduler):
    """(step r6 was first admitted, tokens it got then, steps it was preempted at)."""
    first = next(r for r in scheduler.step_records if "r6" in r.admitted)
    return (first.step, first.num_scheduled_tokens["r6"],
            [r.step for r in scheduler.step_records if "r6" in r.preempted])


show(f"pressure: preemptions {gated.stats.num_preemptions} with the gate, "
     f"{ungated.stats.num_preemptions} without; prompt tokens computed "
     f"{gated.stats.prompt_tokens_computed} vs {ungated.stats.prompt_tokens_computed}; "
     f"r6 (admitted at, tokens then, preempted at): {r6_steps(gated)} vs {r6_steps(ungated)}")
claim(r6_steps(ungated) == (22, 3, [23]) and r6_steps(gated)[0] == 29
      and r6_steps(gated)[2] == [],
      "without the gate r6 is admitted at step 22 with 3 tokens and preempted at step 23; "
      "with it, r6 is admitted at step 29 and never preempted")
claim(gated.stats.num_preemptions < ungated.stats.num_preemptions
      and gated.stats.prompt_tokens_computed < ungated.stats.prompt_tokens_computed,
      "the gate preempts less and recomputes less on the pressure workload")

# %%
finish()
