"""Hybrid models through each KV connector, as vLLM 0.25.1 runs them.

A Qwen3 with full-attention and sliding-window layers (``hf_models.hybrid``)
goes through every connector kvref has, synchronous and async scheduling,
and must generate the same greedy tokens as the same engine without a
connector, while the connector brings KV it did not compute. How the engine is built depends on the connector, as
in vLLM (``config/vllm.py:1530-1567``, ``kv_connector/factory.py:54-60,
130-145``):

* with ``SupportsHMA`` (``P2pConnector``): the hybrid KV cache manager and its
  two groups are kept; block ids go to the connector per group, and a finished
  request goes to ``request_finished_all_groups``;
  (the prompts avoid lengths P with ``(P - W + 1) % block_size == 0``, where
  vLLM's consumer, and kvref's, recomputes the last prompt token over a null
  block: see the last test);
* without it (``ExampleConnector``): vLLM's warning, the hybrid manager off,
  the window layers in the full-attention group as
  ``FullAttentionSpec(sliding_window=W)``; asking for the hybrid manager
  explicitly is refused.

The engine runs no Mamba model (its layers are attention only; lesson 08
runs Mamba states below the engine), so the Mamba hybrid's per-group hit path
(``scheduler.py:689-722``) is checked on the scheduler with the model-free
runner, and its failure to start with a connector without ``SupportsHMA``
on the config builder.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, MambaSpec,
                   SlidingWindowSpec)
from kvref.core.kv_cache_utils import capacity_config, get_kv_cache_groups
from kvref.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory, KVTransferConfig, resolve_disable_hybrid_kv_cache_manager)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorOutput, SupportsHMA, supports_hma)
from kvref.engine import LLM, SamplingParams
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.sched.scheduler import Scheduler
from kvref.math_utils import cdiv

from .hf_models import hybrid
from .test_disaggregated_prefill import PrefillEngine, free_port, run_to_end
from .test_kv_connectors import assert_all_blocks_free, check_scheduler
from .test_llm import shared_prefix_prompts

BLOCK = 4
WINDOW = 5
OPTIONS = dict(block_size=BLOCK, max_model_len=64, max_num_batched_tokens=24)
PARAMS = SamplingParams(max_tokens=6)
WARNING = ("Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV "
           "connector that does not support it.")                 # vLLM's own words
HEADS = dict(num_kv_heads=2, head_size=8, dtype="float32")     # hf_models.hybrid's


@pytest.fixture(scope="module")
def model():
    return hybrid(window=WINDOW)


@pytest.fixture(scope="module")
def prompts(model):
    return shared_prefix_prompts(model.config.vocab_size)


@pytest.fixture(scope="module")
def reference(model, prompts):
    llm = LLM(model, num_gpu_blocks=160, **OPTIONS)
    assert len(llm.kv_cache_config.kv_cache_groups) == 2      # the hybrid manager is on
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def connected(model, config: KVTransferConfig, **kwargs) -> LLM:
    llm = LLM(model, kv_transfer_config=config, **{**OPTIONS, **kwargs})
    llm.after_step.append(check_scheduler)
    return llm


def assert_groups_as_vllm_builds_them(llm: LLM, config: KVTransferConfig) -> None:
    """Two groups (full, window) with SupportsHMA; otherwise one, the window layers
    in it as full attention that remembers its window."""
    groups = llm.kv_cache_config.kv_cache_groups
    if KVConnectorFactory.supports_hma_config(config):
        assert not llm.disable_hybrid_kv_cache_manager
        assert [type(g.kv_cache_spec) for g in groups] == [FullAttentionSpec, SlidingWindowSpec]
        assert groups[1].kv_cache_spec.sliding_window == WINDOW
    else:
        assert llm.disable_hybrid_kv_cache_manager
        (group,) = groups
        assert type(group.kv_cache_spec) is FullAttentionSpec
        assert group.kv_cache_spec.sliding_window == WINDOW
        assert len(group.layer_names) == llm.model.config.num_hidden_layers


# -- each connector, token-equal -------------------------------------------------------


def run_example_connector(model, prompts, reference, tmp_path, **engine) -> LLM:
    """A first engine saves every block to storage; a second one loads them."""
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    first = connected(model, config, num_gpu_blocks=160, **engine)
    assert tokens(first.generate(prompts, PARAMS)) == reference
    second = connected(model, config, num_gpu_blocks=160, **engine)
    assert tokens(second.generate(prompts, PARAMS)) == reference
    assert second.model_runner.kv_connector.stats.num_loaded_blocks > 0
    return second


def run_cpu_tier(model, prompts, reference, tmp_path, **engine) -> LLM:
    """A small device pool: blocks evicted there come back from the host tier."""
    groups = LLM(model, num_gpu_blocks=160, **OPTIONS).kv_cache_config.kv_cache_groups
    block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    config = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 96 * block_bytes})
    # Small: evicts (two groups: a whole request takes 24 blocks of both together).
    llm = connected(model, config, num_gpu_blocks=30, **engine)
    assert tokens(llm.generate(prompts + prompts, PARAMS)) == reference * 2
    assert llm.model_runner.kv_connector.stats.num_loaded_blocks > 0
    return llm


def run_p2p(model, prompts, reference, tmp_path, **engine) -> LLM:
    """A prefill engine in another process pushes each prompt's KV to this one."""
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    port = free_port()
    prefill = PrefillEngine(model_dir, prompts, port, tmp_path)
    try:
        config = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer",
                                  kv_load_failure_policy="recompute",
                                  kv_connector_extra_config={"p2p_port": port,
                                                             "timeout_s": 60})
        llm = LLM(str(model_dir), kv_transfer_config=config, block_size=BLOCK,
                  max_model_len=64, num_gpu_blocks=80, **engine)
        llm.after_step.append(check_scheduler)
        allocated = {}
        admit = llm.scheduler.connector.update_state_after_alloc

        def spy(request, blocks, num_external_tokens):
            allocated[request.request_id] = blocks.get_block_ids()
            return admit(request, blocks, num_external_tokens)

        llm.scheduler.connector.update_state_after_alloc = spy
        params = SamplingParams(max_tokens=PARAMS.max_tokens, extra_args={
            "kv_transfer_params": {"do_remote_prefill": True}})
        for i, prompt in enumerate(prompts):
            llm.add_request(prompt, params, request_id=str(i))
        outputs: dict = {}
        run_to_end(llm, outputs, time.monotonic() + 120)
        assert [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))] \
            == reference
        # Each prompt's KV came from the prefill engine; only its last token ran here.
        assert llm.stats.prompt_tokens_computed == len(prompts)
        assert llm.stats.prompt_tokens_external == sum(len(p) - 1 for p in prompts)
        for i, prompt in enumerate(prompts):
            # Per group: the window group's blocks before the window are the null
            # block from admission on (the load lands only in the others).
            full, window = allocated[str(i)]
            num_null = max(0, len(prompt) - WINDOW + 1) // BLOCK
            assert len(full) == len(window) == cdiv(len(prompt), BLOCK) and 0 not in full
            assert window[:num_null] == [0] * num_null and 0 not in window[num_null:]
            # Prompts where that null block is the recomputed token's oldest window
            # token would attend to it (the defect named at the end of this file).
            assert (len(prompt) - WINDOW + 1) % BLOCK != 0
        assert any(0 in window for _, window in allocated.values())
        firsts = {line["request_id"]: line["token_ids"] for line in prefill.finish()}
        assert [firsts[str(i)] for i in range(len(prompts))] == \
            [r[:1] for r in reference]
        return llm
    finally:
        prefill.kill()


