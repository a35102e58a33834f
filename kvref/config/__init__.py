"""Configuration the engine is built from: the model's architecture.

Mirrors ``vllm/config/`` for one file, ``model.py`` (``ModelConfig``, the part
of ``vllm/config/model.py`` kvref's model reads). No torch. The KV cache's own
configuration (``KVCacheConfig``) lives in ``kvref/kv_cache_interface.py``, as
vLLM keeps it in ``vllm/v1/kv_cache_interface.py``.
"""
