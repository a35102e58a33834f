"""docs/questions.md: every figure on the page is computed here from kvref's code.

Each test computes one answer's figures and requires the page to say them, word
for word (whitespace aside), so the page cannot drift from the code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvref import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, Request,
                   SlidingWindowSpec, get_request_block_hasher, init_none_hash, sha256)
from kvref.core.kv_cache_utils import capacity_config, get_kv_cache_groups
from kvref.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory, KVTransferConfig, resolve_disable_hybrid_kv_cache_manager)
from kvref.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole, KVConnectorOutput
from kvref.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector, SimpleCPUOffloadWorkerMetadata)
from kvref.engine.core import make_engine_core
from kvref.kv_cache_interface import KVCacheTensor
from kvref.sched.scheduler import Scheduler
from kvref.engine import SamplingParams
from kvref.worker.model_free_runner import ModelFreeRunner

from tests.distributed.test_simple_cpu_offload_connector import (hybrid_tier,
                                                                 prefill_then_decode)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "questions.md"
TEXT = " ".join(PAGE.read_text(encoding="utf-8").split())


def says(sentence: str) -> None:
    assert " ".join(sentence.split()) in TEXT, f"docs/questions.md should say: {sentence!r}"


def section(title: str) -> str:
    return TEXT.split(f"## {title}", 1)[1].split(" ## ", 1)[0]


def test_the_connector_table_gives_each_connectors_groups():
    heads = dict(num_kv_heads=1, head_size=8, dtype="float32")
    layers = {f"l{i}": FullAttentionSpec(4, **heads) if i % 2 == 0 else
              SlidingWindowSpec(4, 8, **heads) for i in range(4)}
    table = section("On a hybrid model, what does each KV connector see, store and load?")
    for name, role in (("ExampleConnector", "kv_both"), ("SimpleCPUOffloadConnector", "kv_both"),
                       ("P2pConnector", "kv_consumer")):
        config = KVTransferConfig(kv_connector=name, kv_role=role)
        disable = resolve_disable_hybrid_kv_cache_manager(config, None)
        groups = get_kv_cache_groups(capacity_config(64, disable_hybrid_kv_cache_manager=disable),
                                     dict(layers))
        hma = KVConnectorFactory.supports_hma_config(config)
        row = re.search(rf"\| `{name}`[^|]*\| (yes|no) \| (\d+):", table)
        assert row, name
        assert row.group(1) == ("yes" if hma else "no") and int(row.group(2)) == len(groups)
        kinds = [type(g.kv_cache_spec) for g in groups]
        assert kinds == ([FullAttentionSpec, SlidingWindowSpec] if hma else [FullAttentionSpec])


def test_what_the_cpu_tier_stores_and_loads_per_group():
    manager, tier = hybrid_tier()
    hasher = get_request_block_hasher(4, sha256)
    a = Request("a", list(range(14)), block_hasher=hasher)
    allocated, meta = prefill_then_decode(manager, tier, a)
    full, window = allocated
    stored = set(meta.store_gpu_blocks)
    stored_full, stored_window = len(stored & set(full)), len(stored & set(window))
    out_of_window = sum(1 for i, b in enumerate(window) if b in stored
                        and manager.get_block_ids("a")[1][i] == 0)
    tier.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata({meta.store_event: 1})))
    tier.request_finished_all_groups(a, manager.get_block_ids("a"))
    manager.free(a)
    assert manager.reset_prefix_cache()
    b = Request("b", list(range(14)), block_hasher=hasher)
    hit, _ = tier.get_num_new_matched_tokens(b, 0)
    manager.allocate_slots(b, 0, num_external_computed_tokens=hit, delay_cache_blocks=True)
    tier.update_state_after_alloc(b, manager.get_blocks("b"), hit)
    load = tier._reqs_to_load["b"]
    b_full, b_window = manager.get_block_ids("b")
    loaded_full = len(set(load.gpu_block_ids) & set(b_full))
    loaded_window = len(set(load.gpu_block_ids) & set(b_window))
    says(f"the CPU tier stores {stored_full} full-attention blocks and {stored_window} window "
         f"blocks (one of them already out of the window)")
    assert out_of_window == 1
    says(f"the same prompt sent again hits {hit} tokens on the host and loads {loaded_full} "
         f"full-attention blocks and {loaded_window} window blocks")


def test_what_a_p2p_consumer_gets_per_group():
    """The consumer of a remote prefill asks for the prompt less its last token as
    external tokens (``P2pConnector``, lesson 13)."""
    manager, _ = hybrid_tier()
    hasher = get_request_block_hasher(4, sha256)
    request = Request("p", list(range(14)), block_hasher=hasher)
    manager.allocate_slots(request, 1, num_external_computed_tokens=13)
    full, window = manager.get_block_ids("p")
    assert len(full) == len(window) and 0 not in full
    nulls = window.count(0)
    says(f"A `P2pConnector` consumer given the same prompt gets {len(full)} blocks per group, "
         f"{nulls} of the window group's {len(window)} being the null block")


def hit_of(prompt_length: int) -> int:
    init_none_hash(sha256)
    config = KVCacheConfig(16, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=4, hash_block_size=4)
    hasher = get_request_block_hasher(4, sha256)
    first = Request("first", list(range(prompt_length)), block_hasher=hasher)
    manager.allocate_slots(first, prompt_length)
    first.num_computed_tokens = prompt_length
    manager.free(first)
    _, hit = manager.get_computed_blocks(Request("again", list(range(prompt_length)),
                                                 block_hasher=hasher))
    return hit


def test_the_hit_cap():
    says(f"a 12-token prompt with blocks of 4 hits {hit_of(12)} tokens the second time, not 12 "
         f"and not 11; one token longer (13), it hits {hit_of(13)}")


def test_why_the_multi_turn_workload_misses(capsys):
    from kvref.cli import main

    assert main(["simulate", "--workload", "multi-turn", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    causes = result["misses_by_cause"]
    says(f"{result['prompt_tokens_computed']} prompt tokens are computed: "
         f"{causes['first_occurrence']} because no earlier request had computed them, and "
         f"{causes['shared_prefix_ends_inside_block']} because the shared part ends inside a "
         f"block")
    assert sum(causes.values()) == result["prompt_tokens_computed"]
    assert set(k for k, v in causes.items() if v) == {"first_occurrence",
                                                     "shared_prefix_ends_inside_block"}


def test_preempted_lookups_are_counted_apart(capsys):
    from kvref.cli import main

    assert main(["simulate", "--workload", "pressure", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["num_preemptions"] > 0 and r["preempted_prefix_cache_hits"] > 0
    says(f"vLLM's hit rate is {r['prefix_cache_hits']} hits of {r['prefix_cache_queries']} "
         f"queried tokens, and apart from it the resumed requests found "
         f"{r['preempted_prefix_cache_hits']} of {r['preempted_prefix_cache_queries']} queried "
         f"tokens in their own cached blocks")
    says(f"outnumber the trace's {r['prompt_tokens']} prompt tokens")
    assert r["prefix_cache_queries"] > r["prompt_tokens"]


def test_host_blocks_per_rank():
    spec = FullAttentionSpec(4, num_kv_heads=1, head_size=8, dtype="float32")
    config = KVCacheConfig(16, [KVCacheGroupSpec(["l0"], spec)],
                           [KVCacheTensor(16 * spec.page_size_bytes, ["l0"])])
    blocks = {}
    for world_size in (1, 4):
        transfer = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 64 * spec.page_size_bytes,
                                       "world_size": world_size})
        blocks[world_size] = SimpleCPUOffloadConnector(
            transfer, KVConnectorRole.SCHEDULER, config).num_cpu_blocks
    says(f"With room for 64 blocks in `cpu_bytes_to_use`, one rank gets {blocks[1]} host "
         f"blocks and each of four ranks {blocks[4]}")


def test_resetting_while_requests_run():
    init_none_hash(sha256)
    config = KVCacheConfig(40, [KVCacheGroupSpec(["l0"], FullAttentionSpec(4))])
    manager = KVCacheManager(config, max_model_len=64, scheduler_block_size=4, hash_block_size=4)
    scheduler = Scheduler(manager, max_num_batched_tokens=64)
    core = make_engine_core(scheduler, ModelFreeRunner(vocab_size=90))
    for i in range(2):
        scheduler.new_request(str(i), list(range(10 * i, 10 * i + 9)),
                              SamplingParams(max_tokens=8, ignore_eos=True))
    core.step()
    running = len(scheduler.running)
    plain = scheduler.reset_prefix_cache()
    forced = scheduler.reset_prefix_cache(reset_running_requests=True)
    preempted = len(scheduler.reset_preempted_req_ids)
    says(f"In a model-free engine with {running} requests running, the plain reset answers "
         f"{plain}, the forced one {forced}, with {preempted} requests preempted")
