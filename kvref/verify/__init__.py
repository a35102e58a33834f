"""How kvref is checked; no vLLM counterpart.

- ``invariants``: ``check(obj)`` asserts every invariant of ``specs/`` that one
  snapshot of a ``KVCacheManager`` or ``BlockPool`` can show (it also accepts a
  real vLLM v0.25.1 manager); ``check_kv_cache_manager(manager,
  popped_blocks=...)`` and ``check_block_pool(pool)`` are its two halves. The
  core has no checking method of its own: it imports nothing from here.
- ``trace_replay``: replays recorded vLLM traces (``kvtrace/1``) against kvref
  and reports the first divergence.
"""