RUNS = {"ExampleConnector": run_example_connector,
        "SimpleCPUOffloadConnector": run_cpu_tier,
        "P2pConnector": run_p2p}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("connector", sorted(RUNS))
def test_a_hybrid_model_through_each_connector_equals_the_engine_without_one(
        connector, async_scheduling, model, prompts, reference, tmp_path, caplog):
    if connector == "P2pConnector":
        prompts, reference = prompts[:6], reference[:6]    # two processes: keep it short
    with caplog.at_level(logging.WARNING):
        llm = RUNS[connector](model, prompts, reference, tmp_path,
                              async_scheduling=async_scheduling)
    config = llm.scheduler.connector._kv_transfer_config
    assert_groups_as_vllm_builds_them(llm, config)
    # vLLM's warning exactly when the hybrid manager was turned off for the connector.
    assert (WARNING in caplog.text) == (not supports_hma(llm.scheduler.connector))
    assert llm.stats.prompt_tokens_external > 0
    # Async scheduling: a consumer's freed blocks wait for the step in flight, in
    # every group (deferred frees).
    assert llm.scheduler.defer_block_free == (async_scheduling
                                              and llm.scheduler.kv_consumer)
    assert_all_blocks_free(llm)


# -- the configuration, as vLLM decides it ---------------------------------------------


def example_config(tmp_path) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": str(tmp_path)})


