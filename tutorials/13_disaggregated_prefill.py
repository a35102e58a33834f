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
# # Lesson 13: disaggregated prefill
#
# A prompt's prefill and its decode need different things from a GPU (one
# long compute-bound pass, then many short memory-bound steps), so large
# deployments run them on different engines: a *prefill engine* computes the
# prompt's keys and values and hands them to a *decode engine*, which
# generates. The hand-over is a KV connector (`kvref/distributed/`, vLLM's
# `kv_connector/v1/`). Here the prefill engine is a second OS process; the
# two meet over a `torch.distributed` gloo group and the KV moves block by
# block (`P2pConnector`).
#
# What to look for: the decode engine allocates a request's blocks *before*
# its KV exists, keeps them out of the prefix cache while they fill
# (`delay_cache_blocks`), admits such a load only if the prefills already
# running can still finish (`reserved_blocks`), and computes only each
# prompt's last token. When the prefill engine dies mid-transfer, what the
# decode engine does depends on `kv_load_failure_policy`. vLLM's default is
# `"fail"` (`vllm/config/kv_transfer.py:69`, kvref's too): each request that
# lost a block finishes with `finish_reason` `"error"` and no tokens. With
# `"recompute"`, set on purpose in this lesson, it recomputes what never
# arrived and generates as if nothing had failed. Both are run below.
#
# Run: `python tutorials/13_disaggregated_prefill.py` (CPU; a few seconds).

# %%
import multiprocessing
import socket
import time

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager,
                   Request, RequestStatus, get_request_block_hasher, init_none_hash, sha256)
from kvref.entrypoints.disagg_prefill import run_prefill_engine
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.engine import LLM, SamplingParams
from kvref.math_utils import cdiv
from kvref.viz import render_pool

from _lesson import claim, finish, section, show, start, tiny_llama

args = start("Disaggregated prefill", uses_tensors=True)
model = tiny_llama()
OPTIONS = dict(block_size=4, max_model_len=64, num_gpu_blocks=40)
system = list(range(20, 36))                                  # a shared 16-token prefix
prompts = [system + [40, 41, 42], system + [50, 51], [60, 61, 62, 63, 64, 65, 66]]
reference = [o.outputs[0].token_ids for o in
             LLM(model, **OPTIONS).generate(prompts, SamplingParams(max_tokens=5))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefill_engine(port, stall_after_blocks=None):
    """The prefill engine, forked: it prefills each prompt (max_tokens=1) and pushes
    its blocks to the decode engine listening on ``port``."""
    requests = [{"request_id": str(i), "prompt": p} for i, p in enumerate(prompts)]
    process = multiprocessing.get_context("fork").Process(
        target=run_prefill_engine, args=(model, requests, port), daemon=True,
        kwargs=dict(block_size=4, max_model_len=64, num_gpu_blocks=40,
                    stall_after_blocks=stall_after_blocks, emit=lambda record: None))
    process.start()
    return process


def decode_engine(port, policy="recompute"):
    config = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer",
                              kv_load_failure_policy=policy,
                              kv_connector_extra_config={"p2p_port": port, "timeout_s": 60})
    llm = LLM(model, kv_transfer_config=config, **OPTIONS)
    for i, prompt in enumerate(prompts):
        llm.add_request(prompt, SamplingParams(
            max_tokens=5, extra_args={"kv_transfer_params": {"do_remote_prefill": True}}),
            request_id=str(i))
    return llm


def run_to_end(llm, outputs):
    deadline = time.monotonic() + 60
    while llm.scheduler.has_requests() and time.monotonic() < deadline:
        outputs.update((o.request_id, o) for o in llm.step())
        if not llm.scheduler.running:
            time.sleep(0.002)                     # only transfers in flight


# %% [markdown]
# ## A request's blocks, filling remotely
#
# The decode engine's first step asks the connector how many tokens it can
# bring beyond the local prefix hit: the whole prompt, asynchronously. The
# scheduler allocates every block the prompt needs with
# `allocate_slots(..., num_external_computed_tokens=n, delay_cache_blocks=True)`
# and parks the request in `WAITING_FOR_REMOTE_KVS`: no token is scheduled
# for it, and its blocks carry no hash yet.

# %%
section("The first step of the decode engine")
port = free_port()
prefill = start_prefill_engine(port)
decode = decode_engine(port)
decode.step()
waiting = [r for r in decode.scheduler.skipped_waiting
           if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
show(render_pool(decode.kv_cache_manager))
claim(len(waiting) == len(prompts) and not decode.scheduler.running,
      "every request waits for remote KV, none runs")
claim(decode.scheduler.step_records[0].num_scheduled_tokens == {},
      "the first step schedules no token: nothing can compute before the KV lands")
blocks = decode.kv_cache_manager.get_blocks("0").blocks[0]
claim(len(blocks) == 5 and all(b.block_hash is None for b in blocks),
      "request 0 holds all 5 blocks of its 19-token prompt, none of them cached yet")
probe = Request("probe", prompts[0], block_hasher=decode.scheduler.block_hasher)
claim(decode.kv_cache_manager.get_computed_blocks(probe)[1] == 0,
      "an identical prompt finds no prefix hit in them (delay_cache_blocks)")

# %% [markdown]
# The worker half receives block after block into those blocks. When a
# request's last block has landed, `get_finished` reports it; the next
# `schedule()` caches its blocks (now a prefix hit for others) and admits it
# with `num_computed_tokens = prompt - 1`: the last prompt token is computed
# again, because its logits give the first output token.
#
# Which blocks cross is the connector's choice. kvref's `P2pConnector` has
# the prefill engine *push* every prompt block; the decode engine drops the
# ones its own prefix cache already holds. vLLM's `NixlConnector` (an alias
# of `NixlPullConnector`, `nixl/connector.py:12`) has the decode engine
# *pull*, and only what it lacks: it asks for the prompt beyond its local
# hit (`nixl/pull_scheduler.py:60-66`) and reads remote KV into its blocks
# that have no hash, the ones allocated for the external tokens
# (`:153-167`). Here the decode engine's cache starts empty, so both move
# every block.

# %%
section("The loads land")
outputs = {}
run_to_end(decode, outputs)
prefill.join(30)
show(render_pool(decode.kv_cache_manager))
claim([outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))] == reference,
      "the decode engine's tokens equal an engine that computed everything itself")
