"""Capacity arithmetic: page sizes, blocks per request per attention type, pool
size from a memory budget, and how many requests fit (vLLM's kv_cache_utils)."""

from __future__ import annotations

import pytest

from kvref import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    Request,
    SlidingWindowSpec,
    estimate_max_model_len,
    get_dtype_size,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    get_request_block_hasher,
    get_uniform_page_size,
    init_none_hash,
    max_memory_usage_bytes,
    sha256,
)

LLAMA_8B_LAYER = dict(num_kv_heads=8, head_size=128, dtype="bfloat16")


# -- page size ----------------------------------------------------------------

def test_attention_page_is_keys_and_values_of_every_token_head_and_channel():
    spec = FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 65536


def test_page_size_scales_with_dtype_and_block_size():
    assert FullAttentionSpec(16, dtype="float32").page_size_bytes == 2 * 16 * 4
    assert FullAttentionSpec(32, dtype="float8").page_size_bytes == 2 * 32 * 1
    assert SlidingWindowSpec(16, 64, num_kv_heads=2, head_size=8).page_size_bytes == \
        2 * 16 * 2 * 8 * 2


def test_dtype_size_reads_torch_style_names_without_importing_torch():
    assert get_dtype_size("torch.bfloat16") == 2
    assert get_dtype_size("float32") == 4
    assert get_dtype_size("float8_e4m3fn") == 1


def test_an_unknown_dtype_is_an_error_naming_it():
    with pytest.raises(ValueError, match="complex64"):
        FullAttentionSpec(16, dtype="complex64").page_size_bytes


def test_mamba_page_is_its_state_tensors_or_the_padded_size():
    spec = MambaSpec(16, shapes=((4, 8), (2, 3)), dtypes=("float32", "float16"))
    assert spec.page_size_bytes == 4 * 8 * 4 + 2 * 3 * 2
    assert MambaSpec(16, page_size_padded=4096).page_size_bytes == 4096
    with pytest.raises(ValueError, match="no page size"):
        MambaSpec(16).page_size_bytes
    # As in vLLM, any shapes/dtypes build a spec (vLLM's own tests pass
    # shapes=(1, 1), dtypes=(torch.float32,)); only the page size reads them.
    odd = MambaSpec(16, shapes=((4,),), dtypes=())
    with pytest.raises(ValueError, match="one dtype per state shape"):
        odd.page_size_bytes
    with pytest.raises(ValueError, match="below the states"):
        MambaSpec(16, shapes=((4,),), dtypes=("float32",), page_size_padded=8).page_size_bytes
    with pytest.raises(ValueError, match="page_size_padded must be a positive int"):
        MambaSpec(16, page_size_padded=0)


def test_mamba_default_mode_is_vllms_none():
    assert MambaSpec(16).mamba_cache_mode == "none"
    assert MambaSpec(16).max_num_blocks_per_request(max_model_len=1000) == 1


def test_capacity_fields_leave_spec_equality_as_it_was():
    assert MambaSpec(16, "align") == MambaSpec(16, "align")
    assert MambaSpec(16, page_size_padded=64) != MambaSpec(16)


# -- blocks one request holds at its peak, per attention type -----------------

def test_full_attention_holds_every_block_of_the_longest_sequence():
    assert FullAttentionSpec(16).max_num_blocks_per_request(max_model_len=1000) == 63
    assert FullAttentionSpec(16).max_num_blocks_per_request(max_model_len=1024) == 64


def test_sliding_window_holds_window_minus_one_plus_a_batch_plus_one_block():
    spec = SlidingWindowSpec(16, 128)
    # (128 - 1 + 256) tokens -> 24 blocks, +1 because the window starts mid-block
    assert spec.max_num_blocks_per_request(max_model_len=10_000,
                                           max_num_batched_tokens=256) == 25
    # never more than the whole sequence (+1)
    assert spec.max_num_blocks_per_request(max_model_len=100,
                                           max_num_batched_tokens=256) == 8
    # without a batch limit, the manager's default: max_model_len
    assert spec.max_num_blocks_per_request(max_model_len=100) == 8


def test_chunked_local_holds_one_chunk_plus_a_batch():
    spec = ChunkedLocalAttentionSpec(16, 64)
    assert spec.max_num_blocks_per_request(max_model_len=10_000,
                                           max_num_batched_tokens=32) == 6


def test_recycling_types_count_their_admission_cap():
    for spec in (SlidingWindowSpec(4, 9), ChunkedLocalAttentionSpec(4, 8)):
        assert spec.max_num_blocks_per_request(max_model_len=500, max_num_batched_tokens=7) \
            == spec.max_admission_blocks_per_request(7, 500)


@pytest.mark.parametrize("mode, spec_blocks, expected", [
    ("all", 0, 63), ("all", 2, 65), ("align", 0, 2), ("align", 2, 4),
    ("none", 0, 1), ("none", 1, 2),
])
def test_mamba_holds_states_by_cache_mode(mode, spec_blocks, expected):
    spec = MambaSpec(16, mode, spec_blocks)
    assert spec.max_num_blocks_per_request(max_model_len=1000) == expected


