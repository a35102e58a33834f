"""The KV cache layer the scheduler talks to: mirrors ``vllm/v1/core/``.

One module per vLLM file, same names::

    kv_cache_manager.py              KVCacheManager, KVCacheBlocks (the facade)
    kv_cache_coordinator.py          no-cache / unitary / hybrid coordinators
    single_type_kv_cache_manager.py  one manager per attention type, Mamba included
    block_pool.py                    BlockPool, BlockHashToBlockMap
    kv_cache_utils.py                KVCacheBlock, the free queue, block hashing,
                                     capacity (blocks per request, max concurrency),
                                     and the config builder: layer specs into KV
                                     cache groups and a pool (get_kv_cache_groups,
                                     get_kv_cache_configs; its largest part)

Imports only go down this list, to the vocabulary modules one level up
(``kv_cache_interface``, ``request``, ``kv_events``, ``stats``, ``hashing``,
``math_utils``), and to one module outside: both ``check_valid`` methods
import ``kvref.verify.invariants`` inside the method (the checker reads the
core, so a top-level import would be a cycle). ``tests/test_layout.py``
checks all three. Import from ``kvref`` itself:
``from kvref import KVCacheManager``.
"""