claim(decode.stats.prompt_tokens_computed == len(prompts),
      f"it computed {decode.stats.prompt_tokens_computed} prompt tokens: one per prompt")
claim(decode.stats.prompt_tokens_external == sum(len(p) - 1 for p in prompts),
      f"the other {decode.stats.prompt_tokens_external} came from the prefill engine")
claim(decode.model_runner.kv_connector.num_blocks_received == sum(cdiv(len(p), 4)
                                                                  for p in prompts),
      "every prompt block crossed between the processes, one message each "
      "(none was in the decode engine's prefix cache)")
claim(prefill.exitcode == 0, "the prefill engine freed its blocks once sent, and exited")

# %% [markdown]
# ## Reserved blocks: a load may not starve the prefills in flight
#
# An asynchronous load holds its blocks for the whole transfer, makes no
# progress meanwhile, and cannot be preempted (it is not running), so vLLM
# admits one only if the pool still has room for what the
# admitted-but-unfinished prefills will allocate: otherwise those prefills
# would preempt each other for blocks the load sits on, predictably, and when
# loads hold enough of the pool nothing could finish, a deadlock
# (`vllm/v1/core/sched/scheduler.py:897-901`). The scheduler sums
# that (`_inflight_prefill_reserved_blocks`) and passes it to
# `allocate_slots(..., reserved_blocks=...)`. On a bare manager of 8 blocks:

# %%
section("reserved_blocks on a small pool")
init_none_hash(sha256)
manager = KVCacheManager(KVCacheConfig(8, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))]),
                         max_model_len=64, scheduler_block_size=4, hash_block_size=4)
hasher = get_request_block_hasher(4, sha256)
load = Request("load", list(range(100, 116)), block_hasher=hasher)     # 16 tokens: 4 blocks
free = manager.block_pool.get_num_free_blocks()
refused = manager.allocate_slots(load, 0, num_external_computed_tokens=16,
                                 delay_cache_blocks=True, reserved_blocks=free - 3)
claim(refused is None, f"{free} free blocks, {free - 3} promised to prefills in flight: "
                       "a 4-block load is refused")
admitted = manager.allocate_slots(load, 0, num_external_computed_tokens=16,
                                  delay_cache_blocks=True, reserved_blocks=free - 4)
claim(admitted is not None and len(manager.get_blocks("load").blocks[0]) == 4,
      "with 4 blocks to spare it is admitted, all 4 blocks allocated at once "
      "(as external-computed blocks: allocate_slots returns only the new ones, none)")

# %% [markdown]
# ## A transfer that fails
#
# Now the prefill engine stops after 3 blocks and is killed (SIGKILL) while
# the decode engine waits for the rest. The receives that were pending raise;
# the connector reports the blocks that never arrived
# (`get_block_ids_with_load_errors`) and the requests as received. Under
# `kv_load_failure_policy="recompute"` each request goes back to its first
# missing block and computes from there; the blocks that did land are kept.

# %%
section("Killing the prefill engine mid-transfer")


def kill_mid_transfer(policy):
    """Decode with ``policy`` while the prefill engine stalls after 3 blocks and is killed."""
    port = free_port()
    prefill = start_prefill_engine(port, stall_after_blocks=3)
    decode = decode_engine(port, policy)
    worker = decode.model_runner.kv_connector
    outputs = {}
    deadline = time.monotonic() + 60
    while worker.num_blocks_received < 3 and time.monotonic() < deadline:
        outputs.update((o.request_id, o) for o in decode.step())
        time.sleep(0.002)
    claim(bool(decode.scheduler.skipped_waiting),
          f'{policy}: 3 blocks arrived, the rest are still awaited')
    prefill.kill()
    prefill.join(30)
    run_to_end(decode, outputs)
    pool = decode.kv_cache_manager.block_pool
    claim(not decode.scheduler.requests and pool.get_num_free_blocks() == 40 - 1,
          f"{policy}: no block leaked, all 39 are free again")
    return decode, [outputs[str(i)].outputs[0] for i in range(len(prompts))]


decode, got = kill_mid_transfer("recompute")
claim([c.token_ids for c in got] == reference,
      "after the kill, the same tokens: the missing blocks were recomputed")
claim(decode.stats.num_kv_load_failures == len(prompts) and
      decode.stats.prompt_tokens_external == 3 * 4,
      "every request lost blocks; request 0 kept the 3 that landed (12 tokens)")

# %% [markdown]
# The same kill under `"fail"`, vLLM's default: the scheduler finishes every
# request that lost a block with `FINISHED_ERROR` in the step that reports
# the failure, and frees its blocks. The client gets `finish_reason`
# `"error"` and no token.

# %%
decode, got = kill_mid_transfer("fail")
claim(decode.stats.num_kv_load_failures == len(prompts)
      and [c.finish_reason for c in got] == ["error"] * len(prompts)
      and all(c.token_ids == [] for c in got),
      'under "fail" every request that lost blocks finishes with "error" and no token')

finish()
