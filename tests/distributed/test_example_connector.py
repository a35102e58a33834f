"""The storage connector: blocks saved by one engine are loaded by another, byte for byte."""

from __future__ import annotations

import os

import pytest

from kvref.distributed.kv_transfer.kv_connector.factory import KVTransferConfig

from .harness import BLOCK_SIZE, MiniEngine


def storage(path, **kwargs) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": str(path)},
                            **kwargs)


def test_a_second_engine_loads_the_shared_blocks_and_computes_the_rest(tmp_path):
    first = MiniEngine(storage(tmp_path))
    a = first.request("a", list(range(14)))
    assert first.admit(a) == (0, 0, False)
    first.step([a])
    assert first.worker_side.stats.num_saved_blocks == 3          # 14 tokens: 3 full blocks
    assert len(os.listdir(tmp_path)) == 3

    second = MiniEngine(storage(tmp_path))                        # a fresh engine and pool
    b = second.request("b", list(range(8)) + [90, 91, 92, 93, 94])
    assert second.admit(b) == (0, 8, False)                       # 2 shared blocks, sync
    second.step([b])
    assert second.computed_tokens["b"] == 13 - 8
    second.assert_kv_is_computed(b)
    assert second.worker_side.stats.bytes_loaded == \
        2 * 2 * 2 * BLOCK_SIZE * 2 * 3 * 4                        # blocks*layers*K,V*tokens*H*D*4B
    assert second.worker_side.stats.num_saved_blocks == 1         # only its own third block


def test_a_full_prompt_hit_still_computes_the_last_token(tmp_path):
    first = MiniEngine(storage(tmp_path))
    a = first.request("a", list(range(12)))
    first.admit(a)
    first.step([a])
    second = MiniEngine(storage(tmp_path))
    b = second.request("b", list(range(12)))
    assert second.admit(b) == (0, 8, False)      # block 3 holds the last token: computed
    second.step([b])
    assert second.computed_tokens["b"] == 4
    second.assert_kv_is_computed(b)


def test_local_hits_come_first_and_only_later_blocks_are_loaded(tmp_path):
    engine = MiniEngine(storage(tmp_path))
    a = engine.request("a", list(range(14)))
    engine.admit(a)
    engine.step([a])
    engine.finish(a)                             # its blocks stay in the prefix cache
    b = engine.request("b", list(range(13)))
    assert engine.admit(b) == (12, 0, False)     # all three blocks are local hits
    loads_before = engine.worker_side.stats.num_loaded_blocks
    engine.step([b])
    assert engine.worker_side.stats.num_loaded_blocks == loads_before
    engine.assert_kv_is_computed(b)


def test_a_file_gone_before_the_load_is_reported_as_a_load_error(tmp_path):
    first = MiniEngine(storage(tmp_path))
    a = first.request("a", list(range(9)))
    first.admit(a)
    first.step([a])
    second = MiniEngine(storage(tmp_path))
    b = second.request("b", list(range(9)))
    assert second.admit(b) == (0, 8, False)
    victim = sorted(os.listdir(tmp_path))[0]
    os.remove(tmp_path / victim)                 # deleted between lookup and load
    out = second.step([b])
    assert len(out.invalid_block_ids) == 1
    assert out.invalid_block_ids <= set(second.manager.get_block_ids("b")[0][:2])


def test_files_of_another_layout_are_never_hits(tmp_path):
    first = MiniEngine(storage(tmp_path))
    a = first.request("a", list(range(9)))
    first.admit(a)
    first.step([a])
    other = MiniEngine(storage(tmp_path))
    other.scheduler_side._seed = b"another model"
    assert other.admit(other.request("b", list(range(9)))) == (0, 0, False)


def test_bad_configs_are_refused_with_the_setting_to_fix():
    with pytest.raises(ValueError, match="shared_storage_path"):
        MiniEngine(KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="both")
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                         kv_load_failure_policy="retry")
