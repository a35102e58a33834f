"""KV transfer (mirrors ``vllm/distributed/kv_transfer/``): connectors and their config."""
