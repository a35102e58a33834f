"""kvref: a readable reference of vLLM v1's KV cache layer (vLLM v0.25.1).

Three layers, as in vLLM (``kvref/core/`` mirrors ``vllm/v1/core/``)::

    KVCacheManager          scheduler-facing facade       core/kv_cache_manager.py
      KVCacheCoordinator    one manager per KV group      core/kv_cache_coordinator.py
        SingleTypeKVCacheManager (full, window, ...)      core/single_type_kv_cache_manager.py
          BlockPool         blocks, free queue, index     core/block_pool.py

Everything public is importable from here: ``from kvref import KVCacheManager``.
The core is pure Python. Above it, in vLLM's folders (README's layout table):
``kvref.sched`` (the scheduler), ``kvref.worker`` (block table, runners),
``kvref.engine`` (the step loop), ``kvref.entrypoints`` (``LLM``). The
scheduling side (``Scheduler``, ``EngineCore``, ``ModelFreeRunner``) imports
without torch; the tensor side (``kvref.attention``, the block table, the
model runner, ``kvref.model_executor``, ``LLM``) needs it, and nothing here
imports it.
"""

from kvref.hashing import sha256, sha256_cbor
from kvref.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    TQFullAttentionSpec,
    UniformTypeKVCacheSpecs,
    get_dtype_size,
)
from kvref.kv_cache_spec_registry import KVCacheSpecRegistry, register_kv_cache_spec
from kvref.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    capacity_config,
    estimate_max_model_len,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    get_request_block_hasher,
    get_uniform_page_size,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    max_memory_usage_bytes,
)
from kvref.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvref.request import (
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)
from kvref.stats import PrefixCacheStats
from kvref.core.block_pool import BlockHashToBlockMap, BlockPool
from kvref.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
    register_all_kvcache_specs,
)
from kvref.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvref.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

__version__ = "0.1.0"
VLLM_VERSION = "0.25.1"

__all__ = [
    "AllBlocksCleared", "AttentionSpec", "BlockHashListWithBlockSize", "BlockHashToBlockMap",
    "BlockPool", "BlockRemoved", "BlockStored", "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec", "CrossAttentionManager", "CrossAttentionSpec",
    "FreeKVCacheBlockQueue", "FullAttentionManager", "FullAttentionSpec",
    "HybridKVCacheCoordinator", "KVCacheBlock", "KVCacheBlocks", "KVCacheConfig",
    "KVCacheCoordinator", "KVCacheCoordinatorNoPrefixCache", "KVCacheGroupSpec",
    "KVCacheManager", "KVCacheSpec", "KVCacheSpecKind", "LoRARequest", "MambaManager",
    "MambaSpec", "MultiModalFeatureSpec", "PlaceholderRange", "PrefixCacheStats", "Request",
    "RequestStatus", "SingleTypeKVCacheManager", "SlidingWindowManager",
    "SlidingWindowSpec", "UnitaryKVCacheCoordinator", "generate_block_hash_extra_keys",
    "get_block_hash", "get_group_id", "get_kv_cache_coordinator",
    "get_manager_for_kv_cache_spec", "get_request_block_hasher", "hash_block_tokens",
    "init_none_hash", "make_block_hash_with_group_id", "sha256", "sha256_cbor",
    # capacity arithmetic (vllm/v1/core/kv_cache_utils.py)
    "estimate_max_model_len", "get_dtype_size", "get_max_concurrency_for_kv_cache_config",
    "get_num_blocks", "get_uniform_page_size", "max_memory_usage_bytes",
    # more spec types, the spec registry, and the KV cache config builder
    "EncoderOnlyAttentionSpec", "HiddenStateCacheSpec", "KVCacheSpecRegistry", "KVCacheTensor",
    "MLAAttentionSpec", "RSWAManager", "RSWASpec", "SinkFullAttentionManager",
    "SinkFullAttentionSpec", "SlidingWindowMLASpec", "TQFullAttentionSpec",
    "UniformTypeKVCacheSpecs", "capacity_config", "get_kv_cache_config_from_groups",
    "get_kv_cache_configs", "get_kv_cache_groups", "register_all_kvcache_specs",
    "register_kv_cache_spec",
]
