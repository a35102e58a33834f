"""P2P transfer: a producer's blocks land in a consumer's blocks over gloo point-to-point.

Both ends live in this process here (two threads make the group); the engine
tests run them as two processes.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig
from kvref.distributed.kv_transfer.kv_connector.v1.p2p.p2p_connector import block_tag

from .harness import MiniEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair(**producer_extra) -> tuple[MiniEngine, MiniEngine]:
    port = free_port()

    def config(role, **extra):
        return KVTransferConfig(kv_connector="P2pConnector", kv_role=role,
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config={"p2p_port": port, "timeout_s": 20,
                                                           **extra})
    producer = MiniEngine(config("kv_producer", **producer_extra), connect=False)
    consumer = MiniEngine(config("kv_consumer"), connect=False)
    thread = threading.Thread(target=producer.worker_side.register_kv_caches,
                              args=(producer.kv_caches,))
    thread.start()
    consumer.worker_side.register_kv_caches(consumer.kv_caches)
    thread.join()
    return producer, consumer


def steps_until(engine: MiniEngine, done, timeout_s: float = 60.0) -> None:
    """Step until ``done()``. The blocks arrive on the connector's own threads,
    so the bound is wall-clock time, not a step count (2,000 quick steps could
    end before a loaded machine had run the transfer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine.step([])
        if done():
            return
        time.sleep(0.001)
    raise AssertionError(f"the transfer did not end within {timeout_s:.0f} s")


def test_a_prefill_moves_block_by_block_into_the_decode_engines_blocks():
    producer, consumer = pair()
    prompt = list(range(30, 44))                          # 14 tokens: 4 blocks, 1 partial
    p = producer.request("r", prompt, do_remote_decode=True)
    producer.admit(p)
    producer.step([p])
    assert producer.finish(p)                             # held until sent
    d = consumer.request("r", prompt, do_remote_prefill=True)
    assert consumer.admit(d) == (0, 14, True)
    held = producer.manager.block_pool.get_num_free_blocks()

    sent: set[str] = set()
    producer.step([])                                     # posts the sends
    consumer.step([])                                     # posts the receives
    for _ in range(2000):
        sent |= producer.step([]).finished_sending or set()
        if sent and not consumer.waiting_for_load:
            break
        consumer.step([])
    assert sent == {"r"} and not consumer.waiting_for_load
    assert producer.manager.block_pool.get_num_free_blocks() == held   # not freed by us
    assert consumer.worker_side.num_blocks_received == 4
    assert consumer.last_output.invalid_block_ids == set()
    consumer.assert_kv_is_computed(d, 14)
    assert d.kv_transfer_params["do_remote_prefill"] is False           # never asked again


def test_blocks_the_consumer_already_caches_are_received_but_not_written():
    producer, consumer = pair()
    prompt = list(range(10))
    local = consumer.request("local", prompt[:8] + [99])
    consumer.admit(local)
    consumer.step([local])
    consumer.finish(local)
    p = producer.request("r", prompt, do_remote_decode=True)
    producer.admit(p)
    producer.step([p])
    producer.finish(p)
    d = consumer.request("r", prompt, do_remote_prefill=True)
    assert consumer.admit(d) == (8, 2, True)              # 2 local blocks, the rest remote
    producer.step([])
    consumer.step([])
    steps_until(consumer, lambda: not consumer.waiting_for_load)
    assert consumer.worker_side.stats.num_loaded_blocks == 1
    assert consumer.worker_side.num_blocks_received == 3
    consumer.assert_kv_is_computed(d, 10)


def test_different_layouts_refuse_to_connect_and_say_why():
    port = free_port()
    producer_config = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_producer",
                                       kv_connector_extra_config={"p2p_port": port})
    producer = MiniEngine(producer_config, connect=False)
    consumer = MiniEngine(KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer",
                                           kv_connector_extra_config={"p2p_port": port}),
                          connect=False)
    consumer.kv_caches = {k: v[..., :2].contiguous() for k, v in consumer.kv_caches.items()}
    thread = threading.Thread(target=producer.worker_side.register_kv_caches,
                              args=(producer.kv_caches,))
    thread.start()
    with pytest.raises(ValueError, match="same model and block size"):
        consumer.worker_side.register_kv_caches(consumer.kv_caches)
    thread.join()


def test_tags_name_a_block_of_a_request_and_refuse_a_request_too_long():
    assert block_tag("a", 0) != block_tag("a", 1) != block_tag("b", 1)
    with pytest.raises(ValueError, match="1024 blocks"):
        block_tag("a", 1024)
    with pytest.raises(ValueError, match="kv_producer"):
        MiniEngine(KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"p2p_port": 1}))
