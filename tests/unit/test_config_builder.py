"""The KV cache config builder (per-layer specs -> groups -> tensors), the spec
registry, the extra spec types and vLLM's forms of the capacity functions.

Each expectation here was checked against vLLM 0.25.1's own functions (the
numbers are small enough to follow by hand); ``tools/vllm_unit_tests.py`` runs
vLLM's own tests of the same functions on kvref.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvref import (
    BlockPool,
    ChunkedLocalAttentionSpec,
    FullAttentionManager,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecRegistry,
    MambaManager,
    MambaSpec,
    MLAAttentionSpec,
    Request,
    RSWAManager,
    RSWASpec,
    SinkFullAttentionManager,
    SinkFullAttentionSpec,
    SlidingWindowManager,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    capacity_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_manager_for_kv_cache_spec,
    register_kv_cache_spec,
)
from kvref.core import kv_cache_utils as utils
from kvref.kv_cache_interface import KVQuantMode, get_kv_cache_spec_kind

FULL = FullAttentionSpec(16, num_kv_heads=2, head_size=8)          # 1 KiB a page
SW = SlidingWindowSpec(16, 64, num_kv_heads=2, head_size=8)        # same page
PAGE = FULL.page_size_bytes


def _cfg(max_model_len=1024, **kw):
    return capacity_config(max_model_len, **kw)


# -- specs -----------------------------------------------------------------------


def test_mla_page_has_no_value_half_and_compression_shrinks_it():
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert mla.page_size_bytes == 64 * 576 * 2          # one latent a token, no factor 2
    compressed = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512,
                                  dtype="bfloat16", compress_ratio=4)
    assert compressed.storage_block_size == 16
    assert compressed.page_size_bytes == 16 * 512 * 2
    fp8 = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="uint8",
                           cache_dtype_str="fp8_ds_mla")
    assert fp8.page_size_bytes == 64 * 656
    aligned = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=10, dtype="float16",
                               alignment=64)
    assert aligned.real_page_size_bytes == 80 and aligned.page_size_bytes == 128


def test_padded_page_may_not_be_smaller_than_the_page():
    with pytest.raises(ValueError, match="below the page"):
        FullAttentionSpec(16, head_size=8, page_size_padded=8).page_size_bytes
    assert FullAttentionSpec(16, head_size=8, page_size_padded=4096).page_size_bytes == 4096


def test_per_token_head_quantization_adds_float32_scales():
    plain = FullAttentionSpec(16, num_kv_heads=2, head_size=8, dtype="int8")
    scaled = FullAttentionSpec(16, num_kv_heads=2, head_size=8, dtype="int8",
                               kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    assert scaled.page_size_bytes == plain.page_size_bytes + 2 * 16 * 2 * 4


def test_full_attention_merge_keeps_an_agreed_window_and_refuses_mixtures():
    a = FullAttentionSpec(16, sliding_window=8)
    b = FullAttentionSpec(16)
    assert FullAttentionSpec.merge([a, b]).sliding_window == 8
    with pytest.raises(ValueError, match="window size"):
        FullAttentionSpec.merge([a, FullAttentionSpec(16, sliding_window=4)])
    with pytest.raises(AssertionError, match="both sliding window"):
        FullAttentionSpec.merge([a, FullAttentionSpec(16, attention_chunk_size=32)])
    with pytest.raises(AssertionError, match="same attention spec"):
        FullAttentionSpec.merge([b, FullAttentionSpec(16, head_size=2)])
    assert FullAttentionSpec.merge([b, FullAttentionSpec(16, non_causal=True)]).non_causal


def test_spec_kinds_prefer_the_specific_subclass():
    mla = MLAAttentionSpec(block_size=16)
    assert get_kv_cache_spec_kind(mla).value == "mla_attention"
    assert get_kv_cache_spec_kind(SlidingWindowMLASpec(16, 8)).value == "sliding_window_mla"
    assert get_kv_cache_spec_kind(SinkFullAttentionSpec(16, sink_len=16)).value == \
        "sink_full_attention"
    both = UniformTypeKVCacheSpecs.from_specs({"a": mla, "b": MLAAttentionSpec(16, head_size=4)})
    assert get_kv_cache_spec_kind(both).value == "mla_attention"


def test_config_knows_about_mamba_layers():
    attention = KVCacheConfig(8, [KVCacheGroupSpec(["a"], FULL)])
    hybrid = KVCacheConfig(8, [KVCacheGroupSpec(["a"], FULL),
                               KVCacheGroupSpec(["m"], MambaSpec(16, "align"))])
    assert not attention.has_mamba_layers and not attention.needs_kv_cache_zeroing
    assert hybrid.has_mamba_layers and hybrid.needs_kv_cache_zeroing


# -- the registry ----------------------------------------------------------------------


def test_builtin_specs_have_their_managers():
    assert KVCacheSpecRegistry.get_manager_class(MLAAttentionSpec(16)) is FullAttentionManager
    assert KVCacheSpecRegistry.get_manager_class(SlidingWindowMLASpec(16, 8)) is \
        SlidingWindowManager
    assert KVCacheSpecRegistry.get_manager_class(MambaSpec(16)) is MambaManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(RSWASpec(16, rswa_window=4)) is \
        FullAttentionSpec
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(SlidingWindowMLASpec(16, 8)) is \
        SlidingWindowMLASpec


def test_a_custom_spec_is_served_by_its_registered_manager():
    @register_kv_cache_spec(manager_class=SlidingWindowManager,
                            uniform_type_base_spec=FullAttentionSpec)
    @dataclass(frozen=True, kw_only=True)
    class OddSpec(FullAttentionSpec):
        pass

    try:
        spec = OddSpec(block_size=16)
        pool = BlockPool(10, enable_caching=True, hash_block_size=16)
        # The registered manager is the one built, whatever the spec's ancestry.
        manager = get_manager_for_kv_cache_spec(spec, 64, 64, block_pool=pool,
                                                enable_caching=True, kv_cache_group_id=0,
                                                scheduler_block_size=16)
        assert type(manager) is SlidingWindowManager
        with pytest.raises(AssertionError, match="already registered"):
            KVCacheSpecRegistry.register(OddSpec, FullAttentionManager, FullAttentionSpec)
    finally:
        KVCacheSpecRegistry.unregister(OddSpec)
    # Unregistered again, it inherits full attention's registration.
    assert KVCacheSpecRegistry.get_manager_class(OddSpec(block_size=16)) is FullAttentionManager


def test_unregistered_spec_types_are_refused_by_the_builder():
    from kvref.kv_cache_interface import KVCacheSpec

    @dataclass(frozen=True)
    class Stray(KVCacheSpec):
        pass

    with pytest.raises(ValueError, match="Unsupported KV cache spec type for layer x"):
        get_kv_cache_configs(_cfg(), [{"x": Stray(16)}], [10**9])


# -- groups ----------------------------------------------------------------------------


def test_equal_specs_make_one_group_and_one_tensor_per_layer():
    specs = {f"l{i}": FULL for i in range(4)}
    (config,) = get_kv_cache_configs(_cfg(), [specs], [4 * 100 * PAGE])
    assert [g.layer_names for g in config.kv_cache_groups] == [["l0", "l1", "l2", "l3"]]
    assert config.num_blocks == 100
    assert [t.shared_by for t in config.kv_cache_tensors] == [["l0"], ["l1"], ["l2"], ["l3"]]
    assert all(t.size == 100 * PAGE for t in config.kv_cache_tensors)


def test_hybrid_layers_are_dealt_round_robin_into_equal_groups():
    specs = {"f0": FULL, "s0": SW, "s1": SW, "f1": FULL, "s2": SW, "s3": SW}
    groups = get_kv_cache_groups(_cfg(), specs)
    assert [g.layer_names for g in groups] == [["f0", "f1"], ["s0", "s2"], ["s1", "s3"]]
    config = get_kv_cache_config_from_groups(_cfg(), groups, 2 * 50 * PAGE)
    assert config.num_blocks == 50
    assert [t.shared_by for t in config.kv_cache_tensors] == [["f0", "s0", "s1"],
                                                              ["f1", "s2", "s3"]]


def test_counts_within_one_and_a_half_use_the_larger_group_size():
    specs = {f"s{i}": SW for i in range(12)} | {f"f{i}": FULL for i in range(13)}
    groups = get_kv_cache_groups(_cfg(), specs)
    assert [len(g.layer_names) for g in groups] == [12, 13]    # one group each, padded to 13


def test_smaller_pages_grow_by_block_size_or_are_padded_when_allowed():
    big = FullAttentionSpec(16, num_kv_heads=4, head_size=8)           # 2 KiB
    small = SlidingWindowSpec(16, 64, num_kv_heads=2, head_size=8)    # 1 KiB: divides
    unified = utils.unify_kv_cache_spec_page_size({"a": big, "b": small})
    assert unified["b"].block_size == 32 and unified["b"].page_size_bytes == big.page_size_bytes
    odd = SlidingWindowSpec(16, 64, num_kv_heads=3, head_size=8)      # 1.5 KiB: does not
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        utils.unify_kv_cache_spec_page_size({"a": big, "b": odd})
    strided = SlidingWindowSpec(16, 64, num_kv_heads=3, head_size=8,
                                indexes_kv_by_block_stride=True)
    padded = utils.unify_kv_cache_spec_page_size({"a": big, "b": strided})["b"]
    assert padded.block_size == 16 and padded.page_size_padded == big.page_size_bytes


def test_one_type_of_different_page_sizes_is_one_uniform_group():
    a, b = FullAttentionSpec(16, head_size=64), FullAttentionSpec(16, head_size=128)
    (config,) = get_kv_cache_configs(_cfg(), [{"a": a, "b": b}],
                                     [100 * (a.page_size_bytes + b.page_size_bytes)])
    (group,) = config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert config.num_blocks == 100
    assert [t.size for t in config.kv_cache_tensors] == [100 * a.page_size_bytes,
                                                         100 * b.page_size_bytes]
    scheduler_config = utils.generate_scheduler_kv_cache_config([config])
    assert scheduler_config.kv_cache_groups[0].kv_cache_spec == a


def test_disabled_hybrid_manager_turns_windows_into_full_attention():
    specs = {"f": FULL, "s": SW, "c": ChunkedLocalAttentionSpec(16, 32, num_kv_heads=2,
                                                                 head_size=8)}
    # A window and a chunk do not merge into one spec, but as full attention
    # they are one type: one uniform group with a spec per layer.
    (group,) = get_kv_cache_groups(_cfg(disable_hybrid_kv_cache_manager=True), dict(specs))
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.kv_cache_specs["c"].attention_chunk_size == 32
    del specs["c"]
    (group,) = get_kv_cache_groups(_cfg(disable_hybrid_kv_cache_manager=True), specs)
    assert type(group.kv_cache_spec) is FullAttentionSpec
    assert group.kv_cache_spec.sliding_window == 64


def test_hidden_state_layers_get_a_group_of_their_own_filling_the_common_page():
    hidden = HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=4)
    groups = get_kv_cache_groups(_cfg(), {"f": FULL, "s": SW, "h": hidden})
    assert groups[-1].layer_names == ["h"]
    assert groups[-1].kv_cache_spec.page_size_bytes == PAGE
    assert groups[-1].kv_cache_spec.block_size == PAGE // (4 * 2)


# -- configs for several workers --------------------------------------------------------


def test_workers_share_the_smallest_block_count():
    specs = {"l0": FULL, "l1": FULL}
    small, large = get_kv_cache_configs(_cfg(), [specs, specs], [2 * 80 * PAGE, 2 * 100 * PAGE])
    assert small.num_blocks == large.num_blocks == 80
    assert all(t.size == 80 * PAGE for t in large.kv_cache_tensors)


def test_pipeline_stages_get_the_global_groups_projected():
    stage0, stage1 = {"f0": FULL, "s0": SW}, {"f1": FULL, "s1": SW}
    c0, c1 = get_kv_cache_configs(_cfg(), [stage0, stage1], [10**6, 10**6])
    assert [g.layer_names for g in c0.kv_cache_groups] == [["f0"], ["s0"]]
    assert [g.layer_names for g in c1.kv_cache_groups] == [["f1"], ["s1"]]


def test_too_little_memory_names_the_length_that_fits():
    with pytest.raises(ValueError, match="estimated maximum model length is 160"):
        get_kv_cache_configs(_cfg(1024), [{"l": FULL}], [10 * PAGE])
    with pytest.raises(ValueError, match="No available memory"):
        get_kv_cache_configs(_cfg(1024), [{"l": FULL}], [0])


def test_block_override_replaces_the_budget():
    (config,) = get_kv_cache_configs(_cfg(16, num_gpu_blocks_override=7),
                                     [{"l0": FULL, "l1": FULL}], [10**9])
    assert config.num_blocks == 7
    assert all(t.size == 7 * PAGE for t in config.kv_cache_tensors)


def test_auto_fit_lowers_max_model_len_to_what_fits():
    cfg = _cfg(1024)
    cfg.model_config.original_max_model_len = -1
    get_kv_cache_configs(cfg, [{"l": FULL}], [10 * PAGE])
    assert cfg.model_config.max_model_len == 160


def test_attention_free_model_has_only_the_null_block():
    (config,) = get_kv_cache_configs(_cfg(), [{}], [10**6])
    assert config.num_blocks == 1 and config.kv_cache_groups == []


def test_packed_layout_puts_every_slot_of_a_block_side_by_side():
    a, b = MLAAttentionSpec(16, head_size=64), MLAAttentionSpec(16, head_size=32)
    groups = [KVCacheGroupSpec(["a0", "b0"], UniformTypeKVCacheSpecs(16, {"a0": a, "b0": b})),
              KVCacheGroupSpec(["a1"], UniformTypeKVCacheSpecs(16, {"a1": a}))]
    stride = a.page_size_bytes + b.page_size_bytes
    num_blocks, tensors = utils._get_kv_cache_config_packed(_cfg(), groups, 5 * stride + 1)
    assert num_blocks == 5
    assert [(t.shared_by, t.offset, t.block_stride) for t in tensors] == [
        (["a0", "a1"], 0, stride), (["b0"], a.page_size_bytes, stride)]


# -- capacity functions in vLLM's form -------------------------------------------------


def test_vllm_forms_of_the_capacity_functions_agree_with_kvref_forms():
    cfg = _cfg(1000, max_num_batched_tokens=256)
    specs = [FULL, SW]
    assert utils.max_memory_usage_bytes(cfg, specs) == utils.max_memory_usage_bytes(
        specs, max_model_len=1000, max_num_batched_tokens=256)
    assert utils.get_num_blocks(cfg, 2, 10**6, PAGE) == utils.get_num_blocks(2, 10**6, PAGE)
    config = KVCacheConfig(100, [KVCacheGroupSpec(["f"], FULL), KVCacheGroupSpec(["s"], SW)])
    assert utils.get_max_concurrency_for_kv_cache_config(cfg, config) == \
        utils.get_max_concurrency_for_kv_cache_config(config, max_model_len=1000,
                                                      max_num_batched_tokens=256)
    assert utils.estimate_max_model_len(cfg, {"f": FULL}, 10 * PAGE) == 160
    assert cfg.model_config.max_model_len == 1000         # restored after the search
    # vLLM reads the Mamba mode from the config, not from the spec.
    mamba = MambaSpec(16, "all", page_size_padded=PAGE)
    assert mamba.max_memory_usage_bytes(_cfg(64, mamba_cache_mode="align")) == 2 * PAGE
    assert mamba.max_memory_usage_bytes(max_model_len=64) == 4 * PAGE


# -- the two full-attention variants' managers -------------------------------------------


def _manager(cls, spec, pool):
    return cls(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
               scheduler_block_size=spec.block_size)


def test_rswa_frees_the_gap_between_prompt_and_window():
    pool = BlockPool(20, enable_caching=True, hash_block_size=4)
    manager = _manager(RSWAManager, RSWASpec(4, rswa_window=8), pool)
    req = Request("r", list(range(16)))
    blocks = manager.allocate_new_blocks("r", 36, 36)
    ids = [b.block_id for b in blocks]
    manager.remove_skipped_blocks("r", 28)              # no prompt length: nothing goes
    assert [b.block_id for b in manager.req_to_blocks["r"]] == ids
    free_before = pool.get_num_free_blocks()
    manager.remove_skipped_blocks("r", 36, num_prompt_tokens=req.num_prompt_tokens)
    # window starts at 28: blocks 4..6 (tokens 16..27) are the gap
    assert [b.block_id for b in manager.req_to_blocks["r"]] == \
        ids[:4] + [pool.null_block.block_id] * 3 + ids[7:]
    assert pool.get_num_free_blocks() == free_before + 3


def test_rswa_gap_call_gives_a_request_without_blocks_no_table():
    """allocate_slots frees the gap before it may refuse: a refused newcomer must
    not get an empty table, which would count in get_num_common_prefix_blocks
    (recorded on vLLM: tests/conformance/traces/rswa)."""
    pool = BlockPool(20, enable_caching=True, hash_block_size=4)
    manager = _manager(RSWAManager, RSWASpec(4, rswa_window=8), pool)
    manager.allocate_new_blocks("running", 8, 8)
    manager.remove_skipped_blocks("refused", 20, num_prompt_tokens=20)
    assert "refused" not in manager.req_to_blocks
    assert manager.get_num_common_prefix_blocks("running") == 2
    window = _manager(SlidingWindowManager, SlidingWindowSpec(4, 4), pool)
    window.remove_skipped_blocks("refused", 20)     # a window's call does give one
    assert "refused" in window.req_to_blocks and not window.req_to_blocks["refused"]


def test_sink_manager_holds_its_sink_blocks_from_the_start():
    pool = BlockPool(10, enable_caching=True, hash_block_size=4)
    free = pool.get_num_free_blocks()
    manager = _manager(SinkFullAttentionManager, SinkFullAttentionSpec(4, sink_len=8), pool)
    assert len(manager.sink_blocks) == 2 and pool.get_num_free_blocks() == free - 2
    with pytest.raises(ValueError, match="multiple of the block size"):
        _manager(SinkFullAttentionManager, SinkFullAttentionSpec(4, sink_len=6), pool)


# -- prompt embeddings in the block hash ---------------------------------------------------


def test_prompt_embeddings_join_the_block_hash():
    torch = pytest.importorskip("torch")
    from kvref import get_request_block_hasher, init_none_hash, sha256

    init_none_hash(sha256)
    hasher = get_request_block_hasher(4, sha256)
    embeds = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    plain = Request("a", [0] * 8, block_hasher=hasher)
    same = Request("b", [0] * 8, block_hasher=hasher, prompt_embeds=embeds)
    again = Request("c", [0] * 8, block_hasher=hasher, prompt_embeds=embeds.clone())
    other = embeds.clone()
    other[5, 0] += 1
    changed = Request("d", [0] * 8, block_hasher=hasher, prompt_embeds=other)
    assert same.block_hashes == again.block_hashes
    assert same.block_hashes[0] != plain.block_hashes[0]
    assert changed.block_hashes[0] == same.block_hashes[0]      # block 0 embeds equal
    assert changed.block_hashes[1] != same.block_hashes[1]
    with pytest.raises(ValueError, match="prompt_embeds has 7 rows"):
        Request("e", [0] * 8, prompt_embeds=embeds[:7])
