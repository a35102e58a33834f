"""Generation through each KV connector equals generation without one, token for token.

The engine runs a tiny Llama (``tests/engine/hf_models.py``) on shared-prefix
prompts; a second engine (or a second pass) gets KV through the connector and
must produce the same greedy tokens while computing only what the connector
did not bring. After every step the manager's invariants hold and every
request is in exactly one queue (or held by the connector).
"""

from __future__ import annotations

import pytest

from kvref import RequestStatus
from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.engine import LLM, SamplingParams
from kvref.verify.invariants import check_kv_cache_manager

from .hf_models import hybrid, llama
from .test_llm import shared_prefix_prompts

BLOCK = 4
OPTIONS = dict(block_size=BLOCK, max_model_len=64, max_num_batched_tokens=24)
PARAMS = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return llama()


@pytest.fixture(scope="module")
def prompts(model):
    return shared_prefix_prompts(model.config.vocab_size)


@pytest.fixture(scope="module")
def reference(model, prompts):
    llm = LLM(model, num_gpu_blocks=80, **OPTIONS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def check_scheduler(llm: LLM) -> None:
    """After a step: pool invariants, and each request in one place."""
    s = llm.scheduler
    # The CPU tier holds a reference on the device blocks it is copying.
    held = getattr(s.connector, "gpu_blocks_held", lambda: [])()
    check_kv_cache_manager(llm.kv_cache_manager, popped_blocks=[*s.deferred_blocks(), *held])
    queued = [r.request_id for r in [*s.running, *s.waiting, *s.skipped_waiting]]
    assert len(queued) == len(set(queued)), "a request is in two queues"
    for req_id, request in s.requests.items():
        if req_id not in queued:
            assert request.is_finished(), f"{req_id} is in no queue but not finished"
    for request in s.skipped_waiting:
        # Loading, or landed and promoted but not admitted yet (it stays first in line).
        assert request.status in (RequestStatus.WAITING_FOR_REMOTE_KVS,
                                  RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for request in s.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def connected_llm(model, config: KVTransferConfig, **kwargs) -> LLM:
    llm = LLM(model, kv_transfer_config=config, **{**OPTIONS, **kwargs})
    llm.after_step.append(check_scheduler)
    return llm


def cpu_tier(model, num_cpu_blocks: int) -> KVTransferConfig:
    """The CPU offload tier with ``num_cpu_blocks`` host blocks, asked as vLLM asks:
    in bytes (``cpu_bytes_to_use``), here one block of every layer times the count."""
    groups = LLM(model, num_gpu_blocks=20, **OPTIONS).kv_cache_config.kv_cache_groups
    block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    return KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config={
                                "cpu_bytes_to_use": num_cpu_blocks * block_bytes})


def assert_all_blocks_free(llm: LLM) -> None:
    pool = llm.kv_cache_manager.block_pool
    assert not llm.scheduler.requests
    assert pool.get_num_free_blocks() == llm.kv_cache_config.num_blocks - 1   # but the null one


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_a_second_engine_reads_the_first_ones_blocks_from_storage(model, prompts, reference,
                                                                 tmp_path):
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    first = connected_llm(model, config, num_gpu_blocks=80)
    assert tokens(first.generate(prompts, PARAMS)) == reference
    assert first.stats.prompt_tokens_external == 0            # the store was empty

    second = connected_llm(model, config, num_gpu_blocks=80)
    assert tokens(second.generate(prompts, PARAMS)) == reference
    stats = second.stats
    # Every full block before each prompt's last token came from the store or the
    # engine's own prefix cache; only the rest was computed.
    assert stats.prompt_tokens_computed == sum(len(p) - (len(p) - 1) // BLOCK * BLOCK
                                               for p in prompts)
    assert stats.prompt_tokens_external > 0
    assert stats.prompt_tokens_computed + stats.prompt_tokens_cached + \
        stats.prompt_tokens_external == sum(map(len, prompts))
    assert second.model_runner.kv_connector.stats.num_loaded_blocks == \
        stats.prompt_tokens_external // BLOCK
    assert_all_blocks_free(second)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_blocks_come_back_from_the_cpu_tier(model, prompts, reference,
                                                    async_scheduling):
    config = cpu_tier(model, 64)
    llm = connected_llm(model, config, num_gpu_blocks=20,      # small: preempts, evicts
                        async_scheduling=async_scheduling)
    # Async: a consumer's freed blocks wait for the step in flight (deferred frees).
    assert llm.scheduler.defer_block_free == async_scheduling
    assert tokens(llm.generate(prompts + prompts, PARAMS)) == reference + reference
    worker = llm.model_runner.kv_connector
    hits = llm.scheduler.connector_prefix_cache_stats
    # Every hit was loaded; of those tokens, the prompt ones count as external
    # (a resumed request also loads its earlier outputs).
    assert worker.stats.num_loaded_blocks * BLOCK == hits.hits + hits.preempted_hits
    assert 0 < llm.stats.prompt_tokens_external <= hits.hits + hits.preempted_hits
    assert worker.stats.bytes_loaded == worker.stats.num_loaded_blocks * \
        llm.scheduler.connector._block_bytes
    assert_all_blocks_free(llm)


def test_a_hybrid_model_runs_through_the_cpu_tier_token_equal(prompts):
    """Full-attention and sliding-window groups: the tier (SupportsHMA) stores and
    loads both groups' blocks; the tokens are those of the engine without it."""
    model = hybrid()
    plain = LLM(model, num_gpu_blocks=60, **OPTIONS)
    groups = plain.kv_cache_config.kv_cache_groups
    assert len(groups) == 2
    want = tokens(plain.generate(prompts + prompts, PARAMS))
    block_bytes = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    config = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 64 * block_bytes})
    llm = connected_llm(model, config, num_gpu_blocks=30)
    assert tokens(llm.generate(prompts + prompts, PARAMS)) == want
    assert llm.stats.prompt_tokens_external > 0
    assert llm.model_runner.kv_connector.stats.num_loaded_blocks > 0
    assert_all_blocks_free(llm)


def test_without_the_tier_the_same_workload_computes_more(model, prompts, reference):
    plain = LLM(model, num_gpu_blocks=20, **OPTIONS)
    assert tokens(plain.generate(prompts + prompts, PARAMS)) == reference + reference
    config = cpu_tier(model, 64)
    tiered = connected_llm(model, config, num_gpu_blocks=20)
    tiered.generate(prompts + prompts, PARAMS)
    assert tiered.stats.prompt_tokens_computed < plain.stats.prompt_tokens_computed


def test_a_load_that_fails_is_recomputed_or_fails_the_request(model, prompts, reference,
                                                             tmp_path):
    config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    connected_llm(model, config, num_gpu_blocks=80).generate(prompts, PARAMS)
    # Empty every file: the lookup still finds them, the load cannot use them.
    for path in tmp_path.iterdir():
        path.write_bytes(b"")
    recompute = connected_llm(model, KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)}), num_gpu_blocks=80)
    assert tokens(recompute.generate(prompts, PARAMS)) == reference
    assert recompute.stats.num_kv_load_failures > 0
    assert_all_blocks_free(recompute)

    fail = connected_llm(model, KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both", kv_load_failure_policy="fail",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)}), num_gpu_blocks=80)
    outputs = fail.generate(prompts, PARAMS)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert "error" in reasons
    for out, expected in zip(outputs, reference):
        if out.outputs[0].finish_reason == "error":
            assert out.outputs[0].token_ids == []
        else:
            assert out.outputs[0].token_ids == expected
    assert_all_blocks_free(fail)
