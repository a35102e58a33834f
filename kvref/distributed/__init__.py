"""Moving KV between engines and tiers (mirrors ``vllm/distributed/``).

Only the KV-transfer part of vLLM's ``distributed`` package exists here:
``kv_transfer/kv_connector/v1/`` holds the connector interface and three
connectors that move real KV tensors (a block-hash keyed store on disk, a
prefill-to-decode transfer between two processes, a host-memory offload tier).
"""