def test_left_unset_the_hybrid_manager_is_off_only_for_a_connector_without_supports_hma(
        tmp_path, caplog):
    p2p = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer")
    with caplog.at_level(logging.WARNING):
        assert resolve_disable_hybrid_kv_cache_manager(None, None) is False
        assert resolve_disable_hybrid_kv_cache_manager(p2p, None) is False
        assert WARNING not in caplog.text
        assert resolve_disable_hybrid_kv_cache_manager(example_config(tmp_path), None) is True
        assert WARNING in caplog.text and "ExampleConnector" in caplog.text
        caplog.clear()
        # A value given is kept, with no warning (vLLM: "always respect it").
        assert resolve_disable_hybrid_kv_cache_manager(example_config(tmp_path), True) is True
        assert resolve_disable_hybrid_kv_cache_manager(p2p, True) is True
        assert resolve_disable_hybrid_kv_cache_manager(None, True) is True
        assert WARNING not in caplog.text
    assert KVConnectorFactory.supports_hma_config(p2p)
    assert not KVConnectorFactory.supports_hma_config(example_config(tmp_path))


@pytest.mark.parametrize("hybrid_model", [True, False])
def test_an_explicit_enable_with_a_connector_without_supports_hma_is_refused(
        model, hybrid_model, tmp_path):
    from .hf_models import llama
    # vLLM's factory refuses it whatever the model (factory.py:54-60).
    with pytest.raises(ValueError, match="ExampleConnector does not support the hybrid KV "
                                         "cache manager"):
        LLM(model if hybrid_model else llama(), kv_transfer_config=example_config(tmp_path),
            disable_hybrid_kv_cache_manager=False, num_gpu_blocks=80, **OPTIONS)


def test_with_the_manager_off_window_layers_join_the_full_group_and_keep_their_window(
        model, tmp_path):
    llm = LLM(model, kv_transfer_config=example_config(tmp_path), num_gpu_blocks=80, **OPTIONS)
    (group,) = llm.kv_cache_config.kv_cache_groups
    # The same group vLLM's builder makes from the layers' own specs.
    specs = {f"model.layers.{i}.self_attn.attn":
             FullAttentionSpec(BLOCK, **HEADS) if t == "full_attention" else
             SlidingWindowSpec(BLOCK, WINDOW, **HEADS)
             for i, t in enumerate(model.config.layer_types)}
    (expected,) = get_kv_cache_groups(capacity_config(64, disable_hybrid_kv_cache_manager=True),
                                      specs)
    assert sorted(group.layer_names) == sorted(expected.layer_names)
    assert group.kv_cache_spec == expected.kv_cache_spec
    assert group.kv_cache_spec == FullAttentionSpec(BLOCK, **HEADS, sliding_window=WINDOW)
    # Every block is kept (a full-attention manager), but each layer attends over its
    # own window: the runner plans window layers with it, full layers without.
    runner = llm.model_runner
    assert runner.layer_windows == [None if t == "full_attention" else WINDOW
                                    for t in model.config.layer_types]
    seen = []
    forward = runner.model.forward

    def spy(input_ids, positions, kv_caches, attn_metadata):
        seen.append([m.plan.sliding_window for m in attn_metadata])
        return forward(input_ids, positions, kv_caches, attn_metadata)

    runner.model.forward = spy
    llm.generate([list(range(20))], SamplingParams(max_tokens=2))
    assert seen and all(windows == runner.layer_windows for windows in seen)


def test_a_mamba_hybrid_cannot_be_unified_so_needs_a_connector_with_supports_hma():
    # vLLM's warning says so: with the manager off, unify_hybrid_kv_cache_specs fails.
    specs = {"attn": FullAttentionSpec(BLOCK, **HEADS),
             "mamba": MambaSpec(BLOCK, shapes=((8,),), dtypes=("float32",))}
    with pytest.raises(ValueError, match="failed to convert"):
        get_kv_cache_groups(capacity_config(64, disable_hybrid_kv_cache_manager=True), specs)


# -- what a connector is given, per group ----------------------------------------------


