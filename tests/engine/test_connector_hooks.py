"""The connector hooks vLLM 0.25.1's scheduler calls, called where it calls them.

``vllm/v1/core/sched/scheduler.py`` (0.25.1): ``bind_gpu_block_pool`` once after
the KV cache manager is built (:278-280), ``on_new_request`` in ``add_request``
(:2031-2032), ``get_kv_connector_stats`` and ``take_events`` after every
``update_from_output`` (:1788-1816), ``has_pending_push_work`` in
``has_requests`` (:2190-2194); and ``assert num_new_tokens > 0`` (:843) when a
connector offers a synchronous hit of the whole sequence.
"""

from __future__ import annotations

import pytest

from kvref import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager
from kvref.distributed.kv_transfer.kv_connector.factory import (KVConnectorFactory,
                                                                KVTransferConfig)
from kvref.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorOutput,
                                                                KVConnectorStats)
from kvref.engine.core import EngineCore
from kvref.worker.model_free_runner import ModelFreeRunner
from kvref.sampling_params import SamplingParams
from kvref.sched.scheduler import Scheduler
from kvref.kv_events import BlockStored


class HookConnector(KVConnectorBase_V1):
    """Answers nothing but logs every hook call; knobs in ``kv_connector_extra_config``."""

    def __init__(self, kv_transfer_config, role, kv_cache_config) -> None:
        super().__init__(kv_transfer_config, role, kv_cache_config)
        self.calls: list[tuple] = []
        self.extra = kv_transfer_config.kv_connector_extra_config
        self.push_work = False

    # worker side: nothing to move
    def start_load_kv(self, **kwargs) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None: ...
    def wait_for_save(self) -> None: ...

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self.calls.append(("bind_gpu_block_pool", gpu_block_pool))

    def on_new_request(self, request) -> None:
        self.calls.append(("on_new_request", request.request_id))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # "whole": a synchronous hit of every token (a contract violation).
        if self.extra.get("whole"):
            return request.num_tokens - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None: ...

    def update_connector_output(self, connector_output) -> None:
        self.calls.append(("update_connector_output", connector_output))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def get_kv_connector_stats(self):
        self.calls.append(("get_kv_connector_stats",))
        return KVConnectorStats(num_loaded_blocks=len(self.calls))

    def take_events(self):
        self.calls.append(("take_events",))
        return [BlockStored(block_hashes=[len(self.calls)], parent_block_hash=None,
                            token_ids=[], block_size=4, lora_id=None, medium="CPU",
                            lora_name=None)]

    def has_pending_push_work(self) -> bool:
        return self.push_work


KVConnectorFactory.register_connector("HookConnector", __name__, "HookConnector")


def make_engine(events: bool = False, **extra) -> tuple[Scheduler, EngineCore]:
    config = KVCacheConfig(16, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    manager = KVCacheManager(config, max_model_len=32, scheduler_block_size=4,
                             hash_block_size=4, enable_kv_cache_events=events)
    scheduler = Scheduler(manager, max_num_batched_tokens=16, kv_transfer_config=KVTransferConfig(
        kv_connector="HookConnector", kv_role="kv_both", kv_connector_extra_config=extra))
    return scheduler, EngineCore(scheduler, ModelFreeRunner(vocab_size=50))


def names(connector) -> list[str]:
    return [call[0] for call in connector.calls]


def test_the_block_pool_is_bound_once_at_construction():
    scheduler, core = make_engine()
    assert scheduler.connector.calls == [("bind_gpu_block_pool",
                                          scheduler.kv_cache_manager.block_pool)]
    scheduler.new_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    while core.has_work():
        core.step()
    assert names(scheduler.connector).count("bind_gpu_block_pool") == 1


def test_each_new_request_is_announced_when_queued():
    scheduler, _ = make_engine()
    scheduler.new_request("a", [1, 2, 3])
    scheduler.new_request("b", [4, 5])
    assert scheduler.connector.calls[1:] == [("on_new_request", "a"), ("on_new_request", "b")]


def test_stats_and_events_are_taken_after_every_update():
    scheduler, core = make_engine(events=True)
    scheduler.new_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
    num_steps = 0
    while core.has_work():
        core.step()
        num_steps += 1
        # stats, then events, once per update_from_output (vLLM's order)
        assert names(scheduler.connector)[-2:] == ["get_kv_connector_stats", "take_events"]
    assert names(scheduler.connector).count("take_events") == num_steps
    assert scheduler.kv_connector_stats == KVConnectorStats(
        num_loaded_blocks=len(scheduler.connector.calls) - 1)
    # The connector's events reach the engine's event output beside the manager's.
    events = scheduler.take_events()
    mine = [e for e in events if e.medium == "CPU"]
    assert len(mine) == num_steps
    assert any(e.medium != "CPU" for e in events)       # the manager stored a block
    assert scheduler.take_events() == []


def test_with_events_off_the_connector_is_drained_and_nothing_published():
    """vLLM takes the connector's events every step either way; with KV cache
    events off its publisher (NullEventPublisher) drops them."""
    scheduler, core = make_engine(events=False)
    scheduler.new_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    while core.has_work():
        core.step()
    assert "take_events" in names(scheduler.connector)
    assert scheduler.take_events() == []


def test_pending_push_work_keeps_the_engine_stepping():
    scheduler, core = make_engine()
    assert not scheduler.has_requests()
    scheduler.connector.push_work = True
    assert scheduler.has_requests() and core.has_work()
    scheduler.connector.push_work = False
    assert not scheduler.has_requests()


def test_a_synchronous_hit_of_the_whole_prompt_fails_at_admission():
    scheduler, _ = make_engine(whole=True)
    scheduler.new_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(AssertionError, match="a"):
        scheduler.schedule()


def test_no_connector_output_means_no_update_connector_output():
    """vLLM's runner returns no KVConnectorOutput from a step without a forward that
    has nothing to report (vllm/v1/outputs.py:284-294), and the scheduler then skips
    update_connector_output (scheduler.py:1781-1782); with an output it is called."""
    from kvref.outputs import ModelRunnerOutput

    scheduler, _ = make_engine()
    output = scheduler.schedule()                   # nothing to schedule
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                                           sampled_token_ids=[]))
    assert "update_connector_output" not in names(scheduler.connector)
    output = scheduler.schedule()
    reported = KVConnectorOutput(finished_recving=None)
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[], kv_connector_output=reported))
    assert scheduler.connector.calls[-3] == ("update_connector_output", reported)
