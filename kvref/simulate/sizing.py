"""How many KV blocks a model gets on a GPU, as vLLM 0.25.1 sizes its pool.

No vLLM counterpart as one file: the arithmetic is kvref's own capacity code
(``kvref/core/kv_cache_utils.py``, ``specs/capacity.md``, lesson 12), fed with
a model shape instead of a loaded model. The chain, per GPU::

    budget     = gpu_memory * gpu_memory_utilization - weights / tp - reserved
    groups     = get_kv_cache_groups({layer: spec})        (the hybrid grouping)
    num_blocks = budget // page_size // (layers of the largest group)

``reserved`` is what vLLM measures by profiling a forward pass (activations,
CUDA graphs, non-torch memory); kvref runs no model, so it is a flag
(``--reserved-gib``), and the weights are ``num_params * dtype bytes``.

Hybrid Mamba models: vLLM raises the attention block size so that one
attention page holds at least one Mamba state
(``vllm/platforms/interface.py:750-900``, ``_align_hybrid_block_size``), and
with prefix caching on it picks the Mamba cache mode ``"all"`` for models that
support Mamba prefix caching, ``"align"`` otherwise
(``vllm/model_executor/models/config.py:558-573``). In ``"all"`` mode the
block is a multiple of ``lcm(mamba_chunk_size, kernel alignment)``
(``interface.py:869-878``); otherwise of the kernel alignment (``:880-884``).
``mamba_hybrid_block_size`` follows that rule::

    >>> mamba_hybrid_block_size(NAMED_SHAPES["nemotron-h-8b-like"], "all")
    640
    >>> mamba_hybrid_block_size(NAMED_SHAPES["nemotron-h-8b-like"], "align")
    528
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvref.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                      MambaSpec, SlidingWindowSpec)
from kvref.math_utils import cdiv

__all__ = ["GiB", "ModelShape", "blocks_never_evicting", "NAMED_SHAPES", "PoolSize", "mamba_hybrid_block_size",
           "model_shape_from_hf_config", "pool_from_memory", "pool_from_tokens"]

GiB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
# The smallest kernel block size of FlashAttention, vLLM's default CUDA backend
# (MultipleOf(16)); the "kernel block alignment" of _align_hybrid_block_size.
KERNEL_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache (and its weights). Layers of three kinds:
    full attention, sliding-window attention, Mamba-2."""

    name: str
    num_params: float                      # for the weights' bytes
    num_full_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    num_sliding_layers: int = 0
    sliding_window: int | None = None
    num_mamba_layers: int = 0
    # Mamba-2 (vLLM's mamba2_state_shape): conv state (conv_kernel - 1) x
    # (heads * head_dim + 2 * groups * state), SSM state heads x head_dim x state.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 128
    supports_mamba_prefix_caching: bool = True
    max_position_embeddings: int = 131072

    @property
    def is_mamba_hybrid(self) -> bool:
        return self.num_mamba_layers > 0

    def kv_heads_per_gpu(self, tp: int) -> int:
        # vLLM replicates KV heads when there are fewer than GPUs.
        return max(1, self.num_kv_heads // tp)

    def mamba_shapes(self, tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        conv_dim = self.mamba_num_heads * self.mamba_head_dim \
            + 2 * self.mamba_n_groups * self.mamba_state_size
        return ((self.mamba_conv_kernel - 1, conv_dim // tp),
                (self.mamba_num_heads // tp, self.mamba_head_dim, self.mamba_state_size))

    def mamba_page_bytes(self, tp: int = 1) -> int:
        size = DTYPE_BYTES[self.dtype]
        return sum(math.prod(s) * size for s in self.mamba_shapes(tp))

    def attention_bytes_per_token(self, tp: int = 1) -> int:
        """One token of one attention layer: a key and a value per KV head."""
        return 2 * self.kv_heads_per_gpu(tp) * self.head_size * DTYPE_BYTES[self.dtype]


NAMED_SHAPES: dict[str, ModelShape] = {s.name: s for s in [
    # Meta-Llama-3-8B's config.json: 32 layers, 8 KV heads of 128.
    ModelShape("llama-3-8b-like", 8.03e9, 32, 8, 128, max_position_embeddings=8192),
    # Meta-Llama-3-70B: 80 layers, 8 KV heads of 128.
    ModelShape("llama-3-70b-like", 70.6e9, 80, 8, 128, max_position_embeddings=8192),
    # Gemma-3-12B-shaped: 48 layers, 5 sliding (window 1024) to 1 full, 8 KV heads of 256.
    ModelShape("gemma-3-12b-like", 12.2e9, 8, 8, 256, num_sliding_layers=40,
               sliding_window=1024),
    # Nemotron-H-8B-shaped: 4 attention layers, 24 Mamba-2 layers (128 heads of 64,
    # state 128, 8 groups, conv kernel 4, chunk 128).
    ModelShape("nemotron-h-8b-like", 8.1e9, 4, 8, 128, num_mamba_layers=24,
               mamba_num_heads=128, mamba_head_dim=64, mamba_state_size=128,
               mamba_n_groups=8, mamba_conv_kernel=4, mamba_chunk_size=128),
]}


def model_shape_from_hf_config(path: str | Path, num_params: float | None = None) -> ModelShape:
    """A ``ModelShape`` from a local Hugging Face ``config.json`` (dense or sliding-window
    models; ``layer_types`` tells full from sliding layers)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a config.json at {path}: {exc}") from None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        head_size = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: missing or bad field {exc} (need num_hidden_layers, "
                         "num_attention_heads, hidden_size or head_dim)") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    types = cfg.get("layer_types") or []
    sliding = sum(1 for t in types if t == "sliding_attention")
    window = cfg.get("sliding_window") if sliding else None
    if num_params is None:
        # A rough count: attention + gated MLP per layer, embeddings (tied or not).
        hidden = int(cfg.get("hidden_size", heads * head_size))
        inter = int(cfg.get("intermediate_size", 4 * hidden))
        vocab = int(cfg.get("vocab_size", 32000))
        per_layer = hidden * head_size * (2 * heads + 2 * kv_heads) + 3 * hidden * inter
        num_params = layers * per_layer + vocab * hidden * (
            1 if cfg.get("tie_word_embeddings") else 2)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return ModelShape(path.parent.name or "config", float(num_params), layers - sliding,
                      kv_heads, head_size, dtype if dtype in DTYPE_BYTES else "bfloat16",
                      num_sliding_layers=sliding, sliding_window=window,
                      max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)))


def mamba_hybrid_block_size(shape: ModelShape, mamba_cache_mode: str, block_size: int = 16,
                            tp: int = 1) -> int:
    """The attention block size vLLM sets for a hybrid Mamba model (module docstring)."""
    mamba_page = shape.mamba_page_bytes(tp)
    attn_token = shape.attention_bytes_per_token(tp)
    align = max(KERNEL_BLOCK_ALIGNMENT, block_size)
    if mamba_cache_mode == "all":
        chunk = math.lcm(shape.mamba_chunk_size, align)
        attn_block = chunk * cdiv(cdiv(mamba_page, attn_token), chunk)
    else:
        attn_block = align * cdiv(mamba_page, align * attn_token)
    return max(block_size, attn_block)


@dataclass(frozen=True)
class PoolSize:
    """The pool the simulation runs on, and how it was sized (for the report)."""

    kv_cache_config: KVCacheConfig
    block_size: int                    # attention block size (the scheduler's with one group)
    how: str                           # one line: where num_blocks came from
    mamba_cache_mode: str | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    @property
    def tokens(self) -> int:
        """Tokens of KV one group holds (the null block holds none)."""
        return (self.num_blocks - 1) * self.block_size


def _layer_specs(shape: ModelShape, block_size: int, tp: int, enable_prefix_caching: bool,
                 mamba_cache_mode: str | None) -> tuple[dict, int, str | None]:
    heads, dtype = shape.kv_heads_per_gpu(tp), shape.dtype
    if shape.is_mamba_hybrid:
        if not enable_prefix_caching:
            mamba_cache_mode = "none"          # vLLM forces it (config.py:591-597)
        elif mamba_cache_mode in (None, "none"):
            # vLLM replaces "none" when prefix caching is on (config.py:558-567).
            mamba_cache_mode = "all" if shape.supports_mamba_prefix_caching else "align"
        elif mamba_cache_mode == "all" and not shape.supports_mamba_prefix_caching:
            mamba_cache_mode = "align"         # config.py:568-577
        block_size = mamba_hybrid_block_size(shape, mamba_cache_mode, block_size, tp)
    specs: dict = {}
    attn = FullAttentionSpec(block_size, num_kv_heads=heads, head_size=shape.head_size,
                             dtype=dtype)
    for i in range(shape.num_full_layers):
        specs[f"full.{i}"] = attn
    if shape.num_sliding_layers:
        window = SlidingWindowSpec(block_size, shape.sliding_window, num_kv_heads=heads,
                                   head_size=shape.head_size, dtype=dtype)
        for i in range(shape.num_sliding_layers):
            specs[f"swa.{i}"] = window
    if shape.is_mamba_hybrid:
        mamba = MambaSpec(block_size, mamba_cache_mode=mamba_cache_mode,
                          shapes=shape.mamba_shapes(tp), dtypes=(dtype, dtype),
                          page_size_padded=attn.page_size_bytes)
        for i in range(shape.num_mamba_layers):
            specs[f"mamba.{i}"] = mamba
    return specs, block_size, mamba_cache_mode


def pool_from_memory(shape: ModelShape, *, gpu_memory_gib: float, max_model_len: int,
                     max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9,
                     tensor_parallel_size: int = 1, reserved_gib: float = 2.0,
                     block_size: int = 16, enable_prefix_caching: bool = True,
                     mamba_cache_mode: str | None = None) -> PoolSize:
    """The pool vLLM would build for ``shape`` on one GPU of ``gpu_memory_gib``."""
    from kvref.core.kv_cache_utils import (capacity_config, generate_scheduler_kv_cache_config,
                                           get_kv_cache_configs)

    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    tp = tensor_parallel_size
    weights = shape.num_params * DTYPE_BYTES[shape.dtype] / tp
    budget = int(gpu_memory_gib * GiB * gpu_memory_utilization - weights - reserved_gib * GiB)
    if budget <= 0:
        raise ValueError(f"no memory left for the KV cache: {gpu_memory_gib} GiB x "
                         f"{gpu_memory_utilization} - {weights / GiB:.1f} GiB of weights "
                         f"(tp {tp}) - {reserved_gib} GiB reserved = {budget / GiB:.1f} GiB")
    specs, block_size, mode = _layer_specs(shape, block_size, tp, enable_prefix_caching,
                                           mamba_cache_mode)
    vllm_config = capacity_config(max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                  mamba_cache_mode=mode or "none")
    [config] = get_kv_cache_configs(vllm_config, [specs], [budget])
    config = generate_scheduler_kv_cache_config([config])
    how = (f"{shape.name} on {gpu_memory_gib:g} GiB x {gpu_memory_utilization:g} "
           f"(tp {tp}): {budget / GiB:.1f} GiB for KV after {weights / GiB:.1f} GiB of weights "
           f"and {reserved_gib:g} GiB reserved -> {config.num_blocks} blocks of {block_size}")
    return PoolSize(config, block_size, how, mode)


def pool_from_tokens(num_blocks: int, *, shape: ModelShape | None = None, block_size: int = 16,
                     enable_prefix_caching: bool = True, mamba_cache_mode: str | None = None,
                     how: str = "") -> PoolSize:
    """A pool of ``num_blocks`` blocks (the null block one of them) for ``shape``'s
    groups, or one full-attention group without a shape."""
    from kvref.core.kv_cache_utils import get_kv_cache_groups, capacity_config

    if shape is None:
        groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(block_size))]
        mode = None
    else:
        specs, block_size, mode = _layer_specs(shape, block_size, 1, enable_prefix_caching,
                                               mamba_cache_mode)
        groups = get_kv_cache_groups(capacity_config(1, mamba_cache_mode=mode or "none"), specs)
        groups = [replace(g, kv_cache_spec=next(iter(g.kv_cache_spec.kv_cache_specs.values())))
                  if hasattr(g.kv_cache_spec, "kv_cache_specs") else g for g in groups]
    return PoolSize(KVCacheConfig(num_blocks, groups), block_size, how, mode)


def blocks_never_evicting(requests, block_size: int, num_groups: int = 1,
                          max_output_tokens: int | None = None) -> int:
    """A pool no trace request ever has to evict from ("--kv-cache-tokens inf"): every
    block each request could hold, in every group, plus the null block."""
    total = 0
    for r in requests:
        out = r.max_tokens if max_output_tokens is None else min(r.max_tokens,
                                                                  max_output_tokens)
        total += cdiv(r.input_length + out, block_size) + 1
    return num_groups * total + 1
