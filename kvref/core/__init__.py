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

Imports only go down: along this list, and to the vocabulary modules beside
the package (``kv_cache_interface``, ``kv_cache_spec_registry``, ``request``,
``kv_events``, ``stats``, ``hashing``, ``math_utils``, ``sampling_params``,
``outputs``), never up to what reads the core (``kvref.sched``, ``kvref.verify``,
``kvref.engine``, ``kvref.viz``, ...), not even inside a function. vLLM's
``v1/core/sched/`` is kvref's ``kvref/sched/``, one floor up: the scheduler
is the KV layer's caller. The invariant checker reads the core from outside:
``kvref.verify.invariants.check_kv_cache_manager(manager, popped_blocks=...)``
and ``check_block_pool(pool)``. ``tests/test_layout.py`` enforces all of it.
Import from ``kvref`` itself: ``from kvref import KVCacheManager``.
"""
