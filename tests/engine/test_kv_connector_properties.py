"""Drawn workloads through a connector whose loads land late, fail, or hit partly.

The connector is the CPU offload tier with faults injected by a drawn plan
(``FaultPlan``): each load lands 0-3 steps late, or at once (synchronous), and
may fail from some block on, in which case the blocks it could not bring are
filled with garbage and reported (the scheduler must not trust them). A small
device pool makes requests preempt and blocks leave the device; a small host
tier makes hits partial; between turns the device cache may be reset, so the
next turn's hits come from the host. Whatever is drawn:

- every request's greedy tokens equal the engine without a connector
  ("recompute"), or it finishes with an error and no tokens ("fail");
- after every step the manager's invariants hold and each request is in one
  queue; at the end every block is free and no host slot is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector)
from kvref.engine import LLM, SamplingParams

from .hf_models import llama
from .test_kv_connectors import assert_all_blocks_free, check_scheduler
from .test_llm import shared_prefix_prompts

OPTIONS = dict(block_size=4, max_model_len=40, max_num_batched_tokens=16)


@dataclass
class FaultPlan:
    """What happens to the n-th load: ``delays[n]`` steps late, fails from block
    ``fail_from[n]`` on (None: lands whole). Lists are cycled."""

    synchronous: bool = False
    delays: list[int] = field(default_factory=lambda: [0])
    fail_from: list[int | None] = field(default_factory=lambda: [None])
    num_loads: int = 0
    num_failed_loads: int = 0

    def next_load(self) -> tuple[int, int | None]:
        n = self.num_loads
        self.num_loads += 1
        return self.delays[n % len(self.delays)], self.fail_from[n % len(self.fail_from)]


class FaultyOffloadConnector(SimpleCPUOffloadConnector):
    """The CPU tier, with the loads ``kv_connector_extra_config["plan"]`` dictates.

    A load event (one per step, all the step's loads) is found done ``delay``
    polls after its launch; a failing one is copied, then its blocks from
    ``fail_from`` on are overwritten with garbage and reported at once. A
    synchronous plan copies before the forward and ends the load after its step.
    """

    def __init__(self, kv_transfer_config, role, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        self.plan: FaultPlan = kv_transfer_config.get_from_extra_config("plan", FaultPlan())
        self._delays: dict[int, int] = {}
        self._invalid: set[int] = set()
        self._sync_loads_per_step: list[list[str]] = []
        self._local_hit: dict[str, int] = {}

    # scheduler side: synchronous loads end after their step
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._local_hit[request.request_id] = num_computed_tokens
        return n, load_async and not self.plan.synchronous

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if self.plan.synchronous and num_external_tokens:
            # The tier finds where the load starts from the blocks still unhashed;
            # a synchronous load's are hashed at once (no delay_cache_blocks), so it
            # is shown only the local hit's.
            num_local = self._local_hit[request.request_id] // self.block_size
            shown = SimpleNamespace(blocks=tuple(g[:num_local] for g in blocks.blocks),
                                    get_block_ids=blocks.get_block_ids)
            return super().update_state_after_alloc(request, shown, num_external_tokens)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        if self.plan.synchronous:
            self._sync_loads_per_step.append(list(self._load_event_to_reqs.get(
                meta.load_event, ())))
        return meta

    def update_connector_output(self, connector_output):
        # A host copy that failed to load is dropped from the host cache, so the
        # retry computes it (vLLM's tier never reports a failed load; without this
        # a plan failing every load would retry forever).
        bad = connector_output.invalid_block_ids
        for load in self._reqs_to_load.values():
            self.cpu_block_pool.evict_blocks({c for g, c in zip(load.gpu_block_ids,
                                                                load.cpu_block_ids) if g in bad})
        super().update_connector_output(connector_output)
        if self.plan.synchronous and self._sync_loads_per_step:
            for req_id in self._sync_loads_per_step.pop(0):
                self._end_load(req_id)

    # worker side: loads land late, or break
    def start_load_kv(self, **kwargs):
        meta = self._get_connector_metadata()
        if self.plan.synchronous and meta.load_cpu_blocks:
            self._copy("load", meta.load_cpu_blocks, meta.load_gpu_blocks)
            self._pending_load_events.discard(meta.load_event)
            meta.load_cpu_blocks, meta.load_gpu_blocks = [], []   # nothing left to launch

    def _copy_latency(self, kind, event):
        return self._delays.pop(event, 1) if kind == "load" else 1

    def _copy(self, kind, src, dst):
        super()._copy(kind, src, dst)
        if kind != "load":
            return
        delay, fail_from = self.plan.next_load()
        self._delays[self._get_connector_metadata().load_event] = delay
        if fail_from is not None and fail_from < len(dst):
            for cache in self.kv_caches.values():
                for block_id in dst[fail_from:]:
                    cache[block_id] = torch.randn_like(cache[block_id]) * 100   # garbage
            self._invalid.update(dst[fail_from:])
            self.plan.num_failed_loads += 1

    def get_block_ids_with_load_errors(self):
        errors, self._invalid = self._invalid, set()
        return errors


def assert_host_pool_released(llm: LLM) -> None:
    """No load in flight, no host block held by a load or a lookup."""
    tier = llm.scheduler.connector
    assert not tier._reqs_to_load and not tier._pending_hits
    held = [b.block_id for b in tier.cpu_block_pool.blocks[1:] if b.ref_cnt]
    assert not held, f"host blocks still held: {held}"


class StepLimit:
    """An ``after_step`` hook: a request that can never progress fails the test, not hangs it."""

    def __init__(self, limit: int) -> None:
        self.limit, self.steps = limit, 0

    def __call__(self, llm: LLM) -> None:
        self.steps += 1
        assert self.steps <= self.limit, f"no end after {self.limit} steps: a request is stuck"


KVConnectorFactory.register_connector("FaultyOffloadConnector", FaultyOffloadConnector.__module__,
                                      "FaultyOffloadConnector")


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.fixture(scope="module")
def reference(model):
    """Greedy tokens of one prompt alone, without a connector (memoised)."""
    plain = LLM(model, num_gpu_blocks=40, **OPTIONS)
    cache: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            [out] = plain.generate([prompt], SamplingParams(max_tokens=max_tokens))
            cache[key] = out.outputs[0].token_ids
        return cache[key]
    return tokens


@pytest.fixture(scope="module")
def block_bytes(model):
    """One block of every layer: the tier is sized in bytes (``cpu_bytes_to_use``)."""
    groups = LLM(model, num_gpu_blocks=40, **OPTIONS).kv_cache_config.kv_cache_groups
    return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)


POOL = shared_prefix_prompts(96)


@st.composite
def workloads(draw):
    turns = draw(st.lists(st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=6),
                          min_size=1, max_size=4))
    plan = FaultPlan(
        synchronous=draw(st.booleans()),
        delays=draw(st.lists(st.integers(0, 3), min_size=1, max_size=4)),
        fail_from=draw(st.lists(st.one_of(st.none(), st.just(0), st.integers(0, 2)),
                                min_size=1, max_size=4)))
    forget = draw(st.lists(st.booleans(), min_size=len(turns), max_size=len(turns)))
    # A last turn repeats the first on a forgotten device cache: the host must serve it.
    turns.append(turns[0])
    forget.append(True)
    return dict(turns=[[POOL[i] for i in turn] for turn in turns], plan=plan, forget=forget,
                max_tokens=draw(st.integers(1, 4)),
                num_gpu_blocks=draw(st.integers(11, 18)),
                num_cpu_blocks=draw(st.integers(4, 32)),
                policy=draw(st.sampled_from(["recompute", "fail"])))


@settings(max_examples=40, deadline=None)
@given(workload=workloads())
def test_drawn_workloads_keep_tokens_and_invariants(model, reference, block_bytes, workload):
    plan: FaultPlan = workload["plan"]
    config = KVTransferConfig(
        kv_connector="FaultyOffloadConnector", kv_role="kv_both",
        kv_load_failure_policy=workload["policy"],
        kv_connector_extra_config={"cpu_bytes_to_use": workload["num_cpu_blocks"] * block_bytes,
                                   "plan": plan})
    llm = LLM(model, kv_transfer_config=config, num_gpu_blocks=workload["num_gpu_blocks"],
              **OPTIONS)
    llm.after_step.append(check_scheduler)
    llm.after_step.append(StepLimit(400))
    params = SamplingParams(max_tokens=workload["max_tokens"])
    for prompts, forget in zip(workload["turns"], workload["forget"]):
        # One turn after another, as a chat would; the device cache may forget in
        # between (then the turn's hits can only come from the host tier).
        if forget:
            assert llm.kv_cache_manager.reset_prefix_cache()
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            completion = out.outputs[0]
            if completion.finish_reason == "error":
                assert workload["policy"] == "fail"
                assert completion.token_ids == []
            else:
                assert completion.token_ids == reference(prompt, workload["max_tokens"])
    if plan.num_failed_loads == 0:
        assert llm.stats.num_kv_load_failures == 0
    assert_all_blocks_free(llm)
    assert_host_pool_released(llm)


def test_the_drawn_plans_do_fail_loads_and_land_them_late(model, block_bytes):
    """The property above is not vacuous: a plan with late and failing loads
    makes the scheduler see failures and requests wait for their KV."""
    plan = FaultPlan(delays=[2], fail_from=[1])
    config = KVTransferConfig(kv_connector="FaultyOffloadConnector", kv_role="kv_both",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"cpu_bytes_to_use": 32 * block_bytes,
                                                         "plan": plan})
    llm = LLM(model, kv_transfer_config=config, num_gpu_blocks=20, **OPTIONS)
    waited = []
    llm.after_step.append(lambda e: waited.append(len(e.scheduler.skipped_waiting)))
    prompts = POOL[:4]
    llm.generate(prompts, SamplingParams(max_tokens=2))
    assert llm.kv_cache_manager.reset_prefix_cache()
    llm.generate(prompts, SamplingParams(max_tokens=2))
    assert plan.num_loads > 0 and plan.num_failed_loads > 0
    assert llm.stats.num_kv_load_failures > 0
    assert max(waited) > 0
