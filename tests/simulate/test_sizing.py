"""The pool a model shape gets on a GPU, as vLLM sizes it (kvref's capacity arithmetic)."""

from __future__ import annotations

import json

import pytest

from kvref.simulate import NAMED_SHAPES, model_shape_from_hf_config, pool_from_memory
from kvref.simulate.sizing import GiB, mamba_hybrid_block_size

ARGS = dict(gpu_memory_gib=80, max_model_len=32768, max_num_batched_tokens=8192)


def budget(shape, tp, reserved=2.0):
    return int(80 * GiB * 0.9 - shape.num_params * 2 / tp - reserved * GiB)


def test_a_dense_model_divides_the_budget_by_its_layers_pages():
    llama = NAMED_SHAPES["llama-3-8b-like"]
    pool = pool_from_memory(llama, **ARGS)
    page = 2 * 16 * 8 * 128 * 2                           # K and V, 16 tokens, 8 heads of 128
    assert pool.num_blocks == budget(llama, 1) // page // 32


def test_tensor_parallelism_splits_weights_and_kv_heads():
    big = NAMED_SHAPES["llama-3-70b-like"]
    pool = pool_from_memory(big, tensor_parallel_size=4, **ARGS)
    page = 2 * 16 * (8 // 4) * 128 * 2                    # 2 KV heads per GPU
    assert pool.num_blocks == budget(big, 4) // page // 80
    with pytest.raises(ValueError, match="no memory left"):
        pool_from_memory(big, **ARGS)                      # 141 GB of weights on one GPU


def test_a_sliding_window_hybrid_shares_tensors_across_its_six_groups():
    """8 full + 40 window layers: six groups of 8 layers, the budget divided by 8 pages."""
    gemma = NAMED_SHAPES["gemma-3-12b-like"]
    pool = pool_from_memory(gemma, **ARGS)
    groups = pool.kv_cache_config.kv_cache_groups
    assert len(groups) == 6 and all(len(g.layer_names) == 8 for g in groups)
    page = 2 * 16 * 8 * 256 * 2
    assert pool.num_blocks == budget(gemma, 1) // page // 8


def test_a_mamba_hybrid_takes_vllms_block_size_and_mode():
    nemotron = NAMED_SHAPES["nemotron-h-8b-like"]
    # One state: conv 3 x (128 * 64 + 2 * 8 * 128) + SSM 128 x 64 x 128, bfloat16.
    assert nemotron.mamba_page_bytes() == 2 * (3 * 10240 + 128 * 64 * 128) == 527 * 4096
    assert mamba_hybrid_block_size(nemotron, "all") == 640     # 128 * cdiv(527, 128)
    assert mamba_hybrid_block_size(nemotron, "align") == 528   # 16 * cdiv(527, 16)
    pool = pool_from_memory(nemotron, **ARGS)
    assert pool.mamba_cache_mode == "all" and pool.block_size == 640
    off = pool_from_memory(nemotron, enable_prefix_caching=False, **ARGS)
    assert off.mamba_cache_mode == "none" and off.block_size == 528


def test_a_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 64}))
    shape = model_shape_from_hf_config(tmp_path)
    assert (shape.num_full_layers, shape.num_sliding_layers, shape.sliding_window,
            shape.head_size, shape.num_kv_heads) == (2, 2, 64, 64, 2)
    with pytest.raises(ValueError, match="missing or bad field"):
        (tmp_path / "bad").mkdir()
        (tmp_path / "bad" / "config.json").write_text("{}")
        model_shape_from_hf_config(tmp_path / "bad")