class RecordingConnector(KVConnectorBase_V1):
    """Loads nothing; records the block ids the scheduler hands it."""

    def __init__(self, kv_transfer_config, role, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        self.matched: list[tuple[str, int]] = []          # (req, local hit) asked
        self.allocated: dict[str, tuple[list[int], ...]] = {}
        self.finished: dict[str, Any] = {}
        self.finished_single: dict[str, list[int]] = {}
        self.external = kv_transfer_config.get_from_extra_config("external", {})

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.matched.append((request.request_id, num_computed_tokens))
        return self.external.get(request.request_id, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocated[request.request_id] = blocks.get_block_ids()

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        self.finished_single[request.request_id] = list(block_ids)
        return False, None

    def start_load_kv(self, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class RecordingHMAConnector(RecordingConnector, SupportsHMA):
    def request_finished_all_groups(self, request, block_ids):
        self.finished[request.request_id] = tuple(list(ids) for ids in block_ids)
        return False, None


for _cls in (RecordingConnector, RecordingHMAConnector):
    KVConnectorFactory.register_connector(_cls.__name__, _cls.__module__, _cls.__name__)


def test_a_connector_with_supports_hma_gets_block_ids_per_group(model, prompts, reference):
    llm = LLM(model, num_gpu_blocks=160, **OPTIONS, kv_transfer_config=KVTransferConfig(
        kv_connector="RecordingHMAConnector", kv_role="kv_both"))
    manager = llm.kv_cache_manager
    connector = llm.scheduler.connector
    at_finish = {}
    original = connector.request_finished_all_groups

    def spy(request, block_ids):
        # What the manager holds then: the window group's blocks out of the window
        # are already the null block (remove_skipped_blocks ran first).
        at_finish[request.request_id] = manager.get_block_ids(request.request_id)
        return original(request, block_ids)

    connector.request_finished_all_groups = spy
    outputs = llm.generate(prompts, PARAMS)
    assert tokens(outputs) == reference
    assert not connector.finished_single               # request_finished is never called
    assert sorted(connector.finished) == sorted(o.request_id for o in outputs)
    for out in outputs:
        req_id = out.request_id
        full, window = connector.finished[req_id]
        num_computed = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        num_blocks = cdiv(num_computed, BLOCK)
        # Each group's blocks of the computed tokens; nulls exactly where the window
        # has moved past (skipped tokens: num_computed - W + 1, vLLM's rule).
        assert (full, window) == tuple(ids[:num_blocks] for ids in at_finish[req_id])
        assert len(full) == len(window) == num_blocks and 0 not in full
        num_null = max(0, num_computed - WINDOW + 1) // BLOCK
        assert window[:num_null] == [0] * num_null and 0 not in window[num_null:]
        # At admission, the whole table of both groups (nothing skipped yet here).
        assert len(connector.allocated[req_id]) == 2


def test_a_connector_without_supports_hma_gets_one_group(model, prompts, reference):
    llm = LLM(model, num_gpu_blocks=160, **OPTIONS, kv_transfer_config=KVTransferConfig(
        kv_connector="RecordingConnector", kv_role="kv_both"))
    connector = llm.scheduler.connector
    outputs = llm.generate(prompts, PARAMS)
    assert tokens(outputs) == reference
    assert not connector.finished
    for out in outputs:
        assert len(connector.allocated[out.request_id]) == 1
        assert 0 not in connector.finished_single[out.request_id]   # nothing skipped


# -- the scheduler's Mamba-hybrid path and its one-group limit ------------------------


def mamba_hybrid_scheduler(connector: str, **extra) -> Scheduler:
    config = KVCacheConfig(60, [
        KVCacheGroupSpec(["attn"], FullAttentionSpec(BLOCK, **HEADS)),
        KVCacheGroupSpec(["mamba"], MambaSpec(BLOCK, shapes=((8,),), dtypes=("float32",),
                                              mamba_cache_mode="all"))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, log_stats=True)
    return Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4,
                     kv_transfer_config=KVTransferConfig(
                         kv_connector=connector, kv_role="kv_both",
                         kv_connector_extra_config=extra))


def test_a_mamba_hybrid_hands_the_connector_the_longest_group_hit():
    """vLLM's scheduler.py:689-722: with a connector, a Mamba hybrid's local hit is
    each group's own, and the connector is asked from the longest (here full
    attention's), not from the hit all groups agree on. vLLM 0.25.1's own
    ``Scheduler``, given the same calls (``tools/check_vllm_hybrid_connector.py``),
    asks its connector from 12, schedules 2 tokens and holds the same blocks."""
    from kvref import Request
    scheduler = mamba_hybrid_scheduler("RecordingHMAConnector")
    manager = scheduler.kv_cache_manager
    prefix = list(range(1, 13))                          # 12 tokens: 3 blocks
    # "a" computed its 14 tokens, cached its 3 full blocks in both groups, and left.
    a = Request("a", prefix + [40, 41], block_hasher=scheduler.block_hasher)
    assert manager.allocate_slots(a, 14) is not None
    manager.cache_blocks(a, 14)
    a.num_computed_tokens = 14
    manager.free(a)
    # Drop the Mamba states: full attention still hits 12 tokens, Mamba none.
    manager.evict_blocks({b.block_id for b in manager.block_pool.blocks
                          if b.block_hash is not None and b.block_hash[-1] == 1})
    request = scheduler.new_request("b", prefix + [42, 43], SamplingParams(max_tokens=1))
    agreed = manager.coordinator.find_longest_cache_hit(request.block_hashes,
                                                        request.num_tokens - 1)[1]
    per_group = manager.coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1)[1]
    assert agreed == 0 and per_group == (12, 0)
    hits_before = manager.prefix_cache_stats.hits
    output = scheduler.schedule()
    assert scheduler.connector.matched == [("b", 12)]
    assert output.num_scheduled_tokens == {"b": 2}        # from token 12 on
    assert manager.prefix_cache_stats.hits - hits_before == 12
    assert manager.get_block_ids("b") == ([1, 2, 3, 8], [0, 0, 4, 9])   # vLLM's too


def test_the_longest_group_hit_is_only_for_mamba_hybrids_with_a_connector(model):
    # A window hybrid with a connector asks from the hit all groups agree on.
    llm = LLM(model, num_gpu_blocks=160, **OPTIONS, kv_transfer_config=KVTransferConfig(
        kv_connector="RecordingHMAConnector", kv_role="kv_both"))
    manager = llm.kv_cache_manager
    prompt = list(range(1, 20))
    llm.generate([prompt], SamplingParams(max_tokens=1))
    # Drop the window group's last cached block: full attention hits 16 tokens, the
    # window 12 (it needs the block before the hit), so the groups agree on 12.
    request = llm.scheduler.new_request("probe", prompt + [30], SamplingParams(max_tokens=1))
    llm.scheduler.finish_requests("probe")
    (_, window_blocks), _ = manager.coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1)
    manager.evict_blocks({window_blocks[-1].block_id})
    assert manager.coordinator.find_longest_cache_hit_per_group(
        request.block_hashes, request.num_tokens - 1)[1] == (16, 12)
    llm.generate([prompt + [30]], SamplingParams(max_tokens=1))
    assert [n for _, n in llm.scheduler.connector.matched] == [0, 12]


def test_a_failed_load_on_a_hybrid_model_stops_as_vllms_one_group_handling_does():
    """vLLM 0.25.1 unpacks one group's blocks when a load fails (a TODO for the
    hybrid manager, scheduler.py:2545-2546): with two groups that raises there."""
    scheduler = mamba_hybrid_scheduler("RecordingHMAConnector")
    scheduler.new_request("a", list(range(1, 11)), SamplingParams(max_tokens=3))
    runner = ModelFreeRunner(vocab_size=50)
    output = scheduler.schedule()
    result = runner.execute_model(output)
    (first, *_), _ = scheduler.kv_cache_manager.get_block_ids("a")
    result.kv_connector_output = KVConnectorOutput(invalid_block_ids={first})
    with pytest.raises(ValueError, match="supports one group"):
        scheduler.update_from_output(output, result)


def test_a_consumer_recomputing_the_last_prompt_token_has_no_block_for_its_oldest_window_token():
    """A defect kvref reproduces from vLLM 0.25.1, named here: an asynchronous load of a
    whole prompt of P tokens is admitted with P computed tokens, so a window group
    drops (as the null block) every block before token P - W + 1 (``allocate_slots``,
    ``kv_cache_manager.py:362-408``; ``single_type_kv_cache_manager.py:207-227``);
    when the load lands the consumer recomputes token P - 1 (``scheduler.py:2434-2437``),
    whose window starts at token P - W. When P - W + 1 is a multiple of the block
    size, that token's block is the null block: the recomputed token attends to
    the null block's contents. vLLM 0.25.1's own ``KVCacheManager``, given these
    calls, returns the same block ids (``tools/check_vllm_hybrid_connector.py``).
    The engine tests above use prompts that avoid it."""
    from kvref import Request, get_request_block_hasher, init_none_hash, sha256
    init_none_hash(sha256)
    config = KVCacheConfig(40, [
        KVCacheGroupSpec(["full"], FullAttentionSpec(BLOCK, **HEADS)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(BLOCK, WINDOW, **HEADS))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK)
    prompt_len = 16                                       # 16 - 5 + 1 = 12 = 3 blocks
    request = Request("r", list(range(prompt_len)),
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 0, num_new_computed_tokens=num_hit,
                                  new_computed_blocks=blocks,
                                  num_external_computed_tokens=prompt_len,
                                  delay_cache_blocks=True) is not None
    ids = manager.get_block_ids("r")
    assert ids == ([1, 2, 3, 4], [0, 0, 0, 5])
    oldest_window_token = (prompt_len - 1) - WINDOW + 1
    assert ids[1][oldest_window_token // BLOCK] == 0     # the null block