def test_cross_attention_holds_the_encoder_output_whatever_the_decoder_length():
    spec = CrossAttentionSpec(16)
    assert spec.max_num_blocks_per_request(max_model_len=448,
                                           max_num_encoder_input_tokens=1500) == 94
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        spec.max_num_blocks_per_request(max_model_len=448)


def test_peak_bytes_are_peak_blocks_times_the_page():
    spec = SlidingWindowSpec(16, 128, **LLAMA_8B_LAYER)
    assert spec.max_memory_usage_bytes(max_model_len=8192, max_num_batched_tokens=256) \
        == 25 * 65536
    specs = [FullAttentionSpec(16, **LLAMA_8B_LAYER)] * 32
    assert max_memory_usage_bytes(specs, max_model_len=8192) == 32 * 512 * 65536


# -- the pool and the requests in it -------------------------------------------

def test_a_memory_budget_buys_bytes_over_page_over_layers_blocks():
    page = FullAttentionSpec(16, **LLAMA_8B_LAYER).page_size_bytes
    assert get_num_blocks(32, 8 * 2**30, page) == 4096
    assert get_num_blocks(32, 8 * 2**30 - 1, page) == 4095
    assert get_num_blocks(32, 0, page) == 0
    assert get_num_blocks(32, 8 * 2**30, page, num_gpu_blocks_override=100) == 100
    with pytest.raises(ValueError, match="must be positive"):
        get_num_blocks(0, 8 * 2**30, page)


def test_groups_sharing_a_pool_must_share_a_page_size():
    full = FullAttentionSpec(16)
    assert get_uniform_page_size([full, SlidingWindowSpec(16, 8)]) == full.page_size_bytes
    with pytest.raises(ValueError, match="one page size"):
        get_uniform_page_size([full, FullAttentionSpec(32)])


def _config(num_blocks, *specs, layers_per_group=1):
    return KVCacheConfig(num_blocks, [
        KVCacheGroupSpec([f"g{g}.l{i}" for i in range(layers_per_group)], spec)
        for g, spec in enumerate(specs)])


def test_max_concurrency_of_full_attention_is_blocks_over_blocks_per_request():
    config = _config(4096, FullAttentionSpec(16, **LLAMA_8B_LAYER), layers_per_group=32)
    assert get_max_concurrency_for_kv_cache_config(config, max_model_len=8192) == 8.0
    assert get_max_concurrency_for_kv_cache_config(config, max_model_len=8000) == 4096 / 500


def test_max_concurrency_of_a_hybrid_adds_each_groups_blocks():
    config = _config(4096, FullAttentionSpec(16), SlidingWindowSpec(16, 1024))
    # 512 full-attention blocks + 193 sliding-window blocks per request
    assert get_max_concurrency_for_kv_cache_config(
        config, max_model_len=8192, max_num_batched_tokens=2048) == pytest.approx(4096 / 705)


def test_max_concurrency_with_mamba_uses_the_padded_page():
    full = FullAttentionSpec(16)
    config = _config(100, full, MambaSpec(16, "align", page_size_padded=full.page_size_bytes))
    # 64 full-attention blocks + 2 states per request
    assert get_max_concurrency_for_kv_cache_config(config, max_model_len=1024) == 100 / 66


def test_max_concurrency_needs_groups():
    with pytest.raises(ValueError, match="no groups"):
        get_max_concurrency_for_kv_cache_config(KVCacheConfig(4, []), max_model_len=16)


def test_estimate_max_model_len_is_the_longest_length_that_fits():
    specs = [FullAttentionSpec(16)] * 2            # 64 bytes a block, 2 layers
    budget = 2 * 10 * 64                           # 10 blocks a layer
    assert estimate_max_model_len(specs, budget, max_model_len=1000) == 160
    assert estimate_max_model_len(specs, budget, max_model_len=100) == 100
    assert estimate_max_model_len(specs, 127, max_model_len=1000) == 0


def test_max_concurrency_matches_what_the_manager_admits():
    """The concurrency figure is what the pool really holds: with one block
    spare for the null block, exactly floor(concurrency) full-length requests
    get their blocks, and the next one is refused."""
    init_none_hash(sha256)
    spec = FullAttentionSpec(4)
    max_model_len = 16                                     # 4 blocks a request
    config = _config(3 * 4 + 1, spec)
    assert int(get_max_concurrency_for_kv_cache_config(config, max_model_len=16)) == 3
    manager = KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=4,
                             hash_block_size=4)
    hasher = get_request_block_hasher(4, sha256)
    for i in range(3):
        req = Request(f"r{i}", [100 * i + t for t in range(16)], block_hasher=hasher)
        assert manager.allocate_slots(req, 16) is not None
    late = Request("r3", [300 + t for t in range(16)], block_hasher=hasher)
    assert manager.allocate_slots(late, 16) is None
