#!/usr/bin/env python3
"""Record what vLLM 0.25.1's own Scheduler / AsyncScheduler decide, step by step.

Runs vLLM's real ``vllm.v1.core.sched.scheduler.Scheduler`` (and
``async_scheduler.AsyncScheduler``) offline on CPU, with no model: a
model-free worker returns deterministic tokens, and writes every decision as
compact traces under ``tests/engine/vllm_scheduler_traces/`` (one
``PROFILE.json.gz`` per workload profile, several seeded runs each).
``tests/engine/test_vllm_scheduler_traces.py`` replays them on kvref's
scheduler with kvref's ``ModelFreeRunner`` and requires identical decisions;
it does not need vLLM.

Needs the oracle environment of ``../shared/conformance/VLLM_SCHEDULER.md``
(vLLM 0.25.1 source, torch CPU, ``einops``; ``numba`` for vLLM's own n-gram
proposer). Run it with that interpreter, from the repository root::

    /root/.cache/vllm-oracle/bin/python tools/record_vllm_scheduler.py \\
        --vllm-src /root/.cache/vllm-oracle/vllm-src \\
        --model-dir ../shared/conformance/vllm_scheduler_model
    /root/.cache/vllm-oracle/bin/python tools/record_vllm_scheduler.py --profile tight

The rules both sides share (the replay computes them itself, it does not read
them from the trace):

* The model: the token a request samples is ``crc32(its tokens so far, each
  8 bytes little-endian signed) % vocab_size`` (kvref's ``ModelFreeRunner``).
  A prefill chunk that does not reach the request's last token samples
  nothing. With draft tokens ``d`` the target after ``d[:j]`` is the same hash
  of the tokens plus ``d[:j]``; drafts are kept while they equal their target,
  then the target is emitted (rejection sampling of exact tokens).
* The drafts (n-gram speculation): vLLM's own
  ``_find_longest_matched_ngram_and_propose_tokens`` (``ngram_proposer.py``),
  called as vLLM's GPU runner calls it: for each scheduled request that
  sampled and has fewer than ``max_model_len`` tokens, after the step.
  Synchronous engine: the drafts go to ``update_draft_token_ids`` (vLLM's
  ``EngineCore.post_step``). Asynchronous engine: the scheduler schedules
  ``-1`` placeholders and the worker fills them with the draft proposed after
  the request's most recent sample, padded with ``-1`` (a ``-1`` is always
  rejected). This is the worker of an async-capable proposer (vLLM allows
  async scheduling with ``ngram_gpu``, not with the CPU ``ngram``); unlike
  ``ngram_gpu`` it does not trim invalid draft slots from the scheduler output
  (``update_scheduler_for_invalid_drafts``), which is a worker-side detail.
* The loop: vLLM's ``EngineCore.step`` (+ ``post_step``) and, for async
  scheduling, ``EngineCore.step_with_batch_queue`` with a queue two deep.
  Requests arrive before a numbered engine iteration (one call of the step
  function); an idle engine jumps to the next arrival.

* A KV connector (the ``conn_*`` profiles): vLLM's scheduler builds
  ``SimConnector`` (below, on vLLM's ``KVConnectorBase_V1``; kv_role
  ``kv_both``, one full-attention group, the hybrid manager off as for any
  connector without ``SupportsHMA``), which answers from a per-request plan
  drawn with the run (``draw_plan``) and logs every call; the worker's
  ``SimTransfers`` ends each load or send a planned number of worker steps
  later and reports failed blocks, and a step without a forward that has
  nothing to report returns no ``KVConnectorOutput``, as vLLM's runner does.
  The events then also carry the connector's calls, the KV cache manager's
  calls, the published KV event batches and every request's status, and a run
  aborts its unfinished requests after ``STALL_STEPS`` idle iterations (nothing
  scheduled, no transfer in flight or ended).
  ``kvref/verify/sim_connector.py`` is the same connector on kvref's side.

Set ``PYTHONHASHSEED`` (the tool re-executes itself with ``0`` when unset):
vLLM seeds its ``NONE_HASH`` from it and iterates sets of request ids.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import zlib
from collections import deque
from pathlib import Path

FORMAT = "kvref-vllm-scheduler-trace/1"
REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "engine" / "vllm_scheduler_traces"
DEFAULT_SRC = Path("/root/.cache/vllm-oracle/vllm-src")
DEFAULT_MODEL_DIR = next(
    (d / "shared" / "conformance" / "vllm_scheduler_model" for d in (REPO.parent, Path("/work"))
     if (d / "shared").is_dir()), Path("vllm_scheduler_model"))

# ---------------------------------------------------------------------------
# Workload profiles. Each run draws its arrivals and sizes from a seeded RNG;
# the trace stores the drawn workload, so the profile text is only a recipe.

PROFILES: dict[str, dict] = {
    # Full attention, roomy pool: chunked prefill, prefix hits, continuous batching.
    "full": dict(runs=24, block_size=4, blocks=(64, 96), max_model_len=96, budget=(16, 48),
                 max_num_seqs=(4, 8), requests=(6, 10), prompt=(4, 40), outputs=(2, 16),
                 shared_prefix=0.5, vocab=64),
    # Tight pools and small budgets: preemption, recompute, re-admission.
    "tight": dict(runs=30, block_size=4, blocks=(14, 24), max_model_len=48, budget=(6, 16),
                  max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 36), outputs=(4, 16),
                  shared_prefix=0.3, vocab=64),
    # Long prompts into a tight pool: the full-sequence admission gate decides.
    "long_prompts": dict(runs=24, block_size=4, blocks=(13, 20), max_model_len=48,
                         budget=(8, 12), max_num_seqs=(2, 4), requests=(3, 6),
                         prompt=(20, 44), outputs=(2, 12), shared_prefix=0.0, vocab=64),
    # The same, with vLLM's gate switched off (scheduler_reserve_full_isl=False).
    "no_gate": dict(runs=12, block_size=4, blocks=(13, 20), max_model_len=48, budget=(8, 12),
                    max_num_seqs=(2, 4), requests=(3, 6), prompt=(20, 44), outputs=(2, 12),
                    shared_prefix=0.0, vocab=64, reserve_full_isl=False),
    # Full + sliding window: two KV cache groups, the window frees blocks as it slides.
    "sliding_window": dict(runs=24, block_size=4, blocks=(24, 48), max_model_len=64,
                           budget=(8, 24), max_num_seqs=(3, 6), requests=(5, 9),
                           prompt=(4, 40), outputs=(4, 20), shared_prefix=0.4, vocab=64,
                           sliding_window=(8, 16)),
    # The watermark keeps a share of the pool for running requests.
    "watermark": dict(runs=16, block_size=4, blocks=(24, 40), max_model_len=48, budget=(8, 24),
                      max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 32), outputs=(4, 16),
                      shared_prefix=0.3, vocab=64, watermark=(0.05, 0.2)),
    # long_prefill_token_threshold caps every request's tokens per step.
    "threshold": dict(runs=12, block_size=4, blocks=(32, 64), max_model_len=64, budget=(12, 32),
                      max_num_seqs=(3, 6), requests=(4, 8), prompt=(8, 48), outputs=(2, 10),
                      shared_prefix=0.3, vocab=64, threshold=(3, 8)),
    # Stop conditions: EOS, stop tokens, min_tokens, ignore_eos, max_model_len.
    "stops": dict(runs=20, block_size=4, blocks=(32, 64), max_model_len=40, budget=(8, 24),
                  max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 24), outputs=(4, 30),
                  shared_prefix=0.3, vocab=12, stops=True),
    # N-gram speculation (a small vocabulary and repetitive prompts, so drafts match).
    "ngram": dict(runs=24, block_size=4, blocks=(32, 64), max_model_len=64, budget=(8, 32),
                  max_num_seqs=(3, 6), requests=(4, 8), prompt=(4, 32), outputs=(4, 24),
                  shared_prefix=0.3, vocab=5, spec=(1, 4), repetitive=True, duplicates=0.4),
    "ngram_tight": dict(runs=20, block_size=4, blocks=(16, 26), max_model_len=48, budget=(6, 16),
                        max_num_seqs=(3, 5), requests=(4, 8), prompt=(4, 30), outputs=(4, 20),
                        shared_prefix=0.3, vocab=5, spec=(1, 4), repetitive=True, duplicates=0.4),
    # Repeated prompts: whole-prompt prefix hits (one token left to compute).
    "prefix_hits": dict(runs=16, block_size=4, blocks=(24, 64), max_model_len=64,
                        budget=(8, 32), max_num_seqs=(3, 6), requests=(6, 10), prompt=(4, 30),
                        outputs=(2, 12), shared_prefix=0.3, vocab=64, duplicates=0.5),
    # vllm.LLM's defaults: max_num_batched_tokens and max_num_seqs as vLLM's own
    # EngineArgs resolves them on CPU for the run's max_model_len (4096 and 256).
    "llm_defaults": dict(runs=10, block_size=4, blocks=(18, 40), max_model_len=(32, 64),
                         budget=None, max_num_seqs=None, requests=(6, 12), prompt=(4, 30),
                         outputs=(2, 16), shared_prefix=0.4, vocab=64, llm_defaults=True),
    # Small budgets, long drafts, repeated prompts: the 1 + k padding often does
    # not fit the budget left, and vLLM then stops admitting (its refusal branch).
    "ngram_small_budget": dict(runs=16, block_size=4, blocks=(32, 64), max_model_len=48,
                               budget=(4, 9), max_num_seqs=(2, 4), requests=(5, 9),
                               prompt=(4, 24), outputs=(4, 16), shared_prefix=0.3, vocab=5,
                               spec=(2, 4), repetitive=True, duplicates=0.6),
    # Full + sliding window with different block sizes (4 and 8): the scheduler
    # block size is their lcm, the hash block size their gcd.
    "mixed_block_sizes": dict(runs=10, block_size=4, blocks=(24, 48), max_model_len=64,
                              budget=(8, 24), max_num_seqs=(3, 6), requests=(5, 9),
                              prompt=(4, 40), outputs=(4, 20), shared_prefix=0.4, vocab=64,
                              sliding_window=(8, 16), mixed=True),
    # Asynchronous scheduling (AsyncScheduler + the batch queue).
    "async": dict(runs=24, block_size=4, blocks=(32, 64), max_model_len=64, budget=(8, 32),
                  max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 40), outputs=(1, 16),
                  shared_prefix=0.4, vocab=64, async_scheduling=True),
    "async_tight": dict(runs=24, block_size=4, blocks=(14, 24), max_model_len=48,
                        budget=(6, 16), max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 36),
                        outputs=(1, 16), shared_prefix=0.3, vocab=64, async_scheduling=True),
    "async_stops": dict(runs=12, block_size=4, blocks=(32, 64), max_model_len=40,
                        budget=(8, 24), max_num_seqs=(3, 6), requests=(5, 9), prompt=(4, 24),
                        outputs=(2, 30), shared_prefix=0.3, vocab=12, stops=True,
                        async_scheduling=True),
    "async_ngram": dict(runs=24, block_size=4, blocks=(20, 48), max_model_len=64,
                        budget=(8, 32), max_num_seqs=(3, 6), requests=(4, 8), prompt=(4, 32),
                        outputs=(2, 24), shared_prefix=0.3, vocab=5, spec=(1, 4),
                        repetitive=True, duplicates=0.4, async_scheduling=True),
    "async_sliding_window": dict(runs=12, block_size=4, blocks=(24, 40), max_model_len=64,
                                 budget=(8, 24), max_num_seqs=(3, 6), requests=(5, 9),
                                 prompt=(4, 40), outputs=(2, 20), shared_prefix=0.4, vocab=64,
                                 sliding_window=(8, 16), async_scheduling=True),
}

# KV connector profiles: vLLM's scheduler drives the simulated connector below
# (SimConnectorPlan), one full-attention group, kv_role "kv_both". Per request
# the run draws what the "remote" holds and how its load goes (see draw_plan).
_CONN = dict(block_size=4, max_model_len=64, max_num_seqs=(3, 6), requests=(5, 9),
             prompt=(4, 40), outputs=(1, 12), shared_prefix=0.4, vocab=64)
_LOADS = dict(ext=0.75, async_=0.5, delay=(1, 5), none=0.2, fail=0.25, hold=0.35,
              hold_steps=(1, 4))
PROFILES.update({
    # Synchronous loads (whole blocks, never the last token), some failing, producer holds.
    "conn_sync": dict(_CONN, runs=24, blocks=(40, 64), budget=(8, 32),
                      connector=dict(_LOADS, async_=0.0, policy="recompute")),
    # Asynchronous loads that land 1-5 steps later, some failing (some in their first
    # block: nothing lands), "ask again" answers, holds; policy "recompute".
    "conn_async": dict(_CONN, runs=24, blocks=(40, 64), budget=(8, 32),
                       connector=dict(_LOADS, async_=0.7, policy="recompute")),
    # The same loads under vLLM's default policy "fail".
    "conn_fail": dict(_CONN, runs=28, blocks=(40, 64), budget=(8, 32),
                      connector=dict(_LOADS, policy="fail")),
    # Tight pools: reserved_blocks decides admissions of async loads; requests with
    # external tokens are preempted and asked again.
    "conn_tight": dict(_CONN, runs=32, blocks=(16, 24), max_model_len=48, budget=(6, 16),
                       requests=(6, 10), outputs=(4, 16),
                       connector=dict(_LOADS, async_=0.6, delay=(1, 8), policy="recompute")),
    "conn_tight_fail": dict(_CONN, runs=20, blocks=(16, 24), max_model_len=48,
                            budget=(6, 16), requests=(6, 10), outputs=(4, 16),
                            connector=dict(_LOADS, async_=0.6, policy="fail")),
    # Async scheduling with a consumer: deferred frees (stop tokens end requests
    # while their next step is in flight), placeholders, both policies.
    "conn_async_sched": dict(_CONN, runs=28, blocks=(40, 64), budget=(8, 32),
                             async_scheduling=True, stops=True, vocab=12, outputs=(4, 16),
                             connector=dict(_LOADS, policy="recompute")),
    "conn_async_sched_fail": dict(_CONN, runs=24, blocks=(40, 64), budget=(8, 32),
                                  async_scheduling=True, stops=True, vocab=12,
                                  outputs=(4, 16), connector=dict(_LOADS, policy="fail")),
    "conn_async_sched_tight": dict(_CONN, runs=32, blocks=(16, 24), max_model_len=48,
                                   budget=(6, 16), requests=(6, 10), outputs=(4, 16),
                                   async_scheduling=True,
                                   connector=dict(_LOADS, async_=0.6, delay=(1, 8),
                                                  policy="recompute")),
})

# After this many engine iterations in a row in which nothing was scheduled, no
# transfer ended and none was in flight, the run aborts its unfinished requests,
# one by one in id order (a user cancelling): a connector can stall vLLM's
# scheduler for good (../shared/VLLM_DEFECTS.md 3-5, reproduced by kvref too).
STALL_STEPS = 12


def draw_plan(rng: random.Random, knobs: dict, prompt_len: int, block_size: int) -> dict:
    """How the simulated connector treats one request (both sides read it)."""
    plan = {"ext": 0, "async": False, "delay": 1, "none": 0, "fail": [], "hold": 0}
    if rng.random() < knobs["none"]:
        plan["none"] = rng.randint(1, 2)          # "ask again" this many times first
    if rng.random() < knobs["ext"]:
        plan["async"] = rng.random() < knobs["async_"]
        if plan["async"] and rng.random() < 0.3:
            plan["ext"] = prompt_len              # the whole prompt (a P/D decode)
        else:
            plan["ext"] = block_size * rng.randint(1, max(1, prompt_len // block_size))
        plan["delay"] = rng.randint(*knobs["delay"])
        # (Under async scheduling only asynchronous loads fail: after a failed
        # synchronous load the scheduler drops a sampled token the model-free worker
        # (like kvref's runner) has already moved past, and vLLM leaks a placeholder,
        # ../shared/VLLM_DEFECTS.md 5.)
        if rng.random() < knobs["fail"] and (plan["async"] or not knobs.get("async_sched")):
            # Indices into the loaded blocks; 0 fails the load from its first block.
            num = -(-plan["ext"] // block_size)
            plan["fail"] = sorted(rng.sample(range(num), rng.randint(1, min(2, num))))
    if rng.random() < knobs["hold"]:
        plan["hold"] = rng.randint(*knobs["hold_steps"])
    return plan


# The smallest case, recorded exactly (not drawn).
FIXED_RUNS = {
    "gate_minimal": dict(
        config=dict(block_size=4, num_blocks=13, groups=[{"kind": "full"}], max_model_len=48,
                    max_num_batched_tokens=8, max_num_seqs=4, long_prefill_token_threshold=0,
                    watermark=0.0, enable_prefix_caching=True, scheduler_reserve_full_isl=True,
                    async_scheduling=False, speculative=None, vocab_size=64,
                    eos_token_id=None),
        arrivals=[[0, "a", list(range(100, 108)), {"max_tokens": 16, "ignore_eos": True}],
                  [0, "b", list(range(200, 240)), {"max_tokens": 2, "ignore_eos": True}]]),
}


def draw_run(profile: dict, seed: int) -> dict:
    """One run of a profile: its configuration and its arrivals."""
    rng = random.Random(seed)
    pick = lambda lo_hi: rng.randint(*lo_hi)  # noqa: E731
    block_size = profile["block_size"]
    max_model_len = profile["max_model_len"]
    if isinstance(max_model_len, tuple):
        max_model_len = pick(max_model_len)
    groups = [{"kind": "full"}]
    if "sliding_window" in profile:
        groups.append({"kind": "sliding_window",
                       "sliding_window": pick(profile["sliding_window"])})
    if profile.get("mixed"):
        # One group gets twice the block size: full 8 + window 4, or full 4 + window 8.
        groups[rng.randrange(2)]["block_size"] = 2 * block_size
    spec = None
    if "spec" in profile:
        low = rng.randint(1, 2)
        spec = {"num_speculative_tokens": pick(profile["spec"]), "prompt_lookup_min": low,
                "prompt_lookup_max": rng.randint(low, 4)}
    watermark = round(rng.uniform(*profile["watermark"]), 3) if "watermark" in profile else 0.0
    threshold = pick(profile["threshold"]) if "threshold" in profile else 0
    vocab = profile["vocab"]
    eos = rng.randrange(vocab) if profile.get("stops") else None
    num_blocks = pick(profile["blocks"])
    # None: vLLM's LLM defaults, filled in by record_run (they need vLLM).
    budget = pick(profile["budget"]) if profile["budget"] else None
    seqs = pick(profile["max_num_seqs"]) if profile["max_num_seqs"] else None
    config = dict(block_size=block_size, num_blocks=num_blocks, groups=groups,
                  max_model_len=max_model_len, max_num_batched_tokens=budget,
                  max_num_seqs=seqs,
                  long_prefill_token_threshold=threshold, watermark=watermark,
                  enable_prefix_caching=True,
                  scheduler_reserve_full_isl=profile.get("reserve_full_isl", True),
                  async_scheduling=profile.get("async_scheduling", False), speculative=spec,
                  vocab_size=vocab, eos_token_id=eos)
    # The pool must hold one full-length request (vLLM refuses to start otherwise).
    per_request = sum(-(-max_model_len // g.get("block_size", block_size)) for g in groups)
    config["num_blocks"] = max(config["num_blocks"], per_request + 1)

    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    arrivals = []
    iteration = 0
    for i in range(pick(profile["requests"])):
        iteration += rng.choice([0, 0, 1, 2, 3, 5])
        length = pick(profile["prompt"])
        if profile.get("repetitive"):
            motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 4))]
            prompt = [motif[j % len(motif)] if rng.random() < 0.85 else rng.randrange(vocab)
                      for j in range(length)]
        else:
            prompt = [rng.randrange(1000) for _ in range(length)]
        if rng.random() < profile["shared_prefix"]:
            prompt = (rng.choice(prefixes) + prompt)
        prompt = prompt[:max_model_len - 2] or [1]
        if arrivals and profile.get("duplicates") and rng.random() < profile["duplicates"]:
            prompt = list(rng.choice(arrivals)[2])      # the same prompt again: a full hit
        params = {"max_tokens": pick(profile["outputs"]), "ignore_eos": True}
        if profile.get("stops"):
            params["ignore_eos"] = rng.random() < 0.3
            if rng.random() < 0.4:
                params["stop_token_ids"] = sorted(rng.sample(range(vocab), 2))
            if rng.random() < 0.3:
                # Not past max_model_len: min_tokens beats the length stop in check_stop,
                # and a request that can neither run nor stop would never finish.
                params["min_tokens"] = min(rng.randint(1, 4), max_model_len - len(prompt))
            if rng.random() < 0.3:
                params["max_tokens"] = max_model_len   # capped by max_model_len instead
        arrivals.append([iteration, f"r{i}", prompt, params])
    if "connector" in profile:
        knobs = dict(profile["connector"], async_sched=config["async_scheduling"])
        config["connector"] = {
            "policy": knobs["policy"], "kv_role": "kv_both",
            "plans": {rid: draw_plan(rng, knobs, len(prompt), block_size)
                      for _, rid, prompt, _ in arrivals}}
        config["enable_kv_cache_events"] = True
    return {"config": config, "arrivals": arrivals}


# ---------------------------------------------------------------------------
# The simulated connector. Its scheduler half answers from the run's plans; its
# worker half (SimTransfers) ends each transfer a set number of worker steps
# after the step that started it. kvref/verify/sim_connector.py is the same
# behaviour on kvref's side (written twice on purpose: the recorder imports no kvref).


class SimConnectorPlan:
    """The scheduler half's decisions, with every call logged to ``self.calls``."""

    def __init__(self, plans: dict, block_size: int, calls: list) -> None:
        self.plans = plans
        self.block_size = block_size
        self.calls = calls
        self.asks: dict[str, int] = {}            # "ask again" answers given so far
        self.local: dict[str, int] = {}           # the local hit of the last ask
        self.lost: set[str] = set()               # a load failed: not offered again
        self.loads: dict[str, list] = {}          # started this step, for the worker
        self.sends: dict[str, int] = {}           # held blocks to send, for the worker
        self.pending: set[tuple[str, str]] = set()   # asynchronous loads and sends not ended
        self.num_landed = 0

    def plan(self, req_id: str) -> dict:
        return self.plans.get(req_id) or {"ext": 0, "async": False, "delay": 1, "none": 0,
                                          "fail": [], "hold": 0}

    def matched(self, req_id: str, num_tokens: int, num_computed: int):
        plan = self.plan(req_id)
        if self.asks.get(req_id, 0) < plan["none"]:
            self.asks[req_id] = self.asks.get(req_id, 0) + 1
            answer = (None, False)
        else:
            ext = 0 if req_id in self.lost else plan["ext"]
            if not plan["async"]:
                ext = min(ext, num_tokens - 1)    # a synchronous hit leaves one to compute
            n = max(0, ext - num_computed)
            answer = (n, plan["async"] and n > 0)
        self.local[req_id] = num_computed
        self.calls.append(["get_num_new_matched_tokens", req_id, num_computed, list(answer)])
        return answer

    def after_alloc(self, req_id: str, block_ids: list[list[int]], num_external: int) -> None:
        self.calls.append(["update_state_after_alloc", req_id, block_ids, num_external])
        if num_external == 0:
            return
        plan = self.plan(req_id)
        bs = self.block_size
        first = self.local[req_id] // bs
        loaded = block_ids[0][first:-(-(self.local[req_id] + num_external) // bs)]
        failed = [loaded[i] for i in plan["fail"] if i < len(loaded)]
        if failed:
            self.lost.add(req_id)
        self.loads[req_id] = [loaded, plan["async"], plan["delay"], failed]
        if plan["async"]:
            self.pending.add(("recv", req_id))

    def meta(self) -> dict:
        meta = {"loads": self.loads, "sends": self.sends}
        self.loads, self.sends = {}, {}
        self.calls.append(["build_connector_meta", meta])
        return meta

    def output(self, sending, recving, invalid) -> None:
        self.num_landed += len(recving or ())
        self.pending -= {("send", r) for r in sending or ()}
        self.pending -= {("recv", r) for r in recving or ()}
        self.calls.append(["update_connector_output", sorted(sending) if sending else None,
                           sorted(recving) if recving else None, sorted(invalid)])

    def finished(self, req_id: str, status: str, block_ids: list[int]):
        hold = self.plan(req_id)["hold"]
        held = bool(hold and block_ids and status in ("FINISHED_STOPPED",
                                                       "FINISHED_LENGTH_CAPPED"))
        if held:
            self.sends[req_id] = hold
            self.pending.add(("send", req_id))
        answer = (held, {"sent_from": req_id} if held else None)
        self.calls.append(["request_finished", req_id, status, list(block_ids), list(answer)])
        return answer

    def events(self) -> int:
        """How many events to hand out: one per load landed since the last call."""
        num, self.num_landed = self.num_landed, 0
        self.calls.append(["take_events", num])
        return num


class SimTransfers:
    """The worker half: which transfers end in this worker step."""

    def __init__(self) -> None:
        self.now = 0
        self.due: list[tuple[int, str, str, list]] = []   # (step, kind, request, failed)

    def step(self, meta: dict | None):
        invalid: set[int] = set()
        for req_id, (_, is_async, delay, failed) in (meta or {}).get("loads", {}).items():
            if is_async:
                self.due.append((self.now + delay, "recv", req_id, failed))
            else:
                invalid.update(failed)            # a synchronous load fails in its step
        for req_id, hold in (meta or {}).get("sends", {}).items():
            self.due.append((self.now + hold, "send", req_id, []))
        sending, recving = set(), set()
        for item in [d for d in self.due if d[0] <= self.now]:
            self.due.remove(item)
            (recving if item[1] == "recv" else sending).add(item[2])
            invalid.update(item[3])               # reported with the finished load
        self.now += 1
        return sending or None, recving or None, invalid


def make_vllm_sim_connector():
    """SimConnector on vLLM's KVConnectorBase_V1 (scheduler-side API)."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata)

    class SimMetadata(KVConnectorMetadata):
        def __init__(self, meta: dict) -> None:
            self.meta = meta

    class SimConnector(KVConnectorBase_V1):
        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.sim = SimConnectorPlan(extra["plans"], extra["block_size"], extra["calls"])

        # worker side: SimTransfers in the recorder's Worker plays it
        def start_load_kv(self, forward_context, **kwargs) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None: ...
        def wait_for_save(self) -> None: ...

        def bind_gpu_block_pool(self, gpu_block_pool) -> None:
            self.sim.calls.append(["bind_gpu_block_pool", gpu_block_pool.num_gpu_blocks])

        def on_new_request(self, request) -> None:
            self.sim.calls.append(["on_new_request", request.request_id])

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.sim.matched(request.request_id, request.num_tokens, num_computed_tokens)

        def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
            self.sim.after_alloc(request.request_id, [list(b) for b in blocks.get_block_ids()],
                                 num_external_tokens)

        def build_connector_meta(self, scheduler_output):
            return SimMetadata(self.sim.meta())

        def update_connector_output(self, connector_output) -> None:
            self.sim.output(connector_output.finished_sending,
                            connector_output.finished_recving,
                            connector_output.invalid_block_ids)

        def request_finished(self, request, block_ids):
            return self.sim.finished(request.request_id, request.status.name, block_ids)

        def get_kv_connector_stats(self):
            self.sim.calls.append(["get_kv_connector_stats"])
            return None

        def take_events(self):
            return [BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[],
                                block_size=self.sim.block_size, lora_id=None,
                                medium="SIM", lora_name=None)
                    for _ in range(self.sim.events())]

    globals()["SimConnector"] = SimConnector
    return SimConnector


# ---------------------------------------------------------------------------
# The vLLM side.


def load_vllm(vllm_src: Path):
    """Import vLLM from its source tree with the CPU platform pinned."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if str(vllm_src) not in sys.path:
        sys.path.insert(0, str(vllm_src))
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
    import vllm  # noqa: F401
    return vllm


class VllmRun:
    """One run on vLLM's scheduler: builds it, drives vLLM's engine loop, logs events."""

    def __init__(self, config: dict, model_dir: Path) -> None:
        import torch
        from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                 SpeculativeConfig, VllmConfig)
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                                 resolve_kv_cache_block_sizes)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                                KVCacheGroupSpec, SlidingWindowSpec)
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = config
        bs = config["block_size"]
        model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                                   skip_tokenizer_init=True, dtype="float16",
                                   max_model_len=config["max_model_len"])
        spec = config["speculative"]
        speculative_config = None
        if spec:
            parallel = ParallelConfig()
            speculative_config = SpeculativeConfig(
                method="ngram", num_speculative_tokens=spec["num_speculative_tokens"],
                prompt_lookup_min=spec["prompt_lookup_min"],
                prompt_lookup_max=spec["prompt_lookup_max"],
                target_model_config=model_config, target_parallel_config=parallel)
        # Fields left out take vLLM's defaults: policy "fcfs", max_num_partial_prefills 1,
        # max_num_scheduled_tokens None (= max_num_batched_tokens), no LoRA, no connector.
        scheduler_config = SchedulerConfig(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_model_len=config["max_model_len"], is_encoder_decoder=False,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=config["long_prefill_token_threshold"],
            watermark=config["watermark"],
            scheduler_reserve_full_isl=config["scheduler_reserve_full_isl"],
            # Set below: validation refuses async scheduling with CPU n-gram drafts.
            async_scheduling=False)
        cache_config = CacheConfig(block_size=bs, enable_prefix_caching=True,
                                   prefix_caching_hash_algo="sha256")
        vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                                 scheduler_config=scheduler_config,
                                 parallel_config=ParallelConfig(),
                                 speculative_config=speculative_config)
        # The CPU platform turns these off while validating; the scheduler does not care.
        vllm_config.scheduler_config.async_scheduling = config["async_scheduling"]
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        self.conn_calls: list = []                 # the simulated connector's calls, in order
        self.kv_calls: list = []                   # the KV cache manager's, in order
        self.published: list = []                  # KV event batches the scheduler published
        connector = config.get("connector")
        if connector:
            from vllm.config import KVTransferConfig
            make_vllm_sim_connector()
            vllm_config.kv_transfer_config = KVTransferConfig(
                kv_connector="SimConnector", kv_connector_module_path="__main__",
                kv_role=connector["kv_role"], kv_load_failure_policy=connector["policy"],
                kv_connector_extra_config={"plans": connector["plans"], "block_size": bs,
                                           "calls": self.conn_calls})
            # A connector without SupportsHMA runs with the hybrid manager off.
            vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = True
        if config.get("enable_kv_cache_events"):
            from vllm.config import KVEventsConfig
            vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True,
                                                          publisher="null")
        groups = []
        for i, g in enumerate(config["groups"]):
            attn = dict(block_size=g.get("block_size", bs), num_kv_heads=1, head_size=64,
                        dtype=torch.float16)
            if g["kind"] == "full":
                kv_spec = FullAttentionSpec(**attn)
            else:
                kv_spec = SlidingWindowSpec(**attn, sliding_window=g["sliding_window"])
            groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"], kv_spec))
        kv_cache_config = KVCacheConfig(num_blocks=config["num_blocks"], kv_cache_tensors=[],
                                        kv_cache_groups=groups)
        vllm_config.cache_config.num_gpu_blocks = config["num_blocks"]
        # As EngineCore does: one group, its block size; several, their lcm and gcd.
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        if any("block_size" in g for g in config["groups"]):
            config["scheduler_block_size"], config["hash_block_size"] = sched_bs, hash_bs
        cls = AsyncScheduler if config["async_scheduling"] else Scheduler
        self.scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=StructuredOutputManager(vllm_config),
                             block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(hash_bs, sha256)
        self.worker = Worker(config)
        if connector:
            self._observe_connector_run()
        self.events: list[dict] = []
        self.num_schedules = 0
        self.num_idle = 0                          # iterations in a row with nothing going on

    def add_request(self, req_id: str, prompt: list[int], params: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        sp = SamplingParams(max_tokens=params["max_tokens"],
                            ignore_eos=params.get("ignore_eos", True),
                            min_tokens=params.get("min_tokens", 0),
                            stop_token_ids=params.get("stop_token_ids"))
        eos = self.config["eos_token_id"]
        if eos is not None:
            sp.update_from_generation_config({}, eos_token_id=eos)
        request = Request(req_id, list(prompt), sp, None, arrival_time=0.0,
                          block_hasher=self.block_hasher)
        self.scheduler.add_request(request)

    # -- a connector run: what else is observed ----------------------------------

    def _observe_connector_run(self) -> None:
        """Log the KV cache manager's calls and the published KV events too."""
        import inspect
        manager = self.scheduler.kv_cache_manager
        log = self.kv_calls

        def wrap(name, summarize):
            original = getattr(manager, name)
            signature = inspect.signature(original)

            def call(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                answer = original(*args, **kwargs)
                log.append(summarize(bound.arguments, answer))
                return answer
            setattr(manager, name, call)

        def ids(blocks):
            return None if blocks is None else [list(g) for g in blocks.get_block_ids()]
        wrap("get_computed_blocks", lambda a, r: ["hit", a["request"].request_id, r[1]])
        wrap("allocate_slots", lambda a, r: [
            "alloc", a["request"].request_id, a["num_new_tokens"], a["num_new_computed_tokens"],
            a["num_external_computed_tokens"], a["delay_cache_blocks"], a["reserved_blocks"],
            a["full_sequence_must_fit"], ids(r)])
        wrap("cache_blocks", lambda a, r: ["cache", a["request"].request_id,
                                           a["num_computed_tokens"]])
        wrap("evict_blocks", lambda a, r: ["evict", sorted(a["block_ids"])])
        wrap("pop_blocks_for_free", lambda a, r: ["pop", a["request"].request_id,
                                                  [b.block_id for b in r]])
        wrap("free", lambda a, r: ["free", a["request"].request_id])
        publisher = self.scheduler.kv_event_publisher
        publisher.publish = lambda batch: self.published.append(
            [summarize_kv_event(e) for e in batch.events])

    def _attach(self, event: dict) -> dict:
        """A connector run's event carries the calls made since the previous one."""
        if self.config.get("connector"):
            event["conn"], self.conn_calls[:] = list(self.conn_calls), []
            event["kv"], self.kv_calls[:] = list(self.kv_calls), []
            if event["op"] == "update":
                event["published"], self.published[:] = list(self.published), []
                event["status"] = {rid: r.status.name
                                   for rid, r in sorted(self.scheduler.requests.items())}
        return event

    def abort_if_stalled(self, first_event: int) -> None:
        """Abort what is left after STALL_STEPS engine iterations in a row in which
        nothing was scheduled, no transfer ended and none was in flight.
        ``first_event``: where this iteration's events start."""
        sim = self.scheduler.connector.sim
        busy = (sim.pending
                or any(e["op"] == "schedule" and e["tokens"] for e in self.events[first_event:])
                or any(c[0] == "update_connector_output" and (c[1] or c[2] or c[3])
                       for e in self.events[first_event:] for c in e["conn"]))
        self.num_idle = 0 if busy else self.num_idle + 1
        if self.num_idle < STALL_STEPS:
            return
        self.num_idle = 0
        from vllm.v1.request import RequestStatus
        sched = self.scheduler
        ids = sorted(r.request_id for r in [*sched.running, *sched.waiting,
                                            *getattr(sched, "skipped_waiting", [])])
        if not ids:
            return
        for rid in ids:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self.events.append(self._attach({"op": "abort", "step": self.num_schedules,
                                         "ids": ids}))

    # -- events --------------------------------------------------------------

    def _schedule(self):
        # The same observation as kvref/verify/scheduler_replay.py's, written
        # twice on purpose: the oracle imports nothing of kvref, so no kvref
        # change can alter what is recorded from vLLM.
        sched = self.scheduler
        out = sched.schedule()
        manager = sched.kv_cache_manager
        cached = out.scheduled_cached_reqs
        nc = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        for i, rid in enumerate(cached.req_ids):
            nc[rid] = cached.num_computed_tokens[i]
        event = {
            "op": "schedule", "step": self.num_schedules,
            "tokens": [[rid, n] for rid, n in out.num_scheduled_tokens.items()],
            "new": [r.req_id for r in out.scheduled_new_reqs],
            "resumed": sorted(cached.resumed_req_ids),
            "preempted": sorted(out.preempted_req_ids),
            "finished": sorted(out.finished_req_ids),
            "spec": {rid: list(t) for rid, t in out.scheduled_spec_decode_tokens.items()},
            "nc": nc,
            "blocks": {rid: [list(ids) for ids in manager.get_block_ids(rid)]
                       for rid in out.num_scheduled_tokens},
            "free": manager.block_pool.get_num_free_blocks(),
            "running": [r.request_id for r in sched.running],
            "waiting": [r.request_id for r in sched.waiting],
        }
        if self.config["async_scheduling"]:
            event["placeholders"] = {rid: sched.requests[rid].num_output_placeholders
                                     for rid in out.num_scheduled_tokens}
        self.events.append(self._attach(event))
        self.num_schedules += 1
        return out

    def _update(self, out, runner_output, step: int) -> None:
        sched = self.scheduler
        # Before the update: vLLM trims a stopped request's token list in place.
        sampled = {rid: list(runner_output.sampled_token_ids[i])
                   for i, rid in enumerate(runner_output.req_ids)
                   if runner_output.sampled_token_ids[i]}
        engine_outputs = sched.update_from_output(out, runner_output)
        finished = []
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished.append([o.request_id, str(o.finish_reason)])
        self.events.append(self._attach({
            "op": "update", "step": step,
            "sampled": sampled,
            "finished": finished,
            "free": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "running": [r.request_id for r in sched.running],
            "waiting": [r.request_id for r in sched.waiting],
        }))

    # -- the engine loops (vllm/v1/engine/core.py) ---------------------------

    def run(self, arrivals: list, max_iterations: int = 5000) -> None:
        pending = deque(sorted(arrivals, key=lambda a: a[0]))
        batch_queue: deque = deque()
        iteration = 0
        while pending or self.scheduler.has_requests() or batch_queue:
            if not (self.scheduler.has_requests() or batch_queue):
                iteration = max(iteration, pending[0][0])    # idle: jump to the next arrival
            while pending and pending[0][0] <= iteration:
                _, rid, prompt, params = pending.popleft()
                self.add_request(rid, prompt, params)
            first_event = len(self.events)
            if self.config["async_scheduling"]:
                self._step_with_batch_queue(batch_queue)
            else:
                self._step()
            if self.config.get("connector"):
                self.abort_if_stalled(first_event)
            iteration += 1
            if iteration > max_iterations:
                raise RuntimeError("the run did not finish")

    def _step(self) -> None:
        """EngineCore.step, then post_step's draft update."""
        from vllm.v1.outputs import DraftTokenIds
        if not self.scheduler.has_requests():
            return
        out = self._schedule()
        runner_output = self.worker.execute(out)
        self._update(out, runner_output, self.num_schedules - 1)
        if self.config["speculative"] and out.total_num_scheduled_tokens > 0:
            req_ids, drafts = self.worker.take_draft_token_ids()
            if req_ids:
                self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _step_with_batch_queue(self, batch_queue: deque) -> None:
        """EngineCore.step_with_batch_queue with max_concurrent_batches = 2."""
        sched = self.scheduler
        if sched.has_requests():
            out = self._schedule()
            # The worker runs steps in order; computing the output now is the same
            # as computing it on another thread before it is waited for.
            runner_output = self.worker.execute(out)
            model_executed = out.total_num_scheduled_tokens > 0
            batch_queue.appendleft((out, runner_output, self.num_schedules - 1))
            if len(batch_queue) < 2 and (model_executed or sched.has_requests()):
                return
        elif not batch_queue:
            return
        out, runner_output, step = batch_queue.pop()
        self._update(out, runner_output, step)


def summarize_kv_event(event) -> list:
    """A published KV cache event, as both sides can write it."""
    kind = type(event).__name__
    if kind == "BlockStored":
        return [kind, list(event.block_hashes), event.parent_block_hash, len(event.token_ids),
                event.block_size, event.medium, event.group_idx]
    if kind == "BlockRemoved":
        return [kind, list(event.block_hashes), event.medium, event.group_idx]
    return [kind]


def crc_token(tokens: list[int], vocab: int) -> int:
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return zlib.crc32(data) % vocab


class Worker:
    """The model runner's side, with a hash for a model (see the module docstring)."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.vocab = config["vocab_size"]
        self.async_scheduling = config["async_scheduling"]
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.num_prompt: dict[str, int] = {}
        self.transfers = SimTransfers() if config.get("connector") else None
        self.drafts: dict[str, list[int]] = {}       # proposed after the latest sample
        self.step_drafts: tuple[list[str], list[list[int]]] = ([], [])
        spec = config["speculative"]
        if spec:
            import numpy as np
            from vllm.v1.spec_decode.ngram_proposer import (
                _find_longest_matched_ngram_and_propose_tokens as find)
            self._np = np
            self._find = find

    def propose(self, tokens: list[int]) -> list[int]:
        spec = self.config["speculative"]
        if len(tokens) >= self.config["max_model_len"]:
            return []
        arr = self._np.array(tokens, dtype=self._np.int32)
        return [int(t) for t in self._find(arr, spec["prompt_lookup_min"],
                                           spec["prompt_lookup_max"],
                                           self.config["max_model_len"],
                                           spec["num_speculative_tokens"])]

    def execute(self, out):
        from vllm.v1.outputs import ModelRunnerOutput
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
            self.num_computed.pop(rid, None)
            self.drafts.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.num_prompt[new.req_id] = len(new.prompt_token_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.all_token_ids:
                known = list(cached.all_token_ids[rid])
                if known[:len(self.tokens[rid])] != self.tokens[rid][:len(known)]:
                    raise RuntimeError(f"{rid}: the scheduler's tokens disagree with the worker's")
                if len(known) > len(self.tokens[rid]):
                    self.tokens[rid] = known
            if not self.async_scheduling:
                # A token sampled over a failed synchronous KV load was dropped by the
                # scheduler: vLLM's runner trims its own copy to the scheduler's count
                # (gpu_model_runner.py:1383-1393).
                del self.tokens[rid][self.num_prompt[rid] + cached.num_output_tokens[i]:]
            sched_nc = cached.num_computed_tokens[i]
            if rid in cached.resumed_req_ids or not self.async_scheduling:
                self.num_computed[rid] = sched_nc
            elif sched_nc < self.num_computed[rid]:
                raise RuntimeError(f"{rid}: scheduler at {sched_nc}, worker at "
                                   f"{self.num_computed[rid]}")
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            n = out.num_scheduled_tokens[rid]
            tokens = self.tokens[rid]
            start = self.num_computed[rid]
            draft = list(out.scheduled_spec_decode_tokens.get(rid, ()))
            if self.async_scheduling and draft:
                mine = self.drafts.get(rid, [])[:len(draft)]
                draft = mine + [-1] * (len(draft) - len(mine))
            known = n - len(draft)
            if start + known > len(tokens) or (draft and start + known != len(tokens)):
                raise RuntimeError(f"{rid}: {n} tokens ({len(draft)} drafts) from {start}, "
                                   f"{len(tokens)} known")
            result: list[int] = []
            if start + known >= len(tokens):
                for j in range(len(draft) + 1):
                    target = crc_token(tokens + draft[:j], self.vocab)
                    result.append(target)
                    if j == len(draft) or target != draft[j]:
                        break
            num_rejected = len(draft) - (len(result) - 1) if result else 0
            tokens.extend(result)
            self.num_computed[rid] = start + n - num_rejected
            sampled.append(result)
        drafts = []
        if self.config["speculative"]:
            for rid, result in zip(req_ids, sampled):
                draft = self.propose(self.tokens[rid]) if result else []
                if result:
                    self.drafts[rid] = draft
                drafts.append(draft)
        self.step_drafts = (req_ids, drafts)
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=[list(s) for s in sampled])
        if self.transfers is not None:
            from vllm.v1.outputs import KVConnectorOutput
            sending, recving, invalid = self.transfers.step(out.kv_connector_metadata.meta)
            kv_output = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                          invalid_block_ids=invalid)
            # vLLM's runner: a step without a forward reports only what ended
            # (ModelRunnerOutput.with_kv_conn_output_only, vllm/v1/outputs.py:284-294).
            if out.total_num_scheduled_tokens > 0 or not kv_output.is_empty():
                output.kv_connector_output = kv_output
        return output

    def take_draft_token_ids(self):
        drafts, self.step_drafts = self.step_drafts, ([], [])
        return drafts


# ---------------------------------------------------------------------------


def vllm_llm_defaults(model_dir: Path, max_model_len: int, enable_chunked_prefill: bool = True,
                      max_num_batched_tokens: int | None = None,
                      max_num_seqs: int | None = None) -> tuple[int, int]:
    """What vLLM's EngineArgs makes of the batch limits for ``vllm.LLM`` (usage
    context LLM_CLASS) on this platform (CPU), for values left out (None)."""
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir),
                               skip_tokenizer_init=True, dtype="float16",
                               max_model_len=max_model_len)
    args = EngineArgs(model=str(model_dir), max_model_len=max_model_len,
                      enable_chunked_prefill=enable_chunked_prefill,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    args._set_default_max_num_seqs_and_batched_tokens_args(UsageContext.LLM_CLASS,
                                                           model_config, ParallelConfig())
    return args.max_num_batched_tokens, args.max_num_seqs


# (max_model_len, enable_chunked_prefill, max_num_batched_tokens, max_num_seqs) given
# to vllm.LLM, None for a value left to vLLM; the trace stores what vLLM made of them.
DEFAULTS_GRID = [(64, True, None, None), (8, True, None, None), (4096, True, None, None),
                 (64, False, None, None), (3000, False, None, None), (64, True, None, 2),
                 (64, True, None, 4), (64, True, 100, None), (8, True, 16, None)]


def record_run(run: dict, model_dir: Path) -> dict:
    config = run["config"]
    if config["max_num_batched_tokens"] is None or config["max_num_seqs"] is None:
        config["max_num_batched_tokens"], config["max_num_seqs"] = vllm_llm_defaults(
            model_dir, config["max_model_len"], True, config["max_num_batched_tokens"],
            config["max_num_seqs"])
        config["llm_defaults"] = True
    vr = VllmRun(run["config"], model_dir)
    vr.run(run["arrivals"])
    return {"config": run["config"], "arrivals": run["arrivals"], "events": vr.events}


def summarize(runs: list[dict]) -> dict:
    steps = sum(1 for r in runs for e in r["events"] if e["op"] == "schedule")
    preempted = sum(len(e["preempted"]) for r in runs for e in r["events"]
                    if e["op"] == "schedule")
    spec = sum(len(t) for r in runs for e in r["events"] if e["op"] == "schedule"
               for t in e["spec"].values())
    return {"runs": len(runs), "steps": steps, "preemptions": preempted,
            "spec_tokens_scheduled": spec}


def main(argv=None) -> int:
    if os.environ.get("PYTHONHASHSEED") is None:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, default=DEFAULT_SRC,
                        help="folder holding vLLM 0.25.1's vllm/ package")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="folder with the tiny Llama config.json (no weights)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--profile", action="append",
                        help="record only these profiles (repeatable)")
    parser.add_argument("--runs", type=int, help="override the runs per profile")
    args = parser.parse_args(argv)

    vllm = load_vllm(args.vllm_src)
    if vllm.__version__ != "0.25.1" and not vllm.__version__.startswith("0.25.1"):
        print(f"warning: recording vLLM {vllm.__version__}, not 0.25.1", file=sys.stderr)
    names = args.profile or list(FIXED_RUNS) + list(PROFILES)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name in FIXED_RUNS:
            runs = [record_run(FIXED_RUNS[name], args.model_dir)]
            recipe = {"fixed": True}
        elif name in PROFILES:
            profile = PROFILES[name]
            num = args.runs or profile["runs"]
            seeds = [zlib.crc32(f"{name}/{i}".encode()) for i in range(num)]
            runs = [record_run(draw_run(profile, seed), args.model_dir) for seed in seeds]
            for run, seed in zip(runs, seeds):
                run["seed"] = seed
            recipe = profile
        else:
            known = sorted(FIXED_RUNS) + sorted(PROFILES)
            parser.error(f"unknown profile {name!r} (known: {', '.join(known)})")
        doc = {"format": FORMAT, "vllm_version": vllm.__version__, "profile": name,
               "recipe": recipe, "pythonhashseed": os.environ["PYTHONHASHSEED"],
               "summary": summarize(runs), "runs": runs}
        if recipe.get("llm_defaults"):
            doc["llm_defaults_grid"] = [
                [*given, *vllm_llm_defaults(args.model_dir, *given)] for given in DEFAULTS_GRID]
        path = args.out / f"{name}.json.gz"
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        print(f"{name}: {doc['summary']} -> {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
